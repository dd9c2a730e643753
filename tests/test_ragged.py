"""The ragged backend's pieces that run on CPUs: its ragged_all_to_all plan against a NumPy model
of the collective, the emulation the CPU suites use in its place (tests/ragged_emulation.py)
against the documented example, the backend end to end through the emulation, and the clear
error on XLA:CPU. The real collective runs only on GPUs (scripts/gpu_check.sh, stage gpus)."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_moe_a2a as a2a
from jax_moe_a2a import backends
from jax_moe_a2a.backends.ragged import plan
from jax_moe_a2a.testing import shard_map
from ragged_emulation import emulated, emulated_ragged_all_to_all

import test_grad
import test_ops

EMULATED = os.environ.get("JAX_MOE_A2A_RAGGED_EMULATE") == "1"


def numpy_ragged_all_to_all(operands, outputs, args):
    """The documented semantics over all ranks at once: args[r] = (input_offsets, send_sizes,
    output_offsets, recv_sizes) of rank r. Asserts the arguments agree across ranks."""
    n = len(operands)
    results = [o.copy() for o in outputs]
    per = len(args[0][0]) // n
    for s in range(n):
        in_off, send, out_off, _ = args[s]
        for i in range(len(in_off)):
            d, slot = divmod(i, per)
            assert args[d][3][s * per + slot] == send[i], "send_sizes != the receiver's recv_sizes"
            assert in_off[i] + send[i] <= len(operands[s]) and out_off[i] + send[i] <= len(results[d])
            results[d][out_off[i]:out_off[i] + send[i]] = operands[s][in_off[i]:in_off[i] + send[i]]
    return results


@pytest.mark.parametrize("n, tp", [(1, 1), (2, 1), (3, 1), (4, 2), (8, 1), (8, 2), (8, 4)])
def test_plan_moves_every_row_where_it_belongs(n, tp):
    rng = np.random.default_rng(n * 10 + tp)
    m_send = 12
    for trial in range(20):
        # counts [N(src), N(dest)] with row sums <= m_send; some trials empty, some one-hot.
        counts = np.zeros((n, n), np.int32)
        for s in range(n):
            total = [0, m_send, int(rng.integers(0, m_send + 1))][trial % 3]
            dests = rng.integers(0, n, total) if trial % 4 else np.full(total, trial % n)
            counts[s] = np.bincount(dests, minlength=n)
        plans = [plan(jnp.asarray(counts), r, tp, m_send) for r in range(n)]
        plans = [tuple(tuple(np.asarray(a) for a in p) for p in pl) for pl in plans]
        # Dispatch: rank s sends its rows sorted by destination, labelled (s, d, i).
        send = []
        for s in range(n):
            rows = [(s, d, i) for d in range(n) for i in range(counts[s, d])]
            send.append(np.array(rows + [(-1, -1, -1)] * (m_send - len(rows))).reshape(m_send, 3))
        m_recv = n * m_send
        got = numpy_ragged_all_to_all(send, [np.full((m_recv, 3), -2)] * n, [pl[0] for pl in plans])
        for d in range(n):
            want = [(s, d, i) for s in range(n) for i in range(counts[s, d])]  # packed by source
            np.testing.assert_array_equal(got[d][:len(want)].reshape(-1, 3), np.array(want).reshape(-1, 3))
            assert (got[d][len(want):] == -2).all()
        # Combine: expert rank e sends back its packed rows; rank r's block j (its group's member
        # m = r // tp * tp + j) must hold m's rows to e at the offsets of m's send buffer.
        back = numpy_ragged_all_to_all(got, [np.full((tp * m_send, 3), -2)] * n, [pl[1] for pl in plans])
        for r in range(n):
            for j in range(tp):
                m = r // tp * tp + j
                block = back[r][j * m_send:(j + 1) * m_send]
                np.testing.assert_array_equal(block, send[m] * (send[m] >= 0) + -2 * (send[m] < 0))


def test_emulation_matches_documented_example():
    """The example of jax.lax.ragged_all_to_all's docstring, through the emulation."""
    mesh = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2])
    f = shard_map(lambda *a: emulated_ragged_all_to_all(*(v[0] for v in a), axis_name="x")[None],
                  mesh=mesh, in_specs=(P("x"),) * 6, out_specs=P("x"))
    args = [[[1, 2, 2], [3, 4, 0]], [[0] * 4, [0] * 4], [[0, 1], [0, 1]], [[1, 2], [1, 1]],
            [[0, 0], [1, 2]], [[1, 1], [2, 1]]]
    put = [jax.device_put(jnp.array(a, jnp.int32), NamedSharding(mesh, P("x"))) for a in args]
    np.testing.assert_array_equal(np.asarray(jax.jit(f)(*put)), [[1, 3, 0, 0], [2, 2, 4, 0]])
    bad = list(put)  # recv_sizes inconsistent with the senders' send_sizes: poisoned
    bad[5] = jax.device_put(jnp.array([[1, 1], [1, 1]], jnp.int32), NamedSharding(mesh, P("x")))
    assert (np.asarray(jax.jit(f)(*bad))[1] == -1).all()


@pytest.mark.skipif(EMULATED, reason="the emulation makes ragged available on CPUs")
def test_cpu_reports_why_unavailable(mesh):
    if jax.default_backend() != "cpu":
        pytest.skip("checks the XLA:CPU message")
    assert "ragged" not in a2a.available_backends()
    assert "XLA:CPU does not implement ragged-all-to-all" in backends.why_unavailable("ragged")
    spec = a2a.Spec(num_experts=8 * len(mesh.devices.flat), experts_per_token=2, hidden=32, max_tokens_per_rank=4)
    with pytest.raises(ValueError, match="XLA:CPU does not implement ragged-all-to-all"):
        a2a.init(spec, mesh, "ep", backend="ragged")
    assert a2a.init(spec, mesh, "ep").backend_name != "ragged"


CASES = {c[0]: c for c in test_ops.CASES}


@pytest.mark.parametrize("case_id", ["bf16-random", "fp8-random", "expert-major-fp8", "one-hot-expert",
                                     "empty-ranks", "minus-one-and-invalid", "num-tokens-zero", "tp2",
                                     "tp2-fp8-expert-major", "overflow-ragged-hot", "overflow-expert-major",
                                     "k-greater-than-l", "odd-sizes", "combine-into-out"])
def test_oracle_through_emulation(case_id, num_ranks, mesh):
    with emulated():
        test_ops.test_against_oracle("ragged", *CASES[case_id], num_ranks, mesh)


@pytest.mark.parametrize("layout, tp", [("ragged", 1), ("expert_major", 2)])
def test_grad_through_emulation(layout, tp, num_ranks, mesh):
    with emulated():
        test_grad.test_grad_matches_closed_form("ragged", layout, tp, num_ranks, mesh)
