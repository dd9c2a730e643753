"""Helpers for testing code that uses jax_moe_a2a, and for its own tests and benchmarks: random
inputs, running dispatch and combine on every rank, and comparing each rank's outputs with the
NumPy oracle (`jax_moe_a2a.oracle`). A public module (docs/api.md), but outside the library
proper: nothing in jax_moe_a2a imports it (tests/test_library_apart.py checks), and it reaches the
communicator only through its public methods and attributes."""

from __future__ import annotations

import dataclasses
import itertools
import time
import weakref
from typing import Dict, List, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from . import oracle, quant, runtime
from ._compat import shard_map  # noqa: F401  (tests and the benchmark use testing.shard_map)
from .comm import Communicator
from .spec import Spec


def make_mesh(num_ranks: Optional[int] = None, axis: str = "ep") -> Mesh:
    """A 1-D mesh over the first `num_ranks` global devices (all by default)."""
    devs = jax.devices()
    num_ranks = len(devs) if num_ranks is None else num_ranks
    if num_ranks > len(devs):
        raise ValueError(f"num_ranks {num_ranks} > {len(devs)} devices")
    return Mesh(np.array(devs[:num_ranks]), (axis,))


_SEED_CALLS = itertools.count()


def fresh_seed() -> int:
    """A fresh seed (new random inputs every run) that every process of the job gets the same:
    process 0 draws it and publishes it in the jax.distributed key-value store. Tests call it in
    the same order on every process, and put the seed in their failure messages."""
    seed = int(np.random.SeedSequence().entropy % 2**31)
    if jax.process_count() == 1:
        return seed
    key = f"jax_moe_a2a/test-seed/{next(_SEED_CALLS)}"
    return int(runtime.exchange(key, {0: seed} if jax.process_index() == 0 else {}, 1, 120.0)[0])


def make_inputs(spec: Spec, num_ranks: int, seed: int, *, routing: str = "random",
                num_tokens=None, invalid_frac: float = 0.0, minus_one_frac: float = 0.0,
                input_dtype=np.float32, prequantized: bool = False,
                specials: bool = False) -> List[oracle.RankInputs]:
    """Random per-rank inputs from one seed (every process derives the same), replicated within
    each tp group.

    routing: "random" (distinct experts per token), "one_hot" (every token to expert 0 first),
      "empty" (ranks with odd index route nothing: all -1), "skewed" (experts of rank 0 favoured).
    num_tokens: int for all ranks, a list per DP group, or None (random in [0, T]).
    invalid_frac / minus_one_frac: share of ids replaced by out-of-range values / -1.
    specials: x's first rows carry the values of the fp8 rule for non-finite x (docs/api.md, "fp8
      quantisation"; `special_rows`): NaN, +-Inf, values far past +-448, all-zero blocks.
    """
    rng = np.random.default_rng(seed)
    t, k, e, h = spec.max_tokens_per_rank, spec.experts_per_token, spec.num_experts, spec.hidden
    groups = num_ranks // spec.tp_size
    out = []
    for g in range(groups):
        x = (rng.standard_normal((t, h)) * rng.uniform(0.1, 4.0, (t, 1))).astype(np.float32)
        if specials:
            special_rows(x, spec.scale_block)
        if routing == "one_hot":  # every token's first choice is expert 0 (one hot expert)
            ids = np.argsort(rng.random((t, e)), axis=1)[:, :k].astype(np.int32)
            for row in range(t):
                j = np.where(ids[row] == 0)[0]
                if j.size:
                    ids[row, j[0]] = ids[row, 0]
                ids[row, 0] = 0
        elif routing == "skewed":
            p = np.ones(e)
            p[: spec.local_experts(num_ranks)] = 20.0
            ids = np.stack([rng.choice(e, size=k, replace=False, p=p / p.sum()) for _ in range(t)]).astype(np.int32)
        else:
            ids = np.argsort(rng.random((t, e)), axis=1)[:, :k].astype(np.int32)
        if routing == "empty" and g % 2 == 1:
            ids[:] = -1
        if invalid_frac:
            m = rng.random(ids.shape) < invalid_frac
            ids[m] = rng.choice([e, e + 7, -2, -1000, 2**30], size=int(m.sum()))
        if minus_one_frac:
            ids[rng.random(ids.shape) < minus_one_frac] = -1
        w = rng.random((t, k)).astype(np.float32)
        if num_tokens is None:
            n = int(rng.integers(0, t + 1))
        elif isinstance(num_tokens, (list, tuple)):
            n = int(num_tokens[g])
        else:
            n = int(num_tokens)
        xs = None
        with np.errstate(over="ignore"):  # specials: 1e30 is inf in f16
            xin = x.astype(input_dtype)
        if prequantized:
            xin, xs = oracle.quantize_fp8(x, spec.scale_block, spec.pow2_scale)
        for _ in range(spec.tp_size):
            out.append(oracle.RankInputs(xin, ids.copy(), w, n, xs))
    return out


