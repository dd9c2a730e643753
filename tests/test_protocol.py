"""Protocol tests for every backend that runs the real protocol (FFI backends): two slots in
flight, a long soak, a rank that never calls. Backends from JAX_MOE_A2A_TEST_BACKENDS or all."""

import faulthandler
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_moe_a2a as a2a
from jax_moe_a2a import testing as T

from conftest import BACKENDS, PURE_JAX

# Slots and the soak: every backend with a protocol of its own (reference is one padded
# all_to_all; ragged exchanges counts, then rows). The timeout test: FFI backends only (an XLA
# collective waits for a missing rank forever).
PROTOCOL_BACKENDS = [b for b in BACKENDS if b != "reference"]
FFI_BACKENDS = [b for b in BACKENDS if b not in PURE_JAX]
FP8 = jnp.float8_e4m3fn
pytestmark = pytest.mark.skipif(not PROTOCOL_BACKENDS, reason="no FFI or ragged backend here")


@pytest.mark.mpi
@pytest.mark.parametrize("backend", PROTOCOL_BACKENDS)
def test_two_slots_interleaved(backend, num_ranks, mesh):
    """send A (slot 0), send B (slot 1), recv A, recv B, then both combines, several steps."""
    spec = a2a.Spec(num_experts=2 * num_ranks, experts_per_token=2, hidden=32, max_tokens_per_rank=8, slots=2)
    check_two_slots(a2a.init(spec, mesh, "ep", backend=backend, timeout_s=20), mesh)


def check_two_slots(comm, mesh, steps=5):
    """Two dispatches in flight on slots 0 and 1 of `comm`, then both combines, against the oracle."""
    from jax.sharding import PartitionSpec as P
    spec, n = comm.spec, comm.num_ranks

    def per_rank(xa, ia, wa, xb, ib, wb):
        ha = comm.dispatch_send(xa, ia, wa, slot=0)
        hb = comm.dispatch_send(xb, ib, wb, slot=1)
        ga = comm.dispatch_recv(ha)
        gb = comm.dispatch_recv(hb)
        ca = comm.combine_send(T.expert_fn_jax(spec, n, ga, jnp.bfloat16), ga)
        cb = comm.combine_send(T.expert_fn_jax(spec, n, gb, jnp.bfloat16), gb)
        return comm.combine_recv(ca)[None], comm.combine_recv(cb)[None]

    f = jax.jit(T.shard_map(per_rank, mesh=mesh, in_specs=(P("ep"),) * 6, out_specs=P("ep")))
    from jax_moe_a2a import oracle
    for step in range(steps):
        a = T.make_inputs(spec, n, 100 + step, num_tokens=spec.max_tokens_per_rank)
        b = T.make_inputs(spec, n, 200 + step, num_tokens=spec.max_tokens_per_rank, invalid_frac=0.1)
        args = []
        for inp in (a, b):
            args += T.global_args(mesh, inp, ("x", "topk_ids", "topk_weights"))
        oa, ob = f(*args)
        wa = oracle.combine(spec, a, T.expert_fn_np, np.dtype(jnp.bfloat16))
        wb = oracle.combine(spec, b, T.expert_fn_np, np.dtype(jnp.bfloat16))
        for r, v in T.local_ranks_of(oa).items():
            T.check_combine(spec, r, wa[r], v)
        for r, v in T.local_ranks_of(ob).items():
            T.check_combine(spec, r, wb[r], v)


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.parametrize("backend", PROTOCOL_BACKENDS)
def test_soak_1000_steps(backend, mesh, num_ranks):
    """1,000 steps of fresh random routing through one compiled step, zero mismatches."""
    steps = int(os.environ.get("JAX_MOE_A2A_SOAK_STEPS", "1000" if jax.process_count() == 1 else "100"))
    spec = a2a.Spec(num_experts=2 * num_ranks, experts_per_token=2, hidden=32, max_tokens_per_rank=6,
                    dispatch_dtype=FP8, scale_block=16, recv_capacity=4 * num_ranks)
    comm = a2a.init(spec, mesh, "ep", backend=backend, timeout_s=20, collect_stats=False)
    rng = np.random.default_rng(7)
    routings = ["random", "one_hot", "empty", "skewed"]
    for step in range(steps):
        inputs = T.make_inputs(spec, num_ranks, 10_000 + step, routing=routings[step % 4],
                               invalid_frac=float(rng.choice([0.0, 0.1])), minus_one_frac=0.1)
        T.check_all(comm, inputs, T.run_ops(comm, inputs, poison=step % 50 == 0))




@pytest.mark.mpi
@pytest.mark.parametrize("backend", FFI_BACKENDS)
def test_rank_that_never_calls_times_out(backend, num_ranks, mesh):
    """Every process but the last calls dispatch; the last compiles the step but never runs it.
    The callers must get an error naming the missing ranks within the timeout, not hang. On a GPU
    this runs only when JAX_MOE_A2A_TEST_TIMEOUT=1, in mpirun runs of its own that dump every
    process's stacks if it hangs anyway (scripts/gpu_check.sh, stages timeout and proxy)."""
    if jax.process_count() < 2:
        pytest.skip("needs several processes (a rank that never calls cannot be made in one program)")
    if backend in ("cuda", "nvshmem") and os.environ.get("JAX_MOE_A2A_TEST_TIMEOUT") != "1":
        pytest.skip("waits out the timeout: run alone with JAX_MOE_A2A_TEST_TIMEOUT=1")
    spec = a2a.Spec(num_experts=2 * num_ranks, experts_per_token=2, hidden=32, max_tokens_per_rank=4)
    check_never_calls(a2a.init(spec, mesh, "ep", backend=backend, timeout_s=2.0), mesh, backend)


def check_never_calls(comm, mesh, backend):
    """The last process compiles the step but never runs it; every other must fail within
    seconds with an error naming the silent process's ranks."""
    from jax_moe_a2a.runtime import forget_failed_effects, kv_client
    spec, num_ranks = comm.spec, comm.num_ranks
    if backend != "host":  # if this hangs anyway, show where every process is stuck
        faulthandler.dump_traceback_later(20, repeat=True, file=sys.stderr)
    silent = jax.process_count() - 1
    silent_ranks = [r for r, d in enumerate(mesh.devices.flat) if d.process_index == silent]
    inputs = T.make_inputs(spec, num_ranks, 3, num_tokens=spec.max_tokens_per_rank)
    if jax.process_index() == silent:
        # Compiles but never runs: on GPUs the others' compilation waits for this process's share
        # of the autotuning (XLA shards it over the processes compiling one program).
        T.run_ops(comm, inputs, compile_only=True)
    else:
        t0 = time.monotonic()
        first = None
        with pytest.raises(Exception) as info:
            # The host and reference backends raise in the step. The GPU backends end it without
            # data (combine output NaN, no trap) and raise at the next call of any half.
            first = T.run_ops(comm, inputs)
            T.run_ops(comm, inputs)
        took = time.monotonic() - t0
        for r, v in (first or {}).items():
            assert np.isnan(np.asarray(v["out"], np.float32)).all(), f"rank {r}: the failed step's output is not NaN"
        forget_failed_effects()  # else JAX re-raises the failed run's token at exit
        msg = str(info.value) + "\n" + (comm.last_error() or "")
        assert "did not arrive" in msg and "dispatch" in msg, msg
        assert any(str(r) in msg for r in silent_ranks), msg
        assert took < 30, f"took {took:.1f} s"
    kv_client().wait_at_barrier(f"jax_moe_a2a_never_calls_{comm.comm_id}", 60_000)
    if backend != "host":
        faulthandler.cancel_dump_traceback_later()
