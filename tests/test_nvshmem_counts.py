"""The nvshmem backend's dest_counts (cc/nvshmem/dispatch/send.cu): dispatch_send's count, per
expert rank r, of the rows r owes this rank's combine_recv, carried in the placement
(FfiPlacement.dest_counts) to combine_recv, which waits for exactly that many rows (a short count
would read rows before they land, a long one would time out). It must be the tp group's pairs of
tokens below num_tokens whose id is in range, not repeated earlier in its token and not stopped
by the rank mask, per expert rank: checked against NumPy on poisoned devices, with -1, invalid
and repeated ids, num_tokens below T, tp 1 and 2, with and without a mask, and the combine on
another slot than its dispatch (the counts travel with the data, not in the slot). GPU only."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_moe_a2a as a2a
from jax_moe_a2a import elastic, oracle
from jax_moe_a2a import testing as T

from conftest import BACKENDS

pytestmark = pytest.mark.skipif("nvshmem" not in BACKENDS, reason="nvshmem backend not selected or not available")


def with_repeats(inp):
    """`inp` with every third token's last id repeating its first (a pair dropped as repeated;
    the same rule on every rank keeps a tp group's inputs identical)."""
    ids = np.array(inp.topk_ids)
    ids[::3, -1] = ids[::3, 0]
    return dataclasses.replace(inp, topk_ids=ids)


def owed_rows(spec, n, rank, inp, mask):
    """NumPy: [N] rows each expert rank owes `rank` for the dispatch of `inp` (a RankInputs):
    the group's pairs (t < num_tokens, id in range and first in its token) per expert rank, after
    the pairs the mask stops (elastic.mask_ids: rewritten to E, so not counted)."""
    ids = np.asarray(inp.topk_ids)
    if mask is not None:
        ids = np.asarray(elastic.mask_ids(spec, n, jnp.int32(rank), jnp.asarray(ids), jnp.int32(inp.num_tokens),
                                          jnp.asarray(mask))[0])
    counts = np.zeros(n, np.int64)
    for t in range(int(inp.num_tokens)):
        row = [int(e) for e in ids[t]]
        for k, e in enumerate(row):
            if 0 <= e < spec.num_experts and e not in row[:k]:
                counts[e // spec.local_experts(n)] += 1
    return counts


@pytest.mark.mpi
@pytest.mark.parametrize("masked", [False, True], ids=["no-mask", "mask"])
@pytest.mark.parametrize("tp", [1, 2])
def test_dest_counts_are_the_rows_owed(tp, masked, monkeypatch, mesh, num_ranks):
    if num_ranks % tp:
        pytest.skip(f"tp {tp} does not divide {num_ranks} ranks")
    if masked and num_ranks < 2:
        pytest.skip("a mask needs a live rank besides the masked one")
    monkeypatch.setenv("JAX_MOE_A2A_LOCAL_PATH", "0")  # EP = 1 too: the exchange halves, which count
    n = num_ranks
    spec = a2a.Spec(num_experts=4 * n, experts_per_token=3, hidden=64, max_tokens_per_rank=8, tp_size=tp, slots=2)
    comm = a2a.init(spec, mesh, "ep", backend="nvshmem", timeout_s=30)
    mask = np.array([int(r != n - 1) for r in range(n)], np.int32) if masked else None

    def per_rank(x, i, w, m, *rank_mask):
        h = comm.dispatch_send(x, i, w, m[0], slot=0, rank_mask=rank_mask[0] if masked else None)
        got = comm.dispatch_recv(h)
        y = T.expert_fn_jax(spec, n, got, jnp.bfloat16)
        out = comm.combine_recv(comm.combine_send(y, got, slot=1))  # on another slot than the dispatch
        p = h.route.placement
        return out[None], p.dest_counts[None], p.dest[None]

    in_specs = (P("ep"),) * 4 + ((P(),) if masked else ())
    f = jax.jit(T.shard_map(per_rank, mesh=mesh, in_specs=in_specs, out_specs=P("ep")))
    for step, num_tokens in enumerate([None, 5]):  # random counts, then 5 of 8 tokens on every rank
        inputs = [with_repeats(i) for i in T.make_inputs(spec, n, 300 + 11 * step + tp, num_tokens=num_tokens,
                                                         minus_one_frac=0.15, invalid_frac=0.1)]
        args = [T.stack_global(mesh, "ep", [np.atleast_1d(np.asarray(getattr(r, k), np.int32 if k == "num_tokens" else None))
                                            for r in inputs])
                for k in ("x", "topk_ids", "topk_weights", "num_tokens")]
        args += [jnp.asarray(mask)] if masked else []
        T.poison_devices(mesh)
        out, counts, dest = f(*args)
        dests = T.local_ranks_of(dest)
        for r, got in T.local_ranks_of(counts).items():
            want = owed_rows(spec, n, r, inputs[r], mask)
            np.testing.assert_array_equal(got, want, err_msg=f"step {step} rank {r}: dest_counts")
            d = dests[r][:int(inputs[r].num_tokens)].reshape(-1)  # what combine_recv counted before
            np.testing.assert_array_equal(np.bincount(d[(d >= 0) & (d < n)], minlength=n), want,
                                          err_msg=f"step {step} rank {r}: dest")
        want_out = oracle.combine(spec, inputs, T.expert_fn_np, np.dtype(jnp.bfloat16), rank_mask=mask)
        for r, v in T.local_ranks_of(out).items():
            T.check_combine(spec, r, want_out[r], v)
    comm.close()
