"""Oracle cases for documented arguments and options that had none on some CPU backend (the audit
in notes/option_coverage.md: one line per option, which test covers it on which backend).

The CPU variants: the host backend inline and with proxied=True, reference, and ragged (through
the dense emulation of ragged-all-to-all when XLA:CPU lacks it: tests/ragged_emulation.py). Each
case runs only on the variants where no other test file checked it against the NumPy oracle.
Fresh random inputs (the seed is in every failure message), outputs poisoned (testing.run_ops).

    cd tests && python -m pytest -q test_option_coverage.py
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import jax_moe_a2a as a2a
from jax_moe_a2a import experts, oracle
from jax_moe_a2a import testing as T

from conftest import BACKENDS
from ragged_emulation import emulated

FP8 = jnp.float8_e4m3fn
HOST = "host" in a2a.available_backends()

# (variant id, backend, init options)
VARIANTS = {"host": ("host", {}), "host-proxied": ("host", dict(proxied=True)),
            "reference": ("reference", {}), "ragged": ("ragged", {})}
ALL = tuple(VARIANTS)
GAPS_PR = ("host-proxied", "ragged")  # the variants test_ops.CASES does not run in CI


def _comm(variant, spec, mesh, **kw):
    """A communicator of `variant` (ragged: through the emulation unless the job has the real one)."""
    backend, opts = VARIANTS[variant]
    if backend == "host" and not HOST:
        pytest.skip("host backend not built")
    if backend == "ragged" and "ragged" not in BACKENDS:
        with emulated():  # the communicator keeps the emulated collective
            return a2a.init(spec, mesh, "ep", backend="ragged", timeout_s=30, **opts, **kw)
    return a2a.init(spec, mesh, "ep", backend=backend, timeout_s=30, **opts, **kw)


def _spec(num_ranks, **kw):
    return a2a.Spec(**{**dict(num_experts=2 * num_ranks, experts_per_token=3, hidden=32, max_tokens_per_rank=6),
                       **kw})


# ---- Spec fields, dtypes and out= through testing.run_ops ------------------------------------------------------
# (id, spec overrides, make_inputs kwargs, run kwargs, variants)
CASES = [
    # pow2_scale and a partial last scale block (H % scale_block != 0) quantised by the backend, and
    # recv_capacity with expert_major (rows past C dropped and counted)
    ("fp8-pow2-partial-block-expert-major-overflow",
     dict(dispatch_dtype=FP8, pow2_scale=True, hidden=48, scale_block=32, layout="expert_major", recv_capacity=2),
     {}, {}, GAPS_PR),
    # x_scale (x arrives quantised) with recv_dtype (rows dequantised on receive)
    ("fp8-x-scale-recv-f16", dict(dispatch_dtype=FP8, hidden=48, scale_block=32, recv_dtype=jnp.float16),
     dict(prequantized=True), {}, GAPS_PR),
    ("fp8-recv-bf16", dict(dispatch_dtype=FP8, recv_dtype=jnp.bfloat16), {}, {}, GAPS_PR),
    ("f16-wire", dict(dispatch_dtype=jnp.float16, combine_dtype=jnp.float16), dict(input_dtype=jnp.float16),
     dict(y_dtype=jnp.float16), GAPS_PR),
    # f32 rows on the wire; y wider than combine_dtype travels cast to it
    ("f32-dispatch-f32-y-bf16-combine", dict(dispatch_dtype=jnp.float32), {}, dict(y_dtype=jnp.float32), GAPS_PR),
    # y no wider than combine_dtype travels in its own dtype (f16 rows in the bf16 combine buffers),
    # and an `out` of another dtype (f32) than combine_dtype (bf16) added in
    ("f16-y-bf16-combine-f32-out", {}, {}, dict(y_dtype=jnp.float16, with_out=True), ALL),
    # bf16 rows in the f16 combine buffers (same width, another format)
    ("bf16-y-f16-combine", dict(combine_dtype=jnp.float16), {}, dict(y_dtype=jnp.bfloat16), ALL),
]


@pytest.mark.parametrize("case_id, spec_kw, input_kw, run_kw, variant",
                         [pytest.param(c[0], c[1], c[2], c[3], v, id=f"{c[0]}-{v}") for c in CASES for v in c[4]])
def test_option_against_oracle(case_id, spec_kw, input_kw, run_kw, variant, num_ranks, mesh):
    spec = _spec(num_ranks, **spec_kw)
    comm = _comm(variant, spec, mesh)
    seed = T.fresh_seed()
    run_kw = dict(run_kw)
    y_dtype = run_kw.pop("y_dtype", jnp.bfloat16)
    out = None
    if run_kw.pop("with_out", False):
        rng = np.random.default_rng(seed + 1)
        out = [rng.standard_normal((spec.max_tokens_per_rank, spec.hidden)).astype(np.float32)
               for _ in range(num_ranks)]
    try:
        inputs = T.make_inputs(spec, num_ranks, seed, **input_kw)
        res = T.run_ops(comm, inputs, y_dtype=y_dtype, out=out, **run_kw)
        T.check_all(comm, inputs, res, y_dtype=y_dtype, out=out)
        if spec.recv_capacity is not None:
            assert sum(int(r["num_overflow"]) for r in res.values()) > 0, "the case must overflow"
    except AssertionError as e:
        raise AssertionError(f"seed {seed} {case_id} {variant}: {e}") from None
    finally:
        comm.close()


# ---- num_tokens as a Python int and as None, slots, combine on another slot, after= -----------------------------
@pytest.mark.parametrize("variant", ALL)
def test_num_tokens_int_and_none_on_other_slots(variant, num_ranks, mesh):
    """num_tokens=5 (a Python int: a constant, not a device array) on slot 1, its combine on slot 2
    with after=; a one-shot dispatch and combine with num_tokens=None (= T) on slot 0, in flight
    beside it. Every test_ops case passes num_tokens as a device array on slot 0."""
    spec = _spec(num_ranks, slots=3)
    t, n = spec.max_tokens_per_rank, num_ranks
    comm = _comm(variant, spec, mesh)
    seed = T.fresh_seed()
    a = T.make_inputs(spec, n, seed, num_tokens=5, minus_one_frac=0.1)
    b = T.make_inputs(spec, n, seed + 1, num_tokens=t, minus_one_frac=0.1)

    def fields(got, res):
        return {"x": got.x, "group_sizes": got.group_sizes, "weights": got.weights, "src": got.src,
                "num_dropped": got.num_dropped, "num_overflow": got.num_overflow, "out": res}

    def per_rank(xa, ia, wa, xb, ib, wb):
        ha = comm.dispatch_send(xa, ia, wa, 5, slot=1, after=xb)
        gb = comm.dispatch(xb, ib, wb)                                    # num_tokens None, slot 0
        ga = comm.dispatch_recv(ha)
        oa = comm.combine_recv(comm.combine_send(T.expert_fn_jax(spec, n, ga, jnp.bfloat16), ga, slot=2,
                                                 after=ga.x))
        ob = comm.combine(T.expert_fn_jax(spec, n, gb, jnp.bfloat16), gb)
        return jax.tree.map(lambda v: v[None], (fields(ga, oa), fields(gb, ob)))

    args = [arr for inp in (a, b) for arr in T.global_args(mesh, inp, ("x", "topk_ids", "topk_weights"))]
    f = jax.jit(T.shard_map(per_rank, mesh=mesh, in_specs=(P("ep"),) * 6, out_specs=P("ep")))
    try:
        T.poison_devices(mesh)
        got = jax.block_until_ready(f(*args))
        for name, inp, res in (("int 5, slot 1 -> 2", a, got[0]), ("None, slot 0", b, got[1])):
            want_d = oracle.dispatch(spec, inp)
            want_c = oracle.combine(spec, inp, T.expert_fn_np, np.dtype(jnp.bfloat16))
            per = {k: T.local_ranks_of(v) for k, v in res.items()}
            for r in per["out"]:
                mine = {k: per[k][r] for k in per}
                try:
                    T.check_dispatch(spec, n, r, want_d[r], mine)
                    T.check_combine(spec, r, want_c[r], mine["out"])
                except AssertionError as e:
                    raise AssertionError(f"seed {seed} {variant} num_tokens {name}: {e}") from None
    finally:
        comm.close()


# ---- expert_map (EPLB) on the variants test_eplb.py does not run ---------------------------------------------
@pytest.mark.parametrize("split", [True, False], ids=["split", "one-shot"])
@pytest.mark.parametrize("variant", GAPS_PR)
def test_expert_map_against_oracle(variant, split, num_ranks, mesh):
    """12 logical experts on 16 physical ones (8 ranks; 4 logical experts with a replica on another
    rank), fp8, expert_major, invalid and -1 logical ids: rows where the oracle's replica rule puts them."""
    from test_eplb import _layout, _logical_inputs
    e_phys, e_log, reps = _layout(num_ranks, permute_seed=3)
    spec = _spec(num_ranks, num_experts=e_phys, dispatch_dtype=FP8, layout="expert_major")
    comm = _comm(variant, spec, mesh)
    seed = T.fresh_seed()
    emap = a2a.ExpertMap.from_replicas(reps, e_phys, max_replicas=3)
    try:
        inputs = _logical_inputs(spec, num_ranks, e_log, seed, minus_one_frac=0.05, invalid_frac=0.05)
        res = T.run_ops(comm, inputs, expert_map=emap, split=split)
        T.check_all(comm, inputs, res, expert_map=emap)
    except AssertionError as e:
        raise AssertionError(f"seed {seed} {variant}: {e}") from None
    finally:
        comm.close()


