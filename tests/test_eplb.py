"""Redundant experts (EPLB): a logical -> physical expert map applied before dispatch.

Every backend against the NumPy oracle applying the same map (jax_moe_a2a/oracle.py map_ids);
the combined output against the no-replica computation of the same logical layer; a new map in
the same compiled step; zero replicas, out-of-range and repeated logical ids; the map's checks;
models.moe_layer with a map (forward and gradient) against the dense logical layer.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_moe_a2a as a2a
from jax_moe_a2a import models, oracle
from jax_moe_a2a import testing as T

from conftest import BACKENDS

FP8 = jnp.float8_e4m3fn


def _layout(n, permute_seed=None, hot_last=False):
    """E = 2n physical experts, E_log = 2n - max(1, n // 2) logical ones; `extra` logical experts
    (the first, or the last with hot_last) get a second replica, on another rank where n > 1
    (n = 8: 16 physical, 12 logical, 4 of them twice). permute_seed: physical ids permuted."""
    e_phys = 2 * max(n, 2)  # n = 1: 4 physical, 3 logical (K = 3 needs 3)
    extra = max(1, n // 2)
    e_log = e_phys - extra
    two = set(range(e_log - extra, e_log)) if hot_last else set(range(extra))
    reps, nxt = [], e_log
    for e in range(e_log):
        row = [e]
        if e in two:
            row.append(nxt)
            nxt += 1
        reps.append(row)
    if permute_seed is not None:
        perm = np.random.default_rng(permute_seed).permutation(e_phys)
        reps = [[int(perm[p]) for p in row] for row in reps]
    return e_phys, e_log, reps


def _spec(n, **kw):
    e_phys, _, _ = _layout(n)
    base = dict(num_experts=e_phys, experts_per_token=3, hidden=128, max_tokens_per_rank=8)
    return a2a.Spec(**{**base, **kw})


def _logical_inputs(spec, n, e_log, seed, **kw):
    """make_inputs drawing LOGICAL ids in [0, e_log) (invalid ones relative to e_log)."""
    return T.make_inputs(spec.replace(num_experts=e_log), n, seed, **kw)


# ---- the map against the oracle -----------------------------------------------------------------

@pytest.mark.mpi
@pytest.mark.parametrize("backend", BACKENDS)
def test_identity_map_equals_no_map(backend, num_ranks, mesh):
    spec = _spec(num_ranks, dispatch_dtype=FP8)
    comm = a2a.init(spec, mesh, "ep", backend=backend)
    inputs = T.make_inputs(spec, num_ranks, 7, invalid_frac=0.1, minus_one_frac=0.1)
    plain = T.run_ops(comm, inputs)
    mapped = T.run_ops(comm, inputs, expert_map=a2a.ExpertMap.identity(spec.num_experts))
    assert plain.keys() == mapped.keys()
    for r in plain:
        for k in ("group_sizes", "weights", "src", "num_dropped", "num_overflow", "out"):  # x: unspecified past the counts
            np.testing.assert_array_equal(np.asarray(plain[r][k]).astype(np.float32),
                                          np.asarray(mapped[r][k]).astype(np.float32), err_msg=f"rank {r}: {k}")
    T.check_all(comm, inputs, mapped)
    T.check_all(comm, inputs, mapped, expert_map=a2a.ExpertMap.identity(spec.num_experts))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", ["fp8", "bf16"])
@pytest.mark.parametrize("split", [True, False], ids=["split", "one-shot"])
@pytest.mark.parametrize("layout", ["ragged", "expert_major"])
def test_replicas_against_oracle(backend, dtype, split, layout, num_ranks, mesh):
    """Rows land on the replica the rule picks (the oracle applies the same map), and both
    replicas of a logical expert receive rows (the rule spreads its load)."""
    e_phys, e_log, reps = _layout(num_ranks)
    spec = _spec(num_ranks, dispatch_dtype=FP8 if dtype == "fp8" else jnp.bfloat16, layout=layout)
    comm = a2a.init(spec, mesh, "ep", backend=backend)
    emap = a2a.ExpertMap.from_replicas(reps, e_phys)
    inputs = _logical_inputs(spec, num_ranks, e_log, 21 + split, num_tokens=spec.max_tokens_per_rank,
                             minus_one_frac=0.05)
    res = T.run_ops(comm, inputs, expert_map=emap, split=split)
    T.check_all(comm, inputs, res, expert_map=emap)
    # the physical experts that received rows: every replica of a used logical expert
    l_count = spec.local_experts(num_ranks)
    hit = {r * l_count + l for r, v in res.items() for l, c in enumerate(v["group_sizes"]) if c > 0}
    used = {int(e) for i in inputs for e in i.topk_ids.reshape(-1) if 0 <= e < e_log}
    if jax.process_count() == 1:
        for e in used:
            assert set(reps[e]) <= hit, f"logical expert {e}: replicas {reps[e]}, rows reached {sorted(hit)}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_tp2_members_pick_the_same_replicas(backend, num_ranks, mesh):
    """tp_size 2: the replica rule uses the DP group (rank // tp), so both members of a group map
    their (identical) tokens alike; against the oracle, which applies the map per group."""
    if num_ranks % 2:
        pytest.skip("needs an even number of ranks")
    e_phys, e_log, reps = _layout(num_ranks)
    spec = _spec(num_ranks, tp_size=2, dispatch_dtype=FP8)
    comm = a2a.init(spec, mesh, "ep", backend=backend)
    emap = a2a.ExpertMap.from_replicas(reps, e_phys)
    inputs = _logical_inputs(spec, num_ranks, e_log, 91, minus_one_frac=0.1)
    T.check_all(comm, inputs, T.run_ops(comm, inputs, expert_map=emap), expert_map=emap)


def _step(comm, spec, n, y_dtype, counter):
    """jit(shard_map) of dispatch (with the map) -> expert of the LOGICAL expert -> combine. The
    expert multiplies by 1 + logical / 4, so replicas hold identical "weights"."""
    l_count = spec.local_experts(n)

    def per_rank(x, ids, w, nt, emap):
        counter.append(1)  # runs once per trace
        got = comm.dispatch(x, ids, w, nt, expert_map=emap)
        phys = jax.lax.axis_index("ep") * l_count + T.row_expert(spec, n, got)
        logical = emap.logical_of(spec.num_experts)[jnp.clip(phys, 0, spec.num_experts - 1)]
        xf = got.x.astype(jnp.float32)
        if spec.is_fp8:
            xf = a2a.dequantize_fp8(got.x, got.scale, spec.scale_block)
        y = (xf * (1.0 + logical.astype(jnp.float32) / 4.0)[..., None]).astype(y_dtype)
        out = comm.combine(y, got)
        fields = {"x": got.x, "group_sizes": got.group_sizes, "weights": got.weights, "src": got.src,
                  "num_dropped": got.num_dropped, "num_overflow": got.num_overflow, "out": out}
        if got.scale is not None:
            fields["scale"] = got.scale
        return jax.tree.map(lambda a: a[None], fields)

    ax = P("ep")
    return jax.jit(T.shard_map(per_rank, mesh=comm.mesh, in_specs=(ax, ax, ax, ax, P()), out_specs=ax))


def _args(mesh, inputs):
    return T.global_args(mesh, inputs)


def _logical_layer(spec, inputs, e_log, counts, y_dtype):
    """The same layer without replicas, per rank [T, H] f32: for t < num_tokens, the sum over the
    token's distinct logical ids in [0, e_log) with counts > 0 of w * (row * (1 + e / 4))."""
    outs = []
    for inp in inputs:
        xw, xs = oracle._wire(spec, inp)
        rows = oracle.dequantize_fp8(xw, xs, spec.scale_block) if spec.is_fp8 else xw.astype(np.float32)
        acc = np.zeros((spec.max_tokens_per_rank, spec.hidden), np.float32)
        for t in range(inp.num_tokens):
            seen = set()
            for k, e in enumerate(inp.topk_ids[t]):
                e = int(e)
                if e in seen or not 0 <= e < e_log or counts[e] == 0:
                    continue
                seen.add(e)
                y = (rows[t] * np.float32(1.0 + e / 4.0)).astype(y_dtype).astype(np.float32)
                acc[t] += np.float32(inp.topk_weights[t, k]) * y
        outs.append(acc)
    return outs


@pytest.mark.mpi
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", ["fp8", "bf16"])
def test_new_map_same_step_equals_logical_layer(backend, dtype, num_ranks, mesh):
    """Two maps of the same shapes through one jitted step: traced once; each dispatch matches
    the oracle with its map; each combine equals the no-replica logical layer."""
    spec = _spec(num_ranks, dispatch_dtype=FP8 if dtype == "fp8" else jnp.bfloat16, combine_dtype=jnp.float32)
    comm = a2a.init(spec, mesh, "ep", backend=backend)
    y_dtype = np.dtype(jnp.bfloat16)
    counter = []
    f = _step(comm, spec, num_ranks, y_dtype, counter)
    exact = T.exact_fp8_expected(comm)
    for i, (seed, hot_last) in enumerate([(None, False), (5, True)]):
        e_phys, e_log, reps = _layout(num_ranks, permute_seed=seed, hot_last=hot_last)
        emap = a2a.ExpertMap.from_replicas(reps, e_phys)
        inputs = _logical_inputs(spec, num_ranks, e_log, 40 + i, minus_one_frac=0.1, invalid_frac=0.05)
        res = f(*_args(mesh, inputs), emap)
        per = {k: T.local_ranks_of(v) for k, v in res.items()}
        want_d = oracle.dispatch(spec, inputs, expert_map=emap)
        want_c = _logical_layer(spec, inputs, e_log, np.asarray(emap.counts), y_dtype)
        for r in per["out"]:
            got = {k: per[k][r] for k in per}
            T.check_dispatch(spec, num_ranks, r, want_d[r], got, exact_fp8=exact)
            T.check_combine(spec, r, want_c[r], got["out"], exact_fp8=exact)
    assert len(counter) == 1, f"the step was traced {len(counter)} times for two maps of one shape"


@pytest.mark.mpi
@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_replicas_out_of_range_repeated(backend, num_ranks, mesh):
    """Pairs to a logical expert with no replica, logical ids outside [0, E_log) (even ones that
    are valid physical ids) and repeated logical ids are dropped and counted, as without a map;
    -1 is not counted."""
    e_phys, e_log, reps = _layout(num_ranks)
    reps[1] = []  # logical expert 1 has no replica (its physical expert 1 is unused)
    spec = _spec(num_ranks)
    comm = a2a.init(spec, mesh, "ep", backend=backend, collect_stats=True)
    emap = a2a.ExpertMap.from_replicas(reps, e_phys, max_replicas=3)
    inputs = _logical_inputs(spec, num_ranks, e_log, 77, num_tokens=spec.max_tokens_per_rank, invalid_frac=0.1)
    for inp in inputs:
        inp.topk_ids[0] = [1, 0, -1]                      # zero replicas (counted), -1 (not)
        inp.topk_ids[1] = [e_log, e_phys - 1, 2]          # logical out of range, physical-range but logical-invalid
        inp.topk_ids[2] = [0, 0, 3]                       # a repeated logical id
    res = T.run_ops(comm, inputs, expert_map=emap)
    T.check_all(comm, inputs, res, expert_map=emap)
    for r, v in res.items():
        ids = inputs[r].topk_ids
        bad = sum(1 for row in ids for j, e in enumerate(row)
                  if e != -1 and (not 0 <= e < e_log or not reps[e] or e in row[:j]))
        assert int(v["num_dropped"]) == bad >= 4, (r, int(v["num_dropped"]), bad)
    assert comm.stats()["dropped"] == sum(int(v["num_dropped"]) for v in res.values())


# ---- the map's checks --------------------------------------------------------------------------

def test_from_replicas_validation():
    m = a2a.ExpertMap.from_replicas([[0, 5], [1], []], num_experts=6, max_replicas=4)
    assert m.physical.shape == (3, 4) and m.physical.dtype == jnp.int32 and m.counts.dtype == jnp.int32
    assert m.to_replicas() == [[0, 5], [1], []]
    np.testing.assert_array_equal(m.logical_of(6), [0, 1, -1, -1, -1, 0])
    ident = a2a.ExpertMap.identity(4)
    assert ident.to_replicas() == [[0], [1], [2], [3]]
    assert len(jax.tree.leaves(m)) == 2  # a pytree of the two arrays
    with pytest.raises(ValueError, match=r"replicas\[1\]: physical expert 0 is listed also by logical expert 0"):
        a2a.ExpertMap.from_replicas([[0, 1], [0]])
    with pytest.raises(ValueError, match=r"replicas\[0\]: physical expert 1 is listed twice"):
        a2a.ExpertMap.from_replicas([[1, 1]])
    with pytest.raises(ValueError, match="out of range"):
        a2a.ExpertMap.from_replicas([[0], [6]], num_experts=6)
    with pytest.raises(ValueError, match=">= 0"):
        a2a.ExpertMap.from_replicas([[-1]])
    with pytest.raises(ValueError, match="max_replicas"):
        a2a.ExpertMap.from_replicas([[0, 1]], max_replicas=1)
    with pytest.raises(ValueError, match="replicas"):
        a2a.ExpertMap.from_replicas([])


@pytest.mark.parametrize("bad, match", [
    ("not a map", "expert_map: expected a jax_moe_a2a.ExpertMap"),
    (a2a.ExpertMap(jnp.zeros((4, 1), jnp.int64 if jax.config.jax_enable_x64 else jnp.float32), jnp.ones(4, jnp.int32)),
     "expert_map.physical: expected dtype int32"),
    (a2a.ExpertMap(jnp.zeros((4,), jnp.int32), jnp.ones(4, jnp.int32)), r"expert_map.physical: expected shape"),
    (a2a.ExpertMap(jnp.zeros((4, 1), jnp.int32), jnp.ones(3, jnp.int32)), r"expert_map.counts: expected shape \[E_logical\] = \[4\]"),
    (a2a.ExpertMap(jnp.zeros((4, 1), jnp.int32), jnp.ones(4, jnp.float32)), "expert_map.counts: expected dtype int32"),
])
def test_trace_time_errors(bad, match, mesh, num_ranks):
    spec = _spec(num_ranks)
    comm = a2a.init(spec, mesh, "ep", backend="reference")
    t, k, h = spec.max_tokens_per_rank, spec.experts_per_token, spec.hidden

    def per_rank(x, ids, w):
        return comm.dispatch_recv(comm.dispatch_send(x, ids, w, expert_map=bad)).weights[None]

    f = jax.jit(T.shard_map(per_rank, mesh=mesh, in_specs=(P("ep"),) * 3, out_specs=P("ep")))
    args = (jax.ShapeDtypeStruct((num_ranks * t, h), jnp.float32), jax.ShapeDtypeStruct((num_ranks * t, k), jnp.int32),
            jax.ShapeDtypeStruct((num_ranks * t, k), jnp.float32))
    with pytest.raises(ValueError, match=match):
        f.lower(*args)


# ---- models.moe_layer with a map: forward and gradient -----------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_moe_layer_with_map_matches_dense_logical(backend, mesh, num_ranks):
    """moe_layer over physical weights (replicas copied from their logical expert) with the map
    equals dense_moe_block over the logical weights, forward (one-shot and overlap=True) and d/dx
    (one-shot ops: custom_vjp on the FFI backends), and the sum of a logical expert's replicas' weight gradients equals the
    dense layer's gradient of that expert."""
    n = num_ranks
    e_phys, e_log, reps = _layout(n)
    emap = a2a.ExpertMap.from_replicas(reps, e_phys)
    cfg = models.MoEConfig(hidden=64, ffn=32, num_experts=e_log, topk=2, shared_ffn=0, param_dtype=jnp.float32)
    spec = a2a.Spec(num_experts=e_phys, experts_per_token=2, hidden=64, max_tokens_per_rank=8,
                    dispatch_dtype=jnp.bfloat16, combine_dtype=jnp.float32)
    comm = a2a.init(spec, mesh, "ep", backend=backend, collect_stats=False)
    k1, k2 = jax.random.split(jax.random.PRNGKey(3))
    logical = models.init_moe_params(k1, cfg)
    owner = np.asarray(emap.logical_of(e_phys))
    assert (owner >= 0).all()
    phys = dict(logical, w1=logical["w1"][owner], w2=logical["w2"][owner])
    x = jax.random.normal(k2, (n * 8, cfg.hidden), jnp.float32)
    nt = jnp.asarray(np.arange(n) % 9, jnp.int32)

    def loss_sharded(p, x):
        out = models.moe_layer(comm, cfg, p, x, nt, expert_map=emap)
        return jnp.sum(out.astype(jnp.float32) ** 2), out

    def loss_dense(p, x):
        t = spec.max_tokens_per_rank
        out = jnp.concatenate([models.dense_moe_block(cfg, spec, p, x[r * t:(r + 1) * t], nt[r]) for r in range(n)])
        return jnp.sum(out.astype(jnp.float32) ** 2), out

    (_, out), (gp, gx) = jax.jit(jax.value_and_grad(loss_sharded, argnums=(0, 1), has_aux=True))(phys, x)
    (_, want), (wp, wx) = jax.jit(jax.value_and_grad(loss_dense, argnums=(0, 1), has_aux=True))(logical, x)
    scale = float(jnp.abs(want).max())
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=2e-2, atol=2e-2 * scale)
    np.testing.assert_allclose(np.asarray(gx), np.asarray(wx), rtol=5e-2, atol=5e-2 * float(jnp.abs(wx).max()))
    over = jax.jit(lambda p, x: models.moe_layer(comm, cfg, p, x, nt, overlap=True, expert_map=emap))(phys, x)
    np.testing.assert_allclose(np.asarray(over), np.asarray(out), rtol=1e-5, atol=1e-5, err_msg="overlap=True")
    for name in ("w1", "w2"):
        summed = jax.ops.segment_sum(gp[name], jnp.asarray(owner), num_segments=e_log)
        s = float(jnp.abs(wp[name]).max())
        assert float(jnp.abs(summed - wp[name]).max()) <= 5e-2 * s, f"{name}: replica gradients do not sum up"
