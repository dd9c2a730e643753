"""Elastic EP (issue 15, item 2): a rank mask so that the survivors of a failure go on.

The oracle's mask semantics (jax_moe_a2a/oracle.py) on their own; the reference, host, cuda and
nvshmem (on GPUs) backends against the oracle with random masks (masked ranks still run here: the
others just ignore them), an all-alive mask equal to no mask, a mask with replicas (ExpertMap), a
new mask in the same compiled step, the counters and debug=True; the backends that refuse a mask.
The real failure, a process ending for good in the middle of a run, is `test_process_failure`
(tests/elastic_worker.py under its own mpirun; `test_process_failure_gpu` with the cuda backend,
three processes on GPU 0; none for nvshmem: ending a process under NVSHMEM's runtime is not safe).

On GPUs: cuda with N processes sharing a GPU or one process over several; nvshmem one process per
GPU under mpirun (`JAX_MOE_A2A_TEST_BACKENDS=nvshmem mpirun -n 2 ... -m mpi test_elastic.py`).
"""

import contextlib
import glob
import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_moe_a2a as a2a
from jax_moe_a2a import env as a2a_env
from jax_moe_a2a import eplb, oracle
from jax_moe_a2a import testing as T

from conftest import BACKENDS, subprocess_env

FP8 = jnp.float8_e4m3fn
BASE = dict(num_experts=32, experts_per_token=4, hidden=128, max_tokens_per_rank=16)


def _spec(n, **kw):
    return a2a.Spec(**{**BASE, "num_experts": 4 * n, **kw})


def _mask(n, dead):
    m = np.ones(n, np.int32)
    m[list(dead)] = 0
    return m