# ---- rank_mask, collect_stats and debug on the ragged backend -------------------------------------------------
def _dead(n, seed):
    rng = np.random.default_rng(seed)
    return sorted(rng.choice(n, size=int(rng.integers(1, max(2, n // 2 + 1))), replace=False).tolist())


def test_ragged_rank_mask_and_stats(num_ranks, mesh):
    """The ragged backend with random rank masks (one compiled step), bad ids and overflow, against
    the oracle; stats() counts what the outputs count (dropped, overflow, masked, dispatches)."""
    if num_ranks < 2:
        pytest.skip("needs 2 ranks")
    spec = _spec(num_ranks, recv_capacity=4)
    comm = _comm("ragged", spec, mesh, collect_stats=True)
    seed = T.fresh_seed()
    total = {"dropped": 0, "overflow": 0, "masked": 0}
    try:
        for step in range(2):
            mask = np.ones(num_ranks, np.int32)
            mask[_dead(num_ranks, seed + step)] = 0
            inputs = T.make_inputs(spec, num_ranks, seed + step, num_tokens=spec.max_tokens_per_rank,
                                   invalid_frac=0.1, minus_one_frac=0.05)
            res = T.run_ops(comm, inputs, rank_mask=mask, split=step == 0)
            T.check_all(comm, inputs, res, rank_mask=mask)
            for r in res.values():
                for k in total:
                    total[k] += int(r[f"num_{k}"])
        assert total["overflow"] > 0 and total["masked"] > 0, total
        jax.effects_barrier()
        st = comm.stats()
        assert st["dispatches"] == 2 * num_ranks and {k: st[k] for k in total} == total, (st, total)
    except AssertionError as e:
        raise AssertionError(f"seed {seed}: {e}") from None
    finally:
        comm.close()


def test_ragged_debug_raises_on_drop(num_ranks, mesh):
    spec = _spec(num_ranks)
    comm = _comm("ragged", spec, mesh, debug=True)
    inputs = T.make_inputs(spec, num_ranks, T.fresh_seed(), num_tokens=spec.max_tokens_per_rank)
    inputs[-1].topk_ids[1, 0] = spec.num_experts + 3
    try:
        with pytest.raises(a2a.DroppedRowsError, match=f"rank {num_ranks - 1}, token 1: expert id"):
            with comm.checked():
                T.run_ops(comm, inputs)
    finally:
        comm.close()


# ---- the host backend's options: engine, proxied on a multi-axis mesh, refusals -------------------------------
@pytest.mark.skipif(not HOST, reason="host backend not built")
def test_host_engine_fabric_in_one_process(num_ranks, mesh):
    """engine="fabric" in one process (libfabric endpoints between the process's own ranks; the
    default there is "local"): the same outputs as the oracle."""
    if jax.process_count() > 1:
        pytest.skip("fabric is the default across processes")
    spec = _spec(num_ranks, dispatch_dtype=FP8, recv_capacity=4 * num_ranks)
    comm = a2a.init(spec, mesh, "ep", backend="host", engine="fabric", max_private_tokens=1, timeout_s=30)
    seed = T.fresh_seed()
    try:
        assert comm.diagnostics()["engine"] == "fabric", comm.diagnostics()
        for step in range(2):
            inputs = T.make_inputs(spec, num_ranks, seed + step, routing=["random", "one_hot"][step])
            T.check_all(comm, inputs, T.run_ops(comm, inputs))
    except AssertionError as e:
        raise AssertionError(f"seed {seed}: {e}") from None
    finally:
        comm.close()


@pytest.mark.skipif(not HOST, reason="host backend not built")
def test_host_proxied_multi_axis_mesh():
    """proxied=True on a 2 x 4 mesh (two EP groups of 4 ranks, each group its own proxies), every
    group against the oracle with its own inputs."""
    from test_multiaxis import check_groups, group_inputs, run_groups
    if jax.process_count() > 1 or jax.device_count() != 8:
        pytest.skip("one process with 8 devices")
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("dp", "ep"))
    spec = a2a.Spec(num_experts=8, experts_per_token=3, hidden=32, max_tokens_per_rank=6, tp_size=2,
                    dispatch_dtype=FP8, scale_block=16, recv_capacity=8)
    comm = a2a.init(spec, mesh, "ep", backend="host", proxied=True, max_private_tokens=1, timeout_s=30)
    seed = T.fresh_seed()
    try:
        assert comm.num_groups == 2 and comm.num_ranks == 4
        inputs = group_inputs(spec, comm, seed, minus_one_frac=0.1)
        check_groups(comm, inputs, run_groups(comm, inputs))
    except AssertionError as e:
        raise AssertionError(f"seed {seed}: {e}") from None
    finally:
        comm.close()


@pytest.mark.skipif(not HOST, reason="host backend not built")
def test_host_option_refusals(mesh, num_ranks):
    """Documented option values the host backend refuses, with the reason: node_size without
    proxied, an engine other than local or fabric, a negative max_private_tokens."""
    spec = _spec(num_ranks)
    with pytest.raises(ValueError, match="node_size needs proxied=True"):
        a2a.init(spec, mesh, "ep", backend="host", node_size=2)
    with pytest.raises(ValueError, match="engine must be 'local' or 'fabric', got 'shm'"):
        a2a.init(spec, mesh, "ep", backend="host", engine="shm")
    with pytest.raises(ValueError, match="max_private_tokens: expected >= 0"):
        a2a.init(spec, mesh, "ep", backend="host", max_private_tokens=-1)


# ---- grouped GEMMs: the dtype combinations test_experts.py does not check forward ----------------------------
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.float32], ids=["f16", "f32"])
@pytest.mark.parametrize("layout", ["ragged", "expert_major"])
def test_grouped_matmul_f16_f32_inputs(layout, dtype):
    """The plain-JAX grouped_matmul takes f16 and f32 x and w (docs/api.md); forward against the
    float64 oracle, rows outside the groups NaN-poisoned, f32 out."""
    from test_experts import _assert_close, _live, make_gemm, oracle_gemm
    seed = T.fresh_seed()
    rng = np.random.default_rng(seed)
    rows, gs = (37, [3, 0, 10, 0, 17]) if layout == "ragged" else (9, [3, 0, 9, 0, 5])
    kw, _, _, gsj = make_gemm(rng, layout, "bf16", groups=5, k=40, n=24, rows=rows, gs=gs)
    live = _live(layout, gs, rows)
    x32 = rng.standard_normal(kw["x"].shape).astype(np.float32)
    x = jnp.asarray(np.where(live[..., None], x32, np.nan)).astype(dtype)      # poisoned outside the groups
    w = jnp.asarray(rng.standard_normal(kw["w"].shape) / 6).astype(dtype)
    xd = np.where(live[..., None], np.asarray(x.astype(jnp.float32), np.float64), 0.0)
    wd = np.asarray(w.astype(jnp.float32), np.float64)
    y = jax.jit(lambda x, w, g: a2a.grouped_matmul(x, w, g, out_dtype=jnp.float32, impl="xla"))(x, w, gsj)
    assert y.dtype == jnp.float32
    _assert_close(y, oracle_gemm(xd, wd, gs, layout), oracle_gemm(np.abs(xd), np.abs(wd), gs, layout),
                  jnp.float32, seed, f"{layout}/{np.dtype(dtype).name}")


@pytest.mark.parametrize("layout", ["ragged", "expert_major"])
def test_expert_mlp_bf16_x_fp8_down(layout):
    """bf16 x and gate/up weights with fp8 down weights: quantize_hidden defaults to True and h is
    re-quantised with w_down_scale's block along F (the combination test_experts.py leaves out)."""
    from test_experts import _assert_mlp_close, make_mlp, oracle_mlp
    seed = T.fresh_seed()
    rng = np.random.default_rng(seed)
    rows, gs = (29, [6, 0, 13, 2]) if layout == "ragged" else (7, [6, 0, 7, 2])
    h, f, block = 64, 48, 16
    kw, xd, wgu, _, gsj = make_mlp(rng, layout, "bf16", groups=4, h=h, f=f, rows=rows, gs=gs, block=None)
    wdn = rng.standard_normal((4, h, f)) / np.sqrt(f)
    kw["w_down"], kw["w_down_scale"] = a2a.quantize_weights_fp8(jnp.asarray(wdn, jnp.float32), block)
    wdn = np.asarray(experts.dequantize_weights_fp8(kw["w_down"], kw["w_down_scale"]), np.float64)
    y = jax.jit(lambda kw, g: a2a.expert_mlp(group_sizes=g, out_dtype=jnp.float32, impl="xla", **kw))(kw, gsj)
    assert y.dtype == jnp.float32
    want, bound = oracle_mlp(xd, wgu, wdn, gs, layout, quantize=block)
    _assert_mlp_close(y, want, bound, True, seed, f"{layout} bf16 x, fp8 w_down")
    # _assert_mlp_close allows every output 2e-2 of its bound (an fp8 step of h in a few places);
    # most outputs must be much closer, else a systematic error of h's scales (2 %) passes
    err = np.abs(np.asarray(y, np.float64) - want)
    far = np.mean(err > 2.0**-8 * np.abs(want) + 1e-3 * bound)
    assert far < 0.05, f"seed {seed} {layout}: {far:.1%} of outputs beyond 1e-3 of their bound"