def with_a_routed_pair(spec: Spec, inp: oracle.RankInputs) -> oracle.RankInputs:
    """`inp` with at least one token (num_tokens >= 1) whose first pair is routed: token 0's first
    id made an expert in [0, E) that its other ids do not repeat (topk_ids changed in place). For
    tests that need a routed pair on a rank (nonzero gradients, say) whatever the draw."""
    ids = inp.topk_ids[0]
    ids[0] = min(set(range(spec.num_experts)) - set(ids[1:].tolist()))
    return dataclasses.replace(inp, num_tokens=max(1, int(inp.num_tokens)))


def special_rows(x: np.ndarray, block: int) -> np.ndarray:
    """Writes the special values into x [T, H] f32's first rows (those that exist), in place:
    row 0 one NaN; row 1 +Inf and, last, -Inf; row 2 zeros (every third one -0.0); row 3 a zero
    first scale block; row 4 1e30 and -3e4 (far past +-448 before scaling) and a NaN in the next
    block; row 5 a first block of NaN and Inf only. No value near f32 max: sums of them would
    overflow or not by the order of summation. Returns x."""
    t, h = x.shape
    last, b = h - 1, min(block, h)
    special = [x[i] for i in range(min(t, 6))]
    if len(special) > 0:
        special[0][5 % h] = np.nan
    if len(special) > 1:
        special[1][3 % h], special[1][last] = np.inf, -np.inf
    if len(special) > 2:
        special[2][:] = 0.0
        special[2][1::3] = -0.0
    if len(special) > 3:
        special[3][:b] = 0.0
    if len(special) > 4:
        special[4][0], special[4][1 % h], special[4][min(block, last)] = 1e30, -3e4, np.nan
    if len(special) > 5:
        special[5][:b] = np.nan
        special[5][b // 2:b] = np.inf
    return x


def stack_global(mesh: Mesh, axis, per_rank: List[np.ndarray]):
    """Per-rank arrays -> one global array [N * d0, ...] sharded over `axis` (process-local
    shards are built from the full list, which every process holds)."""
    full = np.concatenate([np.asarray(a)[None] for a in per_rank])  # [N, ...]
    full = full.reshape(-1, *full.shape[2:]) if full.ndim > 1 else full
    sharding = NamedSharding(mesh, P(axis))
    return jax.make_array_from_callback(full.shape, sharding, lambda idx: full[idx])


INPUT_FIELDS = ("x", "topk_ids", "topk_weights", "num_tokens")


def global_args(mesh: Mesh, inputs: List[oracle.RankInputs], fields=INPUT_FIELDS, axis="ep", *,
                rank_dim: bool = False) -> list:
    """The inputs' `fields` (names of `oracle.RankInputs` fields: x [T, H], topk_ids [T, K],
    topk_weights [T, K], num_tokens (as int32), x_scale [T, S]) as global arrays sharded over
    `axis`, one per field: [N * T, ...] (num_tokens [N]), or with rank_dim [N, T, ...]."""
    def per_rank(i, f):
        v = np.int32(i.num_tokens) if f == "num_tokens" else getattr(i, f)
        return v[None] if rank_dim else v
    return [stack_global(mesh, axis, [per_rank(i, f) for i in inputs]) for f in fields]


def local_ranks_of(arr) -> Dict[int, np.ndarray]:
    """Global array [N, ...] sharded over ranks -> {rank: its row} for this process's shards."""
    out = {}
    for sh in arr.addressable_shards:
        start = sh.index[0].start or 0
        data = np.asarray(sh.data)
        for i in range(data.shape[0]):
            out[start + i] = data[i]
    return out


def poison_devices(mesh: Mesh, nbytes: int = 1 << 22):
    """Fills and frees device memory with NaN bytes so that stale allocations are visible."""
    for d in mesh.devices.flat:
        if d.process_index == jax.process_index():
            a = jax.device_put(np.full(nbytes // 4, np.nan, np.float32), d)
            a.block_until_ready()
            a.delete()


def row_expert(spec: Spec, num_ranks: int, got) -> jax.Array:
    """Local expert of each received row: [R] (ragged) or [L, C] (expert_major) int32."""
    shape = spec.recv_shape(num_ranks)
    if spec.layout == "ragged":
        ends = jnp.cumsum(got.group_sizes)
        return jnp.searchsorted(ends, jnp.arange(shape[0]), side="right").astype(jnp.int32)
    return jnp.broadcast_to(jnp.arange(shape[0], dtype=jnp.int32)[:, None], shape)


def expert_fn_np(rows: np.ndarray, local_expert: int) -> np.ndarray:
    """The toy expert of the tests: rows * (1 + local_expert / 4), in f32."""
    return rows * np.float32(1.0 + local_expert / 4.0)


def expert_fn_jax(spec: Spec, num_ranks: int, got, y_dtype):
    """JAX twin of `expert_fn_np` applied to `got` (dequantising fp8)."""
    x = got.x.astype(jnp.float32)
    if spec.recv_is_fp8:
        x = quant.dequantize_fp8(got.x, got.scale, spec.scale_block)  # partial last block when H % block
    factor = 1.0 + row_expert(spec, num_ranks, got).astype(jnp.float32) / 4.0
    return (x * factor[..., None]).astype(y_dtype)


# run_ops' compiled steps per communicator: {communicator: {variant: jitted step}}. An entry goes
# with its communicator; the steps hold the communicator only weakly, so they do not keep it (and
# the engines and threads it owns) alive.
_STEPS: "weakref.WeakKeyDictionary[Communicator, dict]" = weakref.WeakKeyDictionary()


def compiled_steps(comm: Communicator) -> dict:
    """run_ops' jitted steps of `comm`, {variant: jitted function} (empty before the first run):
    tests count their compilations with `sum(f._cache_size() for f in ...values())`."""
    return _STEPS.get(comm, {})


def _held_back(x: jax.Array, axis, rank: int, seconds: float) -> jax.Array:
    """x [T, H] unchanged, but on rank `rank` of `axis` only after a host callback slept
    `seconds` there (inside shard_map): what depends on x on that rank starts that much later."""
    def hold(i, v):
        if int(i) == rank:
            time.sleep(seconds)
        return v
    return jax.pure_callback(hold, jax.ShapeDtypeStruct(x.shape, x.dtype), jax.lax.axis_index(axis), x)


def _step_fn(comm: Communicator, has_scale: bool, has_out: bool, y_dtype, split: bool, slot: int,
             has_map: bool = False, has_mask: bool = False, late: Optional[Tuple[int, float]] = None):
    """The jitted per-rank step of run_ops, compiled once per (communicator, variant). With
    has_map, an argument is an ExpertMap (replicated: in_spec P()), a traced argument, so
    other maps of the same shapes reuse the step; with has_mask, the last one is the rank mask
    [N] (replicated, traced: a new mask reuses the step); late: run_ops' `late`."""
    cache = _STEPS.setdefault(comm, {})
    key = (has_scale, has_out, np.dtype(y_dtype).name, split, slot, has_map, has_mask, late)
    if key in cache:
        return cache[key]
    spec, n, axis, mesh = comm.spec, comm.num_ranks, comm.axis, comm.mesh
    comm_ref = weakref.ref(comm)  # traced only from run_ops, while the communicator is alive

    def per_rank(x, ids, w, nt, *rest):
        comm = comm_ref()
        rest = list(rest)
        xs = rest.pop(0) if has_scale else None
        o = rest.pop(0) if has_out else None
        emap = rest.pop(0) if has_map else None
        mask = rest.pop(0) if has_mask else None
        if late is not None:
            x = _held_back(x, axis, *late)
        if split:
            h = comm.dispatch_send(x, ids, w, nt, slot=slot, x_scale=xs, expert_map=emap, rank_mask=mask)
            got = comm.dispatch_recv(h)
        else:
            got = comm.dispatch(x, ids, w, nt, slot=slot, x_scale=xs, expert_map=emap, rank_mask=mask)
        y = expert_fn_jax(spec, n, got, y_dtype)
        if split:
            res = comm.combine_recv(comm.combine_send(y, got), out=o)
        else:
            res = comm.combine(y, got, out=o)
        fields = {"x": got.x, "group_sizes": got.group_sizes, "weights": got.weights, "src": got.src,
                  "num_dropped": got.num_dropped, "num_overflow": got.num_overflow, "out": res}
        if got.scale is not None:
            fields["scale"] = got.scale
        if got.num_masked is not None:
            fields["num_masked"] = got.num_masked
        return jax.tree.map(lambda a: a[None], fields)

    nargs = 4 + int(has_scale) + int(has_out)
    in_specs = (P(axis),) * nargs + ((P(),) if has_map else ()) + ((P(),) if has_mask else ())
    f = jax.jit(shard_map(per_rank, mesh=mesh, in_specs=in_specs, out_specs=P(axis)))
    cache[key] = f
    return f


def run_ops(comm: Communicator, inputs: List[oracle.RankInputs], *, y_dtype=jnp.bfloat16,
            out: Optional[List[np.ndarray]] = None, split: bool = True, slot: int = 0, poison: bool = True,
            compile_only: bool = False, expert_map=None, rank_mask=None,
            late: Optional[Tuple[int, float]] = None):
    """Runs dispatch then combine (toy expert in between) on every rank under jit + shard_map.

    The compiled step is cached per communicator, so repeated calls (soak tests) reuse it.
    Returns {rank: {"x", "scale", "group_sizes", "weights", "src", "num_dropped", "num_overflow",
    "out"}} as numpy, for this process's ranks. compile_only=True compiles the step and returns
    None: a process that must not run it still has to compile it, because XLA:GPU shares
    autotuning between the processes compiling one program (--xla_gpu_shard_autotuning) and
    the others' compilation waits for it. expert_map: an `ExpertMap` passed to dispatch (the
    inputs' topk_ids are then logical ids); compare with check_all(..., expert_map=).
    rank_mask: [N] bool/int array passed to dispatch (replicated, traced); results then also
    have "num_masked". Compare with check_all(..., rank_mask=).
    late: (rank, seconds): that rank's dispatch starts `seconds` late (a host callback sleeps
    before it; the others run on), to hold one sender back in tests of the protocol's timing.
    """
    mesh, axis = comm.mesh, comm.axis
    has_scale = inputs[0].x_scale is not None
    args = global_args(mesh, inputs, INPUT_FIELDS + (("x_scale",) if has_scale else ()), axis)
    if out is not None:
        args.append(stack_global(mesh, axis, out))
    if expert_map is not None:
        args.append(expert_map)
    if rank_mask is not None:
        args.append(jnp.asarray(rank_mask))
    f = _step_fn(comm, has_scale, out is not None, y_dtype, split, slot, expert_map is not None,
                 rank_mask is not None, late)
    if compile_only:
        f.lower(*args).compile()
        return None
    if poison:
        poison_devices(mesh)
    res = jax.block_until_ready(f(*args))  # waits without the GIL (np.asarray below would hold it)
    per = {k: local_ranks_of(v) for k, v in res.items()}
    ranks = sorted(per["out"])
    return {r: {k: per[k][r] for k in per} for r in ranks}


def check_dispatch(spec: Spec, num_ranks: int, rank: int, want: oracle.RankDispatch, got: dict,
                   *, exact_fp8: bool = True):
    """Compares one rank's Dispatched with the oracle: counts exactly; per expert the multiset of
    (source, token) exactly; rows, scales and weights exactly per (source, token). With
    Spec.recv_dtype the rows are the oracle's fp8 rows dequantised into it, and no scales."""
    np.testing.assert_array_equal(got["group_sizes"], want.group_sizes, err_msg=f"rank {rank}: group_sizes")
    assert int(got["num_dropped"]) == want.num_dropped, f"rank {rank}: num_dropped {got['num_dropped']} != {want.num_dropped}"
    assert int(got["num_overflow"]) == want.num_overflow, f"rank {rank}: num_overflow {got['num_overflow']} != {want.num_overflow}"
    l_count = spec.local_experts(num_ranks)
    h = spec.hidden
    gx = np.asarray(got["x"]).reshape(-1, h)
    wx = np.asarray(want.x).reshape(-1, h)
    gs = np.asarray(got["scale"]).reshape(gx.shape[0], -1) if spec.recv_is_fp8 else None
    ws = np.asarray(want.scale).reshape(wx.shape[0], -1) if spec.is_fp8 else None
    if spec.recv_dtype is not None:  # dequantised on receive: the oracle's fp8 rows, dequantised
        assert "scale" not in got or got["scale"] is None, f"rank {rank}: scales returned with recv_dtype set"
        assert gx.dtype == spec.recv_dtype, f"rank {rank}: x dtype {gx.dtype}, recv_dtype {spec.recv_dtype}"
        wx = oracle.dequantize_fp8(wx, ws, spec.scale_block).astype(spec.recv_dtype)
    gsrc = np.asarray(got["src"]).reshape(-1, 2)
    wsrc = np.asarray(want.src).reshape(-1, 2)
    gw = np.asarray(got["weights"]).reshape(-1)
    ww = np.asarray(want.weights).reshape(-1)
    starts = np.concatenate([[0], np.cumsum(want.group_sizes)[:-1]])
    cap = spec.recv_rows(num_ranks)
    # Past the counts the contract fixes weights (0) and src (-1); x and scale are unspecified.
    if spec.layout == "ragged":
        past = np.arange(gw.size) >= int(np.sum(want.group_sizes))
    else:
        past = (np.arange(cap)[None, :] >= np.asarray(want.group_sizes)[:, None]).reshape(-1)
    assert np.all(gw[past] == 0), f"rank {rank}: weights past the counts must be 0"
    assert np.all(gsrc[past] == -1), f"rank {rank}: src past the counts must be -1"
    for l in range(l_count):
        cnt = int(want.group_sizes[l])
        lo = int(starts[l]) if spec.layout == "ragged" else l * cap
        sl = slice(lo, lo + cnt)
        key_g = [tuple(v) for v in gsrc[sl]]
        key_w = [tuple(v) for v in wsrc[sl]]
        assert sorted(key_g) == sorted(key_w), f"rank {rank} expert {l}: received (src, token) differ"
        og = np.lexsort((gsrc[sl, 1], gsrc[sl, 0]))
        ow = np.lexsort((wsrc[sl, 1], wsrc[sl, 0]))
        xg, xw = gx[sl][og], wx[sl][ow]
        if spec.recv_dtype is not None:
            if exact_fp8 or xg.size == 0:
                np.testing.assert_array_equal(xg.astype(np.float32), np.asarray(xw).astype(np.float32),
                                              err_msg=f"rank {rank} expert {l}: dequantised rows")
            else:  # the pure-JAX quantiser may be one fp8 code off: at most 2^-3 relative (e4m3)
                g32, w32 = xg.astype(np.float32), np.asarray(xw).astype(np.float32)
                off = ~np.isclose(g32, w32, rtol=0.13, atol=0, equal_nan=True) | (np.sign(g32) != np.sign(w32))
                assert np.mean(g32 != w32) < 1e-4 and not off.any(), \
                    f"rank {rank} expert {l}: dequantised rows differ in {np.mean(g32 != w32):.2e} of values"
        elif spec.is_fp8 and exact_fp8:
            np.testing.assert_array_equal(xg.view(np.uint8), np.asarray(xw).view(np.uint8),
                                          err_msg=f"rank {rank} expert {l}: fp8 rows")
            np.testing.assert_array_equal(gs[sl][og], ws[sl][ow], err_msg=f"rank {rank} expert {l}: scales")
        elif spec.is_fp8:
            np.testing.assert_array_equal(gs[sl][og], ws[sl][ow], err_msg=f"rank {rank} expert {l}: scales")
            if xg.size == 0:
                continue
            codes = np.abs(xg.view(np.uint8).astype(np.int16) - np.asarray(xw).view(np.uint8).astype(np.int16))
            assert codes.max(initial=0) <= 1 and np.mean(codes != 0) < 1e-4, \
                f"rank {rank} expert {l}: fp8 rows differ by up to {codes.max()} codes in {np.mean(codes != 0):.2e} of values"
        else:
            np.testing.assert_array_equal(np.asarray(xg).astype(np.float32), np.asarray(xw).astype(np.float32),
                                          err_msg=f"rank {rank} expert {l}: rows")
        np.testing.assert_array_equal(gw[sl][og], ww[sl][ow], err_msg=f"rank {rank} expert {l}: weights")


def check_combine(spec: Spec, rank: int, want: np.ndarray, got: np.ndarray, *, exact_fp8: bool = True):
    """Combined output vs oracle: f32 sums in another order, then a cast to combine_dtype.
    With exact_fp8=False (fp8 rows allowed one code off), a 1e-4 share of elements may differ."""
    got = np.asarray(got)
    assert got.dtype == np.dtype(spec.combine_dtype), f"rank {rank}: dtype {got.dtype}"
    tol = {np.dtype(jnp.float32): 1e-5, np.dtype(jnp.float16): 2e-3}.get(np.dtype(spec.combine_dtype), 1.6e-2)
    g, w = got.astype(np.float32), np.asarray(want).astype(np.float32)
    if spec.is_fp8 and not exact_fp8:
        bad = ~np.isclose(g, w, rtol=tol, atol=tol, equal_nan=True)
        assert bad.mean() <= 1e-4, f"rank {rank}: combine output differs in {bad.mean():.2e} of elements"
        return
    np.testing.assert_allclose(g, w, rtol=tol, atol=tol, err_msg=f"rank {rank}: combine output")


def exact_fp8_expected(comm: Communicator) -> bool:
    """fp8 rows must match the oracle bit for bit, except the pure-JAX backends' quantiser off
    XLA:CPU (XLA:GPU's f32 reciprocal can differ in the last bit, which moves a rare value by one
    e4m3 code)."""
    return not (comm.backend_name in ("reference", "ragged") and jax.default_backend() != "cpu")


def check_all(comm: Communicator, inputs, results, *, y_dtype=jnp.bfloat16, out=None, exact_fp8=None,
              expert_map=None, rank_mask=None, ranks=None):
    """Oracle comparison of run_ops' results for every rank present in `results` (with the
    oracle applying `expert_map` to the inputs' logical ids first, and `rank_mask`, when given).
    ranks: compare only these ranks (e.g. the live ones)."""
    spec, n = comm.spec, comm.num_ranks
    if exact_fp8 is None:
        exact_fp8 = exact_fp8_expected(comm)
    want_d = oracle.dispatch(spec, inputs, expert_map=expert_map, rank_mask=rank_mask)
    want_c = oracle.combine(spec, inputs, expert_fn_np, np.dtype(y_dtype), out=out, expert_map=expert_map,
                            rank_mask=rank_mask)
    assert results, "no rank results in this process"
    for r, res in results.items():
        if ranks is not None and r not in ranks:
            continue
        if rank_mask is not None:
            assert int(res["num_masked"]) == want_d[r].num_masked, \
                f"rank {r}: num_masked {res['num_masked']} != {want_d[r].num_masked}"
        check_dispatch(spec, n, r, want_d[r], res, exact_fp8=exact_fp8)
        check_combine(spec, r, want_c[r], res["out"], exact_fp8=exact_fp8)