def _random_dead(n, seed):
    """1 to n // 2 masked ranks (never all)."""
    rng = np.random.default_rng(seed)
    return sorted(rng.choice(n, size=int(rng.integers(1, max(2, n // 2 + 1))), replace=False).tolist())


# ---- the oracle ---------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [2, 4, 8])
def test_oracle_all_alive_equals_no_mask(n):
    spec = _spec(n)
    inputs = T.make_inputs(spec, n, 3, invalid_frac=0.1, minus_one_frac=0.1)
    plain = oracle.dispatch(spec, inputs)
    masked = oracle.dispatch(spec, inputs, rank_mask=np.ones(n, bool))
    for a, b in zip(plain, masked):
        np.testing.assert_array_equal(a.group_sizes, b.group_sizes)
        np.testing.assert_array_equal(a.src, b.src)
        assert (a.num_dropped, a.num_overflow, b.num_masked) == (b.num_dropped, b.num_overflow, 0)
    for a, b in zip(oracle.combine(spec, inputs, T.expert_fn_np, np.float32),
                    oracle.combine(spec, inputs, T.expert_fn_np, np.float32, rank_mask=np.ones(n, np.int32))):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("tp", [1, 2])
def test_oracle_mask_semantics(tp):
    """Nothing from or to a masked rank; its pairs are counted as masked by their sender (not as
    dropped); the live ranks' combine equals the no-mask combine with the masked experts' ids set
    to -1; a masked rank's output is 0."""
    n = 8
    spec = _spec(n, tp_size=tp)
    dead = [2, 5]
    alive = _mask(n, dead).astype(bool)
    inputs = T.make_inputs(spec, n, 11, invalid_frac=0.05, minus_one_frac=0.05)
    l_count = spec.local_experts(n)
    got = oracle.dispatch(spec, inputs, rank_mask=alive)
    plain = oracle.dispatch(spec, inputs)
    for r in range(n):
        srcs = {s for rows in got[r].rows for s, _ in rows}
        assert not srcs & set(dead), f"rank {r} received from masked ranks {srcs & set(dead)}"
        if r in dead:
            assert int(np.sum(got[r].group_sizes)) == 0
        assert got[r].num_dropped == plain[r].num_dropped  # the bad ids, as without a mask
        routed, _ = oracle.routed_pairs(spec, inputs[r])
        ids = inputs[r].topk_ids
        mine = (np.arange(ids.shape[0]) % tp == r % tp)[:, None]
        stop = ~alive[np.clip(ids, 0, spec.num_experts - 1) // l_count] | (not alive[r])
        assert got[r].num_masked == int(np.sum(routed & stop & mine)), f"rank {r}"
    # combine: as if the masked experts were never chosen
    cut = []
    for r, inp in enumerate(inputs):
        ids = inp.topk_ids.copy()
        on_dead = (ids >= 0) & (ids < spec.num_experts) & ~alive[np.clip(ids, 0, spec.num_experts - 1) // l_count]
        ids[on_dead] = -1
        if not alive[r // tp * tp + np.arange(ids.shape[0]) % tp].all():  # a masked sender's tokens
            ids[~alive[r // tp * tp + np.arange(ids.shape[0]) % tp]] = -1
        cut.append(oracle.RankInputs(inp.x, ids, inp.topk_weights, inp.num_tokens, inp.x_scale))
    want = oracle.combine(spec, cut, T.expert_fn_np, np.float32)
    have = oracle.combine(spec, inputs, T.expert_fn_np, np.float32, rank_mask=alive)
    for r in range(n):
        if r in dead:
            assert not np.any(have[r].astype(np.float32)), f"masked rank {r}: output must be 0"
        else:
            np.testing.assert_array_equal(have[r], want[r], err_msg=f"rank {r}")


def test_oracle_replicas_skip_masked_ranks():
    """The map picks among the live replicas ((g * T + t) mod live count); a logical expert whose
    replicas are all masked keeps the mask-free choice, which the mask then stops (masked)."""
    n, l_count = 4, 2
    e = n * l_count
    # logical 0: physical 0 (rank 0), 2 (rank 1), 6 (rank 3); logical 1: physical 3 (rank 1) only
    phys = np.array([[0, 2, 6], [3, -1, -1]], np.int32)
    counts = np.array([3, 1], np.int32)
    ids = np.zeros((6, 1), np.int32)
    alive = np.array([1, 0, 1, 1], bool)  # rank 1 masked: physical 2 and 3 dead
    got = oracle.map_ids(phys, counts, ids, 0, e, alive)
    np.testing.assert_array_equal(got[:, 0], [0, 6, 0, 6, 0, 6])  # live list [0, 6]
    np.testing.assert_array_equal(oracle.map_ids(phys, counts, ids, 0, e)[:, 0], [0, 2, 6, 0, 2, 6])
    np.testing.assert_array_equal(oracle.map_ids(phys, counts, ids + 1, 0, e, alive)[:, 0], [3] * 6)  # none live
    # group 1 (T = 6): the rule starts at g * T
    np.testing.assert_array_equal(oracle.map_ids(phys, counts, ids, 1, e, alive)[:, 0], [0, 6, 0, 6, 0, 6])


def test_map_ids_jax_matches_oracle():
    rng = np.random.default_rng(5)
    n, l_count, t, k = 4, 3, 10, 3
    e = n * l_count
    for trial in range(20):
        e_log, m = 6, 3
        phys = rng.integers(-1, e, size=(e_log, m)).astype(np.int32)
        counts = rng.integers(0, m + 1, size=e_log).astype(np.int32)
        ids = rng.integers(-1, e_log + 1, size=(t, k)).astype(np.int32)
        alive = rng.random(n) < 0.6
        group = int(rng.integers(0, 3))
        want = oracle.map_ids(phys, counts, ids, group, e, alive)
        emap = a2a.ExpertMap(jnp.asarray(phys), jnp.asarray(counts))
        have = np.asarray(eplb.map_ids(emap, jnp.asarray(ids), group, e, jnp.asarray(alive), n))
        np.testing.assert_array_equal(have, want, err_msg=f"trial {trial}")
        same = np.asarray(eplb.map_ids(emap, jnp.asarray(ids), group, e, jnp.ones(n, bool), n))
        np.testing.assert_array_equal(same, oracle.map_ids(phys, counts, ids, group, e), err_msg=f"trial {trial}")


# ---- backends against the oracle ----------------------------------------------------------------

# nvshmem: one rank per process, so its cases run under mpirun only (a single process is N = 1).
MASK_BACKENDS = [b for b in BACKENDS if b in ("reference", "host", "ragged", "cuda", "nvshmem")]


@pytest.mark.mpi
@pytest.mark.parametrize("backend", MASK_BACKENDS)
@pytest.mark.parametrize("case", ["bf16-split", "fp8-one-shot", "expert-major-tp2"])
def test_random_masks_against_oracle(backend, case, num_ranks, mesh):
    """Random masks (the masked ranks still run: the live ranks ignore them), several in one
    compiled step: every rank's outputs against the oracle, masked ranks included (nothing
    received, output 0); then an all-alive mask (a traced array) equals no mask. On one slot, so
    that the ranks masked in one step are unmasked in a later one: nvshmem's cumulative row
    counters (and every backend's FREE bookkeeping) must come through in step, else the later
    steps time out or read the wrong rows."""
    if num_ranks < 2:
        pytest.skip("needs 2 ranks")
    kw = {"bf16-split": {}, "fp8-one-shot": dict(dispatch_dtype=FP8),
          "expert-major-tp2": dict(layout="expert_major", tp_size=2, recv_capacity=3)}[case]
    if kw.get("tp_size", 1) > 1 and num_ranks % 2:
        pytest.skip("tp 2 needs an even rank count")
    split = case != "fp8-one-shot"
    spec = _spec(num_ranks, **kw)
    comm = a2a.init(spec, mesh, "ep", backend=backend, timeout_s=20)
    for i in range(3):
        dead = _random_dead(num_ranks, 100 + i)
        mask = _mask(num_ranks, dead)
        inputs = T.make_inputs(spec, num_ranks, 40 + i, invalid_frac=0.05, minus_one_frac=0.05)
        res = T.run_ops(comm, inputs, rank_mask=mask, split=split)
        T.check_all(comm, inputs, res, rank_mask=mask)
        for r in set(res) & set(dead):
            assert int(np.sum(res[r]["group_sizes"])) == 0 and not np.any(np.asarray(res[r]["out"], np.float32))
    f = T.compiled_steps(comm)
    assert sum(v._cache_size() for v in f.values()) == 1, "a new mask must reuse the compiled step"
    inputs = T.make_inputs(spec, num_ranks, 77, invalid_frac=0.05)
    ones = T.run_ops(comm, inputs, rank_mask=np.ones(num_ranks, np.int32), split=split)
    plain = T.run_ops(comm, inputs, split=split)
    for r in plain:
        assert int(ones[r]["num_masked"]) == 0
        for k in ("group_sizes", "weights", "src", "num_dropped", "num_overflow", "out"):
            np.testing.assert_array_equal(np.asarray(plain[r][k]).astype(np.float32),
                                          np.asarray(ones[r][k]).astype(np.float32), err_msg=f"rank {r}: {k}")


@pytest.mark.mpi
@pytest.mark.parametrize("backend", MASK_BACKENDS)
def test_mask_with_replicas(backend, num_ranks, mesh):
    """Every logical expert has a replica on two ranks: with one rank masked every pair still
    finds a live replica (nothing masked but what the dead rank itself would send), and the
    results match the oracle; with both replica ranks of some experts masked, those pairs are
    masked."""
    if num_ranks < 2:
        pytest.skip("needs 2 ranks")
    n = num_ranks
    l_count = 4
    e_phys = n * l_count
    e_log = e_phys // 2
    # logical e on physical e (first half of the ranks' experts) and e + e_log (shifted by n/2 ranks)
    reps = [[e, e + e_log] for e in range(e_log)]
    emap = a2a.ExpertMap.from_replicas(reps, e_phys)
    spec = _spec(n, num_experts=e_phys)
    comm = a2a.init(spec, mesh, "ep", backend=backend, timeout_s=20)
    inputs = T.make_inputs(spec.replace(num_experts=e_log), n, 8, num_tokens=spec.max_tokens_per_rank,
                           minus_one_frac=0.05)
    dead = [n - 1]
    mask = _mask(n, dead)
    res = T.run_ops(comm, inputs, expert_map=emap, rank_mask=mask)
    T.check_all(comm, inputs, res, expert_map=emap, rank_mask=mask)
    for r in res:
        if r not in dead:
            assert int(res[r]["num_masked"]) == 0, f"rank {r}: every logical expert has a live replica"
    if n >= 4:  # ranks 0 and n/2 hold both replicas of logical experts 0..L-1
        mask2 = _mask(n, [0, n // 2])
        res = T.run_ops(comm, inputs, expert_map=emap, rank_mask=mask2)
        T.check_all(comm, inputs, res, expert_map=emap, rank_mask=mask2)
        assert sum(v._cache_size() for v in T.compiled_steps(comm).values()) == 1


@pytest.mark.mpi
@pytest.mark.parametrize("backend", MASK_BACKENDS)
def test_stats_and_debug(backend, num_ranks, mesh):
    """Masked pairs go to stats()['masked'], not 'dropped' (the GPU kernels count the stopped
    pairs as dropped: the communicator must take them out again); debug=True does not raise for
    them. stats() counts this process's ranks."""
    if num_ranks < 2:
        pytest.skip("needs 2 ranks")
    spec = _spec(num_ranks)
    comm = a2a.init(spec, mesh, "ep", backend=backend, debug=True, timeout_s=20)
    inputs = T.make_inputs(spec, num_ranks, 9, num_tokens=spec.max_tokens_per_rank)
    mask = _mask(num_ranks, [1])
    with comm.checked():
        res = T.run_ops(comm, inputs, rank_mask=mask)
    T.check_all(comm, inputs, res, rank_mask=mask)
    st = comm.stats()
    want = oracle.dispatch(spec, inputs, rank_mask=mask)
    assert st["dropped"] == 0 and st["masked"] == sum(want[r].num_masked for r in res) > 0, st


# Backends whose send halves wait for FREE signals (the reference and ragged backends keep no
# buffers between steps).
FREE_BACKENDS = [b for b in MASK_BACKENDS if b in ("host", "cuda", "nvshmem")]


@pytest.mark.mpi
@pytest.mark.parametrize("backend", FREE_BACKENDS)
def test_unmasked_rank_still_reading(backend, num_ranks, mesh, monkeypatch):
    """A rank masked for one step and unmasked the next may still be reading the rows we wrote it
    the step before: our send must wait for the FREE it owes for that step. Three dispatch-only
    steps on slot 0 (each a call of one compiled step): A all alive, the last rank deliberately
    slow to read; B with it masked; C all alive again. The fast ranks run B and C meanwhile, and
    C's send writes the slow rank's buffers: with the FREE awaited only from ranks alive in the
    slot's last dispatch (B) it did so before the slow rank read A's rows, which then held C's
    (the slow rank's A failed the oracle). Every rank's every step against the oracle.

    The slow read: GPU backends, a host callback sleeps on the slow rank between its
    dispatch_send and dispatch_recv of A (its kernels read only after it). Host backend, its
    dispatch_recv pauses after its rows arrived (JAX_MOE_A2A_HOST_RECV_PAUSE_S, in the slow rank's
    process only): a sleep before it would not do, because the receive half posts the rows past
    `priv` (OVER) that the fast ranks' dispatch_recv of A waits for. Dispatch-only on purpose: with
    a combine after each dispatch, a combine_recv waits for every live rank's expert outputs, sent
    after its dispatch_recv, which orders the next-but-one dispatch after that read anyway. Needs
    the slow rank in a process of its own (mpirun): a process reads a step's results only once all
    its ranks finished it."""
    from jax.sharding import PartitionSpec as P

    if num_ranks < 2 or jax.process_count() < 2:
        pytest.skip("needs 2 ranks and the slow one in a process of its own (mpirun)")
    slow, pause = num_ranks - 1, 2.0
    mine = {d.id for d in jax.local_devices()}
    if mesh.devices.flat[slow].id in mine and mesh.devices.flat[0].id in mine:
        pytest.skip("the slow rank shares a process with rank 0")
    if backend == "host" and mesh.devices.flat[slow].id in mine:
        monkeypatch.setenv("JAX_MOE_A2A_HOST_RECV_PAUSE_S", str(pause))  # read once, by init
    spec = _spec(num_ranks)
    comm = a2a.init(spec, mesh, "ep", backend=backend, timeout_s=30)
    monkeypatch.delenv("JAX_MOE_A2A_HOST_RECV_PAUSE_S", raising=False)

    def hold(delay, rank, *leaves):
        """The slow rank's pause before its dispatch_recv (host callback: [] f32 seconds, [] int32
        rank, then the handle's arrays, returned unchanged)."""
        if int(rank) == slow and float(delay) > 0:
            time.sleep(float(delay))
        return list(leaves)

    def per_rank(x, ids, w, mask, delay):
        h = comm.dispatch_send(x, ids, w, rank_mask=mask)
        leaves, tree = jax.tree_util.tree_flatten(h)  # dispatch_recv runs after the callback: it reads its result
        leaves = jax.pure_callback(hold, [jax.ShapeDtypeStruct(v.shape, v.dtype) for v in leaves], delay,
                                   jax.lax.axis_index("ep"), *leaves)
        got = comm.dispatch_recv(jax.tree_util.tree_unflatten(tree, list(leaves)))
        fields = {"x": got.x, "group_sizes": got.group_sizes, "weights": got.weights, "src": got.src,
                  "num_dropped": got.num_dropped, "num_overflow": got.num_overflow, "num_masked": got.num_masked}
        return jax.tree.map(lambda a: a[None], fields)

    step = jax.jit(T.shard_map(per_rank, mesh=mesh, in_specs=(P("ep"),) * 3 + (P(), P()), out_specs=P("ep")))
    sleep_a = 0.0 if backend == "host" else pause
    plan = [("A", _mask(num_ranks, []), sleep_a), ("B", _mask(num_ranks, [slow]), 0.0),
            ("C", _mask(num_ranks, []), 0.0)]
    runs = []
    for i, (name, mask, delay) in enumerate(plan):
        inputs = T.make_inputs(spec, num_ranks, 500 + i, num_tokens=spec.max_tokens_per_rank)
        args = [T.stack_global(mesh, "ep", [getattr(r, k) for r in inputs]) for k in ("x", "topk_ids", "topk_weights")]
        res = step(*args, jnp.asarray(mask), jnp.float32(delay))
        # this process's ranks only: the fast ranks finish A (and then B) while the slow one reads
        runs.append((name, mask, inputs, {k: T.local_ranks_of(v) for k, v in res.items()}))
    assert step._cache_size() == 1
    for name, mask, inputs, per in runs:
        want = oracle.dispatch(spec, inputs, rank_mask=mask)
        for r in sorted(per["x"]):
            got = {k: per[k][r] for k in per}
            assert int(got["num_masked"]) == want[r].num_masked, f"step {name}, rank {r}"
            try:
                T.check_dispatch(spec, num_ranks, r, want[r], got)
            except AssertionError as e:
                raise AssertionError(f"step {name} (mask {mask.tolist()}), rank {r}: {e}") from None
    comm.close()


@pytest.mark.parametrize("backend", ["reference"])
def test_gradients_with_mask(backend, num_ranks, mesh):
    """The one-shot ops stay differentiable with a mask; masked pairs get no gradient (against
    the same computation with the masked experts' ids set to -1). Reference here, host below."""
    _grad_check(backend, num_ranks, mesh)


def test_gradients_with_mask_host(num_ranks, mesh):
    if "host" not in BACKENDS:
        pytest.skip("no host backend")
    _grad_check("host", num_ranks, mesh)


def _grad_check(backend, n, mesh):
    from jax.sharding import PartitionSpec as P
    spec = _spec(n)
    comm = a2a.init(spec, mesh, "ep", backend=backend, timeout_s=20)
    inputs = T.make_inputs(spec, n, 13, num_tokens=spec.max_tokens_per_rank)
    dead = [n // 2]
    mask = _mask(n, dead)
    l_count = spec.local_experts(n)

    def loss(x, ids, w, m):
        def per_rank(x, ids, w, m):
            got = comm.dispatch(x[0], ids[0], w[0], rank_mask=m)
            y = T.expert_fn_jax(spec, n, got, jnp.float32)
            return jnp.sum(comm.combine(y, got).astype(jnp.float32) ** 2)[None]
        out = T.shard_map(per_rank, mesh=mesh, in_specs=(P("ep"),) * 3 + (P(),), out_specs=P("ep"))(x, ids, w, m)
        return jnp.sum(out)

    args = T.global_args(mesh, inputs, ("x", "topk_ids", "topk_weights"), rank_dim=True)
    g = jax.jit(jax.grad(loss, argnums=(0, 2)))
    gx, gw = g(args[0], args[1], args[2], jnp.asarray(mask))
    cut = []
    for r, i in enumerate(inputs):
        ids = i.topk_ids.copy()
        ids[~mask.astype(bool)[np.clip(ids, 0, spec.num_experts - 1) // l_count]] = -1
        if not mask[r]:
            ids[:] = -1
        cut.append(ids[None])
    ids_cut = T.stack_global(mesh, "ep", cut)
    hx, hw = g(args[0], ids_cut, args[2], jnp.ones(n, jnp.int32))
    for a, b in ((gx, hx), (gw, hw)):
        for r, v in T.local_ranks_of(a).items():
            np.testing.assert_allclose(np.asarray(v, np.float32), np.asarray(T.local_ranks_of(b)[r], np.float32),
                                       rtol=1e-5, atol=1e-5, err_msg=f"rank {r}")


# ---- refusals -----------------------------------------------------------------------------------

def test_mask_checks(num_ranks, mesh):
    spec = _spec(num_ranks)
    comm = a2a.init(spec, mesh, "ep", backend="reference")
    x = jnp.zeros((spec.max_tokens_per_rank, spec.hidden), jnp.bfloat16)
    ids = jnp.zeros((spec.max_tokens_per_rank, spec.experts_per_token), jnp.int32)
    w = jnp.zeros(ids.shape, jnp.float32)

    def call(mask):
        from jax.sharding import PartitionSpec as P
        f = T.shard_map(lambda x, i, w: comm.dispatch(x[0], i[0], w[0], rank_mask=mask).group_sizes[None],
                        mesh=mesh, in_specs=(P("ep"),) * 3, out_specs=P("ep"))
        n = num_ranks
        return f(jnp.broadcast_to(x, (n,) + x.shape), jnp.broadcast_to(ids, (n,) + ids.shape),
                 jnp.broadcast_to(w, (n,) + w.shape))

    with pytest.raises(ValueError, match=r"rank_mask: expected shape \[N\]"):
        call(np.ones(num_ranks + 1, bool))
    with pytest.raises(ValueError, match="rank_mask: expected dtype bool or an integer"):
        call(np.ones(num_ranks, np.float32))
    with pytest.raises(ValueError, match="every rank is masked"):
        call(np.zeros(num_ranks, bool))


def test_gpu_backends_mask_support(num_ranks, mesh, monkeypatch):
    """cuda with peers on other nodes (node_size < N: the proxy waits for every rank): a
    device-array mask raises at trace time; cuda on one node and nvshmem take it (their kernels
    leave masked ranks out: the GPU runs of the mask tests). nvshmem's Config leaves node_size at
    0, so it must not inherit cuda's node_size refusal, and its halves must carry the mask operand
    (cuda's _mask_operands, not the FfiBackend default that refuses one). A concrete all-alive
    mask is accepted (it is no mask). The refusal checked through a reference communicator (no
    GPU here)."""
    from types import SimpleNamespace

    from jax.sharding import PartitionSpec as P
    from jax_moe_a2a.backends.cuda import CudaBackend
    from jax_moe_a2a.backends.nvshmem import NvshmemBackend
    from jax_moe_a2a.config import Config
    assert CudaBackend.rank_mask_unsupported(SimpleNamespace(config=None)) is None
    one_node = SimpleNamespace(config=SimpleNamespace(node_size=4, num_ranks=4))
    two_nodes = SimpleNamespace(config=SimpleNamespace(node_size=2, num_ranks=4))
    assert CudaBackend.rank_mask_unsupported(one_node) is None
    reason = CudaBackend.rank_mask_unsupported(two_nodes)
    assert "inter-node proxy waits for every remote rank" in reason
    nv_config = Config.build(_spec(4), 4, NvshmemBackend)
    assert nv_config.node_size < nv_config.num_ranks  # what cuda's check would refuse
    assert NvshmemBackend.rank_mask_unsupported(SimpleNamespace(config=nv_config)) is None
    assert NvshmemBackend.rank_mask_unsupported(SimpleNamespace(config=None)) is None
    (operand,) = NvshmemBackend._mask_operands(NvshmemBackend(), None, jnp.asarray(_mask(4, [2]), jnp.bool_))
    assert operand.dtype == jnp.int32 and operand.shape == (4,)
    np.testing.assert_array_equal(np.asarray(operand), _mask(4, [2]))
    (empty,) = NvshmemBackend._mask_operands(NvshmemBackend(), None, None)  # no mask: [0], the kernels load nothing
    assert empty.shape == (0,)
    spec = _spec(num_ranks)
    comm = a2a.init(spec, mesh, "ep", backend="reference")
    monkeypatch.setattr(comm._backend, "rank_mask_unsupported", lambda: reason)
    comm.backend_name = "cuda"
    inputs = T.make_inputs(spec, num_ranks, 1)
    with pytest.raises(ValueError, match="rank_mask is not supported by the cuda backend yet: node_size=2"):
        T.run_ops(comm, inputs, rank_mask=_mask(num_ranks, [0]))
    # a concrete all-alive mask (a closure constant) is no mask: accepted (jitted: run op by op,
    # the dispatch took 30 s of XLA:CPU)
    ones = np.ones(num_ranks, bool)
    f = jax.jit(T.shard_map(lambda x, i, w: comm.dispatch(x[0], i[0], w[0], rank_mask=ones).group_sizes[None],
                    mesh=mesh, in_specs=(P("ep"),) * 3, out_specs=P("ep")))
    f(*T.global_args(mesh, inputs, ("x", "topk_ids", "topk_weights"), rank_dim=True))


def test_host_proxied_refuses_a_mask(num_ranks, mesh):
    if "host" not in BACKENDS:
        pytest.skip("no host backend")
    spec = _spec(num_ranks)
    comm = a2a.init(spec, mesh, "ep", backend="host", proxied=True, timeout_s=10)
    inputs = T.make_inputs(spec, num_ranks, 1)
    with pytest.raises(ValueError, match="not supported by the host backend yet: proxied=True"):
        T.run_ops(comm, inputs, rank_mask=_mask(num_ranks, [0]))
    comm.close()


# ---- a process ends for real --------------------------------------------------------------------

def _engine_shm_regions():
    """The shm regions our engines name (cc/transfer/fabric.cc: jax_moe_a2a-<pid>-<random>-<domain>)."""
    return set(glob.glob("/dev/shm/jax_moe_a2a-*"))


def _remove_dead_workers_regions(before):
    """The workers end with os._exit (no engine close), so their shm regions stay in /dev/shm:
    remove the ones this run created whose process is gone (16 MiB each, piling up otherwise)."""
    for path in _engine_shm_regions() - before:
        pid = os.path.basename(path).split("-")[1]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            with contextlib.suppress(OSError):
                os.unlink(path)


def _run_workers(worker_name, provider, tmp_path, limit, backend="host"):
    """mpirun -n 3 of tests/<worker_name> in a session of its own; its output (killed, with the
    whole session, past `limit` s). backend "cuda": the three processes share GPU 0."""
    if backend not in BACKENDS:
        pytest.skip(f"no {backend} backend")
    if shutil.which("mpirun") is None:
        pytest.skip("no mpirun")
    test_vars = {n for n in a2a_env.TABLE if "_TEST_" in n}  # this suite's own settings (jax_moe_a2a/env.py)
    env = subprocess_env(drop=test_vars, keep_xla_flags=True, ELASTIC_DIR=str(tmp_path), PYTHONUNBUFFERED="1",
                         ELASTIC_PROVIDER=provider, ELASTIC_BACKEND=backend)
    if backend == "cuda":
        env.update(JAX_PLATFORMS="cuda,cpu", JAX_MOE_A2A_LOCAL_DEVICE_IDS="0", XLA_PYTHON_CLIENT_MEM_FRACTION="0.1")
    if provider.startswith("tcp"):
        env.setdefault("JAX_MOE_A2A_IFACE", "lo")
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), worker_name)
    cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-n", "3",
           sys.executable, worker]
    shm_before = _engine_shm_regions()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the session this test started: mpirun and its workers
        out, _ = proc.communicate()
        pytest.fail(f"the elastic run did not finish within {limit} s:\n{out[-6000:]}")
    finally:
        _remove_dead_workers_regions(shm_before)
    assert proc.returncode == 0, f"mpirun exited with {proc.returncode}:\n{out[-6000:]}"
    assert "ELASTIC_FAIL" not in out, out[-6000:]
    return out


@pytest.mark.parametrize("provider", ["shm", "tcp;ofi_rxm"])
def test_process_failure(provider, tmp_path):
    """3 JAX processes (1 CPU device each, host backend over libfabric `provider`) under their
    own mpirun: all run step 1, then process 2 ends (os._exit(0), no goodbye); once it is gone,
    processes 0 and 1 run five more steps with the mask [1, 1, 0], each checked against the
    oracle with that mask, in one compiled step (without the mask they would end at timeout_s
    naming rank 2). Bounded: the workers' timeout_s is 10 s and this test kills the whole mpirun
    session after 240 s."""
    out = _run_workers("elastic_worker.py", provider, tmp_path, 240)
    for r in (0, 1):
        assert f"ELASTIC_OK process {r} steps 6" in out, out[-6000:]
    assert "ELASTIC_EXIT process 2 after step 1" in out, out[-6000:]


# No nvshmem variant on purpose: ending a process for real under NVSHMEM's runtime (a PE that
# vanishes while the others keep its symmetric heap mapped and its bootstrap open) is not safe:
# the survivors' teardown and even their next puts can hang or crash the job, which a test
# cannot bound. The nvshmem kernels' mask handling is tested with masked ranks that keep running
# (the mask tests above under mpirun), which is the part a dead rank adds nothing to: no kernel
# reads a masked rank's memory or waits for it.
def test_process_failure_gpu(tmp_path):
    """The same with the cuda backend, the three processes sharing GPU 0: process 2 ends after
    step 1 (its CUDA context with it); processes 0 and 1 run five more steps with it masked, their
    kernels neither waiting for it nor writing to it, oracle-checked, in one compiled step."""
    out = _run_workers("elastic_worker.py", "shm", tmp_path, 240, backend="cuda")
    for r in (0, 1):
        assert f"ELASTIC_OK process {r} steps 6" in out, out[-6000:]
    assert "ELASTIC_EXIT process 2 after step 1" in out, out[-6000:]


@pytest.mark.parametrize("provider", ["shm", "tcp;ofi_rxm"])
def test_recover_after_failure(provider, tmp_path):
    """The failure as a server meets it (tests/elastic_recover_worker.py, 3 processes, timeout_s
    4 s): process 2 ends in the middle of step 2 and nobody waits for it; the survivors' step 2
    times out (both in dispatch_recv, at different points), the next op keeps refusing,
    recover() with the dead rank still in the mask times out naming it, recover() with it masked
    succeeds, and four more steps on the same communicator and compiled step are oracle-correct.
    Bounded: the whole mpirun session is killed after 120 s."""
    out = _run_workers("elastic_recover_worker.py", provider, tmp_path, 120)
    for r in (0, 1):
        assert f"ELASTIC_OK process {r} steps 4 after recovery" in out, out[-6000:]
    assert "ELASTIC_EXIT process 2 in step 2" in out, out[-6000:]


# ---- recovery after the timeout (host backend) --------------------------------------------------

def _disagreeing_step(comm, spec, n, mesh):
    """One dispatch + combine where each rank sees its own row of an [N, N] mask (a sharded
    operand): ranks that disagree about who is alive make a real timeout inside one process."""
    from jax.sharding import PartitionSpec as P

    def per_rank(x, ids, w, m):
        got = comm.dispatch(x[0], ids[0], w[0], rank_mask=m[0])
        return comm.combine(T.expert_fn_jax(spec, n, got, jnp.float32), got)[None]

    return jax.jit(T.shard_map(per_rank, mesh=mesh, in_specs=(P("ep"),) * 4, out_specs=P("ep")))


def test_recover_after_timeout_one_process(num_ranks, mesh):
    """A real timeout in one process: rank 0 believes every rank is alive, the others mask rank 0,
    so rank 0's dispatch_recv times out naming them while the others finish the step (the
    survivors stopped at different points). The next op keeps refusing the failed communicator;
    comm.recover(mask) makes it usable again and the following steps are oracle-correct."""
    if "host" not in BACKENDS or num_ranks < 2:
        pytest.skip("needs the host backend and 2 ranks")
    n = num_ranks
    spec = _spec(n)
    comm = a2a.init(spec, mesh, "ep", backend="host", timeout_s=2)
    inputs = T.make_inputs(spec, n, 21, num_tokens=spec.max_tokens_per_rank)
    views = np.ones((n, n), np.int32)
    views[1:, 0] = 0  # ranks 1.. mask rank 0; rank 0 masks nobody
    args = [*T.global_args(mesh, inputs, ("x", "topk_ids", "topk_weights"), rank_dim=True),
            T.stack_global(mesh, "ep", [views[r][None] for r in range(n)])]
    assert comm.last_error() is None
    with pytest.raises(jax.errors.JaxRuntimeError, match="did not arrive within 2.0 s"):
        jax.block_until_ready(_disagreeing_step(comm, spec, n, mesh)(*args))
    err = comm.last_error()
    assert isinstance(err, a2a.PeerFailure) and err.missing and 0 not in err.missing, err
    assert "did not arrive" in err.message
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"unusable after an earlier failure.*comm.recover"):
        T.run_ops(comm, inputs, rank_mask=np.ones(n, np.int32))
    comm.recover(np.ones(n, bool))  # every rank of this process is alive: all of them recover
    assert comm.last_error() is None
    for i in range(3):
        mask = _mask(n, [] if i == 0 else [1 + i % (n - 1)])
        inp = T.make_inputs(spec, n, 60 + i, invalid_frac=0.05, minus_one_frac=0.05)
        res = T.run_ops(comm, inp, rank_mask=mask)
        T.check_all(comm, inp, res, rank_mask=mask)
    assert sum(v._cache_size() for v in T.compiled_steps(comm).values()) == 1
    comm.recover(_mask(n, [n - 1]))  # also fine on a healthy communicator (a survivor whose step passed)
    res = T.run_ops(comm, inputs, rank_mask=_mask(n, [n - 1]))
    T.check_all(comm, inputs, res, rank_mask=_mask(n, [n - 1]))
    comm.close()


def test_recover_checks(num_ranks, mesh):
    """Wrong uses of recover raise clearly: a malformed or all-masked mask; backends that cannot
    recover (cuda, nvshmem; host with proxied=True); reference is a no-op."""
    n = num_ranks
    spec = _spec(n)
    comm = a2a.init(spec, mesh, "ep", backend="reference")
    with pytest.raises(ValueError, match=r"rank_mask: expected shape \[N\]"):
        comm.recover(np.ones(n + 1, bool))
    with pytest.raises(ValueError, match="rank_mask: expected dtype bool or an integer"):
        comm.recover(np.ones(n, np.float32))
    with pytest.raises(ValueError, match="every rank is masked"):
        comm.recover(np.zeros(n, bool))
    comm.recover(np.ones(n, bool))  # reference: nothing to reset
    pf = a2a.PeerFailure("dispatch_recv: ranks [2, 1] did not arrive", [2, 1, 2])
    assert pf.missing == (1, 2) and pf.message == pf and "x: " + pf == "x: " + pf.message  # reads as text
    from jax_moe_a2a.backends.base import Backend
    from jax_moe_a2a.backends.cuda import CudaBackend
    from jax_moe_a2a.backends.nvshmem import NvshmemBackend
    # the GPU backends keep the base class's recover, which refuses (a step that failed leaves their
    # device-side epochs and flags inconsistent: make a new communicator)
    assert CudaBackend.recover is Backend.recover and NvshmemBackend.recover is Backend.recover
    for cls in (CudaBackend, NvshmemBackend):
        with pytest.raises(NotImplementedError, match=f"not supported by the {cls.name} backend"):
            cls().recover(_mask(n, [0]).astype(np.int32))
    if "host" in BACKENDS:
        hc = a2a.init(spec, mesh, "ep", backend="host", proxied=True, timeout_s=5)
        with pytest.raises(NotImplementedError, match="proxied=True"):
            hc.recover(_mask(n, [0]))
        hc.close()
