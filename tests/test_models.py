"""The example MoE model: forward and backward of a 2-layer toy model on every backend match the
reference backend's."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_moe_a2a as a2a
from jax_moe_a2a import models
from jax_moe_a2a.backends import backend_class
from jax_moe_a2a import testing as T

from conftest import BACKENDS, PURE_JAX


# _run's results of _small_model's inputs, per (backend, ranks, score, remat): the model tests
# share some (the sigmoid model's plain run of a backend is compared with the reference and with
# its remat run), and each costs a compilation of a 2-layer forward and backward.
_RUNS = {}
_SEED = []


def _model_seed() -> int:
    """This file's inputs' seed: fresh each run (T.fresh_seed), one for all its tests (_RUNS keeps
    results of _small_model's inputs from test to test)."""
    if not _SEED:
        _SEED.append(T.fresh_seed())
    return _SEED[0]


def _run(backend, mesh, n, cfg, spec, params, x, remat=False):
    """(out, loss, grad x, grad layers, lowered HLO text) of mean(toy_model(x)^2) on every rank,
    for _small_model(n, cfg.score)'s inputs."""
    key = (backend, n, cfg.score, remat)
    if key not in _RUNS:
        _RUNS[key] = _run_uncached(backend, mesh, n, cfg, spec, params, x, remat)
    return _RUNS[key]


def _run_uncached(backend, mesh, n, cfg, spec, params, x, remat):
    comm = a2a.init(spec, mesh, "ep", backend=backend, collect_stats=False)
    specs = [models.moe_param_specs(cfg) for _ in params]

    def per_rank(x, layers):
        def loss(x, layers):
            out = models.toy_model(comm, cfg, layers, x, remat=remat)
            return jnp.mean(out.astype(jnp.float32) ** 2), out
        (l, out), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x, layers)
        # every rank's gradients (replicated parameters differ per rank: each sees its tokens)
        return out[None], l[None], jax.tree.map(lambda a: a[None], grads)

    f = jax.jit(T.shard_map(per_rank, mesh=mesh, in_specs=(P("ep"), specs), out_specs=P("ep"),
                            check_vma=False))
    out, loss, (gx, glayers) = f(x, params)
    return np.asarray(out, np.float32), np.asarray(loss), np.asarray(gx, np.float32), jax.tree.map(
        lambda a: np.asarray(a, np.float32), glayers), f.lower(x, params).as_text()


def _small_model(n, score="softmax"):
    cfg = models.MoEConfig(hidden=64, ffn=32, num_experts=2 * n, topk=2, shared_ffn=48, score=score)
    spec = a2a.Spec(num_experts=cfg.num_experts, experts_per_token=cfg.topk, hidden=cfg.hidden,
                    max_tokens_per_rank=8, dispatch_dtype=jnp.bfloat16, combine_dtype=jnp.float32)
    keys = jax.random.split(jax.random.PRNGKey(_model_seed()), 3)
    params = [models.init_moe_params(keys[i], cfg) for i in range(2)]
    x = jax.random.normal(keys[2], (n * 8, cfg.hidden), jnp.float32)
    return cfg, spec, params, x


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_toy_model_matches_reference(score, mesh, num_ranks):
    n = num_ranks
    others = [b for b in BACKENDS if b != "reference"]
    if not others:
        pytest.skip("no other backend to compare")
    cfg, spec, params, x = _small_model(n, score)
    ref = _run("reference", mesh, n, cfg, spec, params, x)
    for b in others:
        got = _run(b, mesh, n, cfg, spec, params, x)
        what = f"seed {_model_seed()} {b}"
        np.testing.assert_allclose(got[0], ref[0], rtol=2e-2, atol=2e-2, err_msg=f"{what}: forward")
        np.testing.assert_allclose(got[2], ref[2], rtol=5e-2, atol=5e-3, err_msg=f"{what}: grad x")
        flat_g, flat_r = jax.tree.leaves(got[3]), jax.tree.leaves(ref[3])
        for a, r in zip(flat_g, flat_r):
            scale = np.abs(r).max() + 1e-6
            assert np.abs(a - r).max() <= 5e-2 * scale, f"{what}: parameter gradient differs ({np.abs(a - r).max()} vs scale {scale})"


def _comm_calls(hlo: str) -> tuple:
    """(exchange halves, EP = 1 local-path calls) among the FFI calls of `hlo`."""
    return (len(re.findall(r"custom_call @jax_moe_a2a_\w+_(?:dispatch|combine)_(?:send|recv)", hlo)),
            len(re.findall(r"custom_call @jax_moe_a2a_\w+_local_(?:dispatch|combine)", hlo)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_remat_matches_plain(backend, mesh, num_ranks):
    """jax.checkpoint around each layer: the same loss and gradients as without remat, and on the
    FFI backends no communication half is recomputed (the same number of comm calls)."""
    cfg, spec, params, x = _small_model(num_ranks, "sigmoid")
    plain = _run(backend, mesh, num_ranks, cfg, spec, params, x)
    rem = _run(backend, mesh, num_ranks, cfg, spec, params, x, remat=True)
    assert "optimization_barrier" in rem[4] and "optimization_barrier" not in plain[4], "remat did not apply"
    seed = _model_seed()
    np.testing.assert_allclose(rem[0], plain[0], rtol=1e-5, atol=1e-5, err_msg=f"seed {seed}: forward")
    np.testing.assert_allclose(rem[1], plain[1], rtol=1e-5, err_msg=f"seed {seed}: loss")
    np.testing.assert_allclose(rem[2], plain[2], rtol=1e-4, atol=1e-6, err_msg=f"seed {seed}: grad x")
    for a, r in zip(jax.tree.leaves(rem[3]), jax.tree.leaves(plain[3])):
        assert np.abs(a - r).max() <= 1e-4 * (np.abs(r).max() + 1e-6), f"seed {seed}: parameter gradient differs under remat"
    if backend != "reference":
        # 2 layers x (forward dispatch + combine, backward combine + dispatch) x 2 halves, or one
        # call per op where the backend takes the GPU backends' EP = 1 path
        local = getattr(backend_class(backend)(), "uses_local_path", lambda n: False)(num_ranks)
        expected = (0, 8) if local else (16, 0)
        assert _comm_calls(plain[4]) == _comm_calls(rem[4]) == expected, (_comm_calls(plain[4]), _comm_calls(rem[4]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_overlap_layer_matches_one_shot(backend, mesh, num_ranks):
    """moe_layer(overlap=True) (split halves, shared expert in flight) gives the one-shot forward
    and the dense computation (dense_moe_block)."""
    cfg, spec, params, x = _small_model(num_ranks)
    comm = a2a.init(spec, mesh, "ep", backend=backend, collect_stats=False)
    n = jnp.asarray(np.arange(num_ranks) % 9, jnp.int32)
    outs = [np.asarray(jax.jit(lambda p, x, n: models.moe_layer(comm, cfg, p, x, n, overlap=o))(params[0], x, n))
            for o in (False, True)]
    assert np.abs(outs[0]).max() > 0
    np.testing.assert_allclose(outs[1], outs[0], rtol=1e-5, atol=1e-5, err_msg=f"seed {_model_seed()}")
    t = spec.max_tokens_per_rank   # and the dense single-device computation (examples/serve.py's check)
    for r in range(num_ranks):
        want = np.asarray(models.dense_moe_block(cfg, spec, params[0], x[r * t:(r + 1) * t], n[r]))
        np.testing.assert_allclose(outs[1][r * t:(r + 1) * t], want, rtol=2e-2, atol=2e-2 * np.abs(want).max(),
                                   err_msg=f"seed {_model_seed()} rank {r}")


# --- moe_block's options: given routing, shared-expert placement, slot, identity experts ------------------
# Each option is checked against the dense one-device computation (dense_moe_block), a NumPy formula where
# one is short, and the formulation benchmarks/layers.py timed before it called the library.

_WIRES = {"bf16": dict(dispatch_dtype=jnp.bfloat16), "fp8": dict(dispatch_dtype=jnp.float8_e4m3fn),
          "fp8-recv-bf16": dict(dispatch_dtype=jnp.float8_e4m3fn, recv_dtype=jnp.bfloat16)}


def _opt_setup(n, experts="ragged_dot", wire="bf16", shared_ffn=48, t=8):
    """(cfg, spec, params, x [n*t, H] f32, num_tokens [n] int32, (ids, w) [n*t, K]): H=128, F=64,
    E=2n, K=2, fp8 blocks of 64 (wire and weights); ids distinct per token and not the router's."""
    expert_dtype = jnp.float8_e4m3fn if experts == "grouped" else None
    cfg = models.MoEConfig(hidden=128, ffn=64, num_experts=2 * n, topk=2, shared_ffn=shared_ffn, score="sigmoid",
                           experts=experts, expert_dtype=expert_dtype, weight_block=64)
    spec = a2a.Spec(num_experts=cfg.num_experts, experts_per_token=cfg.topk, hidden=cfg.hidden,
                    max_tokens_per_rank=t, combine_dtype=jnp.float32, scale_block=64, **_WIRES[wire])
    seed = _model_seed() + 1
    k = jax.random.split(jax.random.PRNGKey(seed), 2)
    params = models.init_moe_params(k[0], cfg)
    x = jax.random.normal(k[1], (n * t, cfg.hidden), jnp.float32)
    rng = np.random.default_rng(seed)
    ids = np.argsort(rng.random((n * t, cfg.num_experts)), axis=1)[:, :cfg.topk].astype(np.int32)
    w = rng.uniform(0.1, 1.0, (n * t, cfg.topk)).astype(np.float32)
    num = jnp.asarray((np.arange(n) * 3 + 2) % (t + 1), jnp.int32)   # some ranks full, some empty
    return cfg, spec, params, x, num, (jnp.asarray(ids), jnp.asarray(w))


def _dense_per_rank(cfg, spec, params, x, num, routing=None):
    t = spec.max_tokens_per_rank
    out = []
    for r in range(len(num)):
        rt = None if routing is None else (routing[0][r * t:(r + 1) * t], routing[1][r * t:(r + 1) * t])
        out.append(np.asarray(models.dense_moe_block(cfg, spec, params, x[r * t:(r + 1) * t], num[r], routing=rt),
                              np.float32))
    return np.concatenate(out)


def _close(got, want, what, rel=2e-2):
    what = f"seed {_model_seed()}: {what}"
    scale = np.abs(want).max()
    assert scale > 0, f"{what}: the reference is all zero"
    np.testing.assert_allclose(got, want, rtol=rel, atol=rel * scale, equal_nan=False, err_msg=what)


@pytest.mark.parametrize("backend", BACKENDS)
def test_given_routing(backend, mesh, num_ranks):
    """routing=(ids, weights): the layer uses them instead of the router (params without "router" work)
    and equals dense_moe_block with the same routing; the router's own ids given back reproduce the
    default layer exactly; one-shot and split halves alike."""
    cfg, spec, params, x, num, routing = _opt_setup(num_ranks)
    comm = a2a.init(spec, mesh, "ep", backend=backend, collect_stats=False)
    no_router = {k: v for k, v in params.items() if k != "router"}
    given = [np.asarray(jax.jit(lambda p, x, n, r, o=o: models.moe_layer(comm, cfg, p, x, n, routing=r, overlap=o))(
        no_router, x, num, routing)) for o in (False, True)]   # one jit each: two exchanges on one slot must not interleave
    want = _dense_per_rank(cfg, spec, params, x, num, routing)
    for o, got in zip((False, True), given):
        _close(got, want, f"{backend}: given routing, overlap={o}")
    with_router = np.asarray(jax.jit(lambda p, x, n, r: models.moe_layer(comm, cfg, p, x, n, routing=r))(
        params, x, num, routing))   # the given routing wins over a router in params
    np.testing.assert_array_equal(with_router, given[0])
    router = jax.vmap(lambda xr: models.route(cfg, params["router"], xr))(x.reshape(num_ranks, -1, cfg.hidden))
    own = tuple(a.reshape(-1, cfg.topk) for a in router)
    mine = np.asarray(jax.jit(lambda p, x, n, r: models.moe_layer(comm, cfg, p, x, n, routing=r))(params, x, num, own))
    default = np.asarray(jax.jit(lambda p, x, n: models.moe_layer(comm, cfg, p, x, n))(params, x, num))
    np.testing.assert_array_equal(mine, default)
    assert not np.allclose(mine, given[0], atol=1e-3), "the given routing made no difference"


def test_route_is_top_k_of_the_scores():
    """models.route (the router of moe_block and of benchmarks/layers.py --routing per-layer) against
    NumPy: softmax over all E then top-K; sigmoid top-K renormalised to sum to route_scale."""
    seed = T.fresh_seed()   # fresh inputs each run; the seed in every message
    rng = np.random.default_rng(seed)
    # Inputs whose logits every precision computes exactly (x: multiples of 1/8 up to 1, wr: of
    # 1/64 up to 1; 8 significant bits at most, bf16's; products multiples of 2^-9, sums of 32 of
    # them below 2^6), so that the top K is the same set in float64 and in JAX at any matmul
    # precision (TF32 on GPUs, bf16 passes): with float inputs a near tie of the K-th and next
    # logit made the sets differ (~1e-5 a run in f32, more with TF32). A token whose K-th and
    # next logit tie exactly (~1e-3 a token) is drawn again: either would be a right top K.
    wr = (rng.integers(-64, 65, (32, 16)) / 64).astype(np.float32)
    x = np.zeros((6, 32), np.float32)
    for t in range(6):
        while True:
            x[t] = rng.integers(-8, 9, 32) / 8
            top5 = np.sort(x[t].astype(np.float64) @ wr)[::-1][:5]
            if top5[3] != top5[4]:
                break
    logits = x.astype(np.float64) @ wr
    for score, scale in (("softmax", 1.0), ("sigmoid", 2.5)):
        cfg = models.MoEConfig(hidden=32, ffn=8, num_experts=16, topk=4, score=score, route_scale=scale)
        ids, w = (np.asarray(a) for a in models.route(cfg, jnp.asarray(wr), jnp.asarray(x)))
        assert ids.dtype == np.int32 and w.dtype == np.float32 and ids.shape == w.shape == (6, 4), seed
        for t in range(6):
            top = np.argsort(-logits[t], kind="stable")[:4]
            assert set(ids[t].tolist()) == set(top.tolist()), (seed, score, t)
            if score == "softmax":
                p = np.exp(logits[t] - logits[t].max())
                want = p[ids[t]] / p.sum()
            else:
                s = 1 / (1 + np.exp(-logits[t][ids[t]]))
                want = s / s.sum()
            np.testing.assert_allclose(w[t], scale * want, rtol=1e-4, err_msg=f"seed {seed}, {score}, token {t}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("overlap", [False, True])
def test_shared_expert_placements(backend, overlap, mesh, num_ranks):
    """shared_at "combine" / "overlap" / "after" give the same layer (= dense_moe_block) and place the
    shared expert where they say: "after" behind an optimisation barrier (none in the one-shot
    "combine" layer); shared_ffn=0 (the benchmarks' --shared none) = the dense layer without one."""
    cfg, spec, params, x, num, _ = _opt_setup(num_ranks)
    comm = a2a.init(spec, mesh, "ep", backend=backend, collect_stats=False)
    places = ("combine", "after") + (("overlap",) if overlap else ())
    outs, texts = {}, {}
    for s in places:
        f = jax.jit(lambda p, x, n, s=s: models.moe_layer(comm, cfg, p, x, n, overlap=overlap, shared_at=s))
        outs[s], texts[s] = np.asarray(f(params, x, num)), f.lower(params, x, num).as_text()
    want = _dense_per_rank(cfg, spec, params, x, num)
    for s in places:
        _close(outs[s], want, f"{backend}: shared_at={s}, overlap={overlap}")
        np.testing.assert_allclose(outs[s], outs["combine"], rtol=1e-5, atol=1e-5, err_msg=s)
    assert "optimization_barrier" in texts["after"], "shared_at='after' placed no barrier"
    if not overlap:
        assert "optimization_barrier" not in texts["combine"]
    none = dataclasses.replace(cfg, shared_ffn=0)
    bare = {k: v for k, v in params.items() if k not in ("w1s", "w2s")}
    got = np.asarray(jax.jit(lambda p, x, n: models.moe_layer(comm, none, p, x, n, overlap=overlap,
                                                              shared_at="after"))(bare, x, num))
    _close(got, _dense_per_rank(none, spec, bare, x, num), f"{backend}: no shared expert")
    shared = np.asarray(jax.vmap(lambda xr: models.shared_down(spec, models.shared_up(xr, params["w1s"]),
                                                                params["w2s"]))(x), np.float32)
    _close(outs["combine"] - got, shared, "the shared expert's share", rel=1e-2)   # bf16 shared expert: XLA may
    # keep its hidden layer in f32 (excess precision), so not to the bit


@pytest.mark.parametrize("wire", list(_WIRES))
@pytest.mark.parametrize("backend", BACKENDS)
def test_identity_experts(backend, wire, mesh, num_ranks):
    """experts="identity" (no routed weights): out[t] = sum_k w[t, k] * wire(x[t]) + shared(x[t]) for
    t < num_tokens, in NumPy, for each dispatch dtype variant (fp8, fp8 received as bf16, bf16); and
    dense_moe_block says the same."""
    cfg, spec, params, x, num, routing = _opt_setup(num_ranks, "identity", wire)
    assert not {"w1", "w2", "w_gate_up", "w_down"} & set(params)
    comm = a2a.init(spec, mesh, "ep", backend=backend, collect_stats=False)
    got = np.asarray(jax.jit(lambda p, x, n, r: models.moe_layer(comm, cfg, p, x, n, routing=r, overlap=True))(
        params, x, num, routing))
    t = spec.max_tokens_per_rank
    xn = np.asarray(x, np.float32)
    if wire == "bf16":
        xw = np.asarray(x.astype(jnp.bfloat16), np.float32)
    else:   # fp8 rows with one scale per 64 values, amax / 448 (NumPy)
        blocks = xn.reshape(len(xn), -1, 64)
        s = np.abs(blocks).max(-1, keepdims=True) / 448.0
        q = np.asarray(jnp.asarray(blocks / s).astype(jnp.float8_e4m3fn), np.float32)
        xw = (q * s).reshape(xn.shape)
        if wire == "fp8-recv-bf16":
            xw = np.asarray(jnp.asarray(xw).astype(jnp.bfloat16), np.float32)
    valid = (np.arange(len(xn)) % t) < np.repeat(np.asarray(num), t)
    wsum = np.where(valid, np.asarray(routing[1]).sum(-1), 0.0)
    shared = np.asarray(jax.vmap(lambda xr: models.shared_down(spec, models.shared_up(xr, params["w1s"]),
                                                                params["w2s"]))(x), np.float32)
    want = wsum[:, None] * xw + shared
    _close(got, want, f"{backend}/{wire}: identity experts vs NumPy", rel=1e-2)
    _close(_dense_per_rank(cfg, spec, params, x, num, routing), want, f"{wire}: dense identity vs NumPy", rel=1e-2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_slot_per_layer(backend, mesh, num_ranks):
    """slot=1 runs the exchange on slot 1 (the FFI calls carry slot = 1; the layer is the same as on
    slot 0) and a slot outside [0, Spec.slots) is refused; so are bad shared_at and routing shapes."""
    cfg, spec, params, x, num, _ = _opt_setup(num_ranks)
    comm = a2a.init(spec, mesh, "ep", backend=backend, collect_stats=False)
    outs, texts = [], []
    for slot in (0, 1):
        f = jax.jit(lambda p, x, n, s=slot: models.moe_layer(comm, cfg, p, x, n, overlap=True, slot=s))
        T.poison_devices(mesh)   # a slot's output left unwritten shows as NaN, not as the other slot's
        outs.append(np.asarray(f(params, x, num)))
        texts.append(f.lower(params, x, num).as_text())
    _close(outs[1], _dense_per_rank(cfg, spec, params, x, num), f"{backend}: slot 1 vs dense")
    np.testing.assert_array_equal(outs[1], outs[0])
    halves = r"custom_call @jax_moe_a2a_\w+_(?:dispatch|combine)_(?:send|recv)\(.*"
    calls = [re.findall(halves, t) for t in texts]
    local = getattr(backend_class(backend)(), "uses_local_path", lambda n: False)(num_ranks)
    if backend not in PURE_JAX and not local:
        assert len(calls[1]) == 4 and all(re.search(r"\bslot = 1 : i32", c) for c in calls[1]), calls[1]
        assert all(re.search(r"\bslot = 0 : i32", c) for c in calls[0]), calls[0]
    block = lambda **kw: jax.eval_shape(lambda p, x: models.moe_layer(comm, cfg, p, x, **kw), params, x)
    for kw, what in ((dict(slot=spec.slots), "slot"), (dict(slot=-1), "slot"), (dict(shared_at="overlap"), "overlap=True"),
                     (dict(shared_at="before"), "shared_at"),
                     (dict(routing=(jnp.zeros((x.shape[0], 3), jnp.int32), jnp.ones((x.shape[0], 3)))), "routing")):
        with pytest.raises(ValueError, match=what):
            block(**kw)


_LOCAL_KINDS = [("ragged_dot", None), ("grouped", None), ("grouped", jnp.float8_e4m3fn), ("identity", None)]


@pytest.mark.parametrize("experts,expert_dtype", _LOCAL_KINDS, ids=["ragged_dot", "grouped-bf16", "grouped-fp8",
                                                                    "identity"])
def test_local_moe_block_matches_dense(experts, expert_dtype):
    """local_moe_block (the layer without communication: the benchmarks' plain-XLA layer) = dense_moe_block
    with a bf16 wire for bf16 x, every expert kind, router or given routing (ids past E skipped),
    shared expert before or after, num_tokens < T."""
    e, t = 8, 12
    cfg = models.MoEConfig(hidden=128, ffn=64, num_experts=e, topk=3, shared_ffn=32, experts=experts,
                           expert_dtype=expert_dtype, weight_block=64)
    spec = a2a.Spec(num_experts=e, experts_per_token=3, hidden=128, max_tokens_per_rank=t,
                    dispatch_dtype=jnp.bfloat16, combine_dtype=jnp.float32)
    seed = _model_seed() + 2
    k = jax.random.split(jax.random.PRNGKey(seed), 2)
    params = models.init_moe_params(k[0], cfg)
    x = jax.random.normal(k[1], (t, 128), jnp.float32).astype(jnp.bfloat16)
    rng = np.random.default_rng(seed)
    ids = np.argsort(rng.random((t, e)), axis=1)[:, :3].astype(np.int32)
    ids[0, 0] = ids[1, 2] = e + 1    # out of range: skipped
    w = rng.uniform(0.1, 1.0, (t, 3)).astype(np.float32)
    ids_ok = np.where(ids < e, ids, 0)
    w_ok = np.where(ids < e, w, 0.0).astype(np.float32)
    f = jax.jit(lambda p, x, r, s: models.local_moe_block(cfg, spec, p, x, 9, routing=r, shared_at=s),
                static_argnums=3)
    d = jax.jit(lambda p, x, r: models.dense_moe_block(cfg, spec, p, x, 9, routing=r))
    want = np.asarray(d(params, x, (jnp.asarray(ids_ok), jnp.asarray(w_ok))))
    for s in ("combine", "after"):
        got = np.asarray(f(params, x, (jnp.asarray(ids), jnp.asarray(w)), s))
        _close(got, want, f"{experts}/{expert_dtype}: given routing, shared {s}")
        assert np.abs(got[9:] - want[9:]).max() <= 1e-5 * np.abs(want).max()   # past num_tokens: shared only
    got = np.asarray(jax.jit(lambda p, x: models.local_moe_block(cfg, spec, p, x))(params, x))
    _close(got, np.asarray(models.dense_moe_block(cfg, spec, params, x)), f"{experts}: the router")
    with pytest.raises(ValueError, match="shared_at"):
        models.local_moe_block(cfg, spec, params, x, shared_at="before")


# --- the layer benchmarks/layers.py timed before it called the library ------------------------------------
def _old_benchmark_step(comm, spec, experts, shared, num_layers, plain):
    """benchmarks/layers.py's own layer as it was before it called models.moe_block (its make_step with
    routing "fixed", as of 2e15066), kept here as the oracle of the formulation the library now runs.
    Per rank: x [T, H] bf16, ids [T, K], w [T, K], num [] int32, p (init_moe_params' dict) -> [T, H]."""
    n = comm.num_ranks
    local = spec.local_experts(n)
    silu = lambda h: h * jax.lax.logistic(h)

    def run_experts(rows, scale, group_sizes, p):
        if experts == "grouped":
            block = spec.hidden // p["w_gate_up_scale"].shape[-1]
            if scale is not None and spec.scale_block == block:
                x, xs = rows, scale
            else:
                if scale is not None:
                    rows = a2a.dequantize_fp8(rows, scale, spec.scale_block)
                x, xs = a2a.experts.quantize_rows_fp8(rows, block)
            y = a2a.expert_mlp(x, p["w_gate_up"], p["w_down"], group_sizes, x_scale=xs,
                               w_gate_up_scale=p["w_gate_up_scale"], w_down_scale=p["w_down_scale"])
            return y.astype(spec.combine_dtype)
        if scale is not None:
            rows = a2a.dequantize_fp8(rows, scale, spec.scale_block)
        if experts == "identity":
            return rows.astype(spec.combine_dtype)
        h = silu(jax.lax.ragged_dot(rows.astype(p["w1"].dtype), p["w1"], group_sizes))
        return jax.lax.ragged_dot(h.astype(p["w2"].dtype), p["w2"], group_sizes).astype(spec.combine_dtype)

    shared_up = lambda x, w1s: silu(x.astype(w1s.dtype) @ w1s)
    shared_down = lambda h, w2s: (h @ w2s).astype(spec.combine_dtype)

    def comm_layer(x, ids, w, num, p, slot):
        sent = comm.dispatch_send(x, ids, w, num, slot=slot)
        if shared == "overlap":
            sent, h = a2a.overlap(sent, shared_up, x, p["w1s"])
        got = comm.dispatch_recv(sent)
        back = comm.combine_send(run_experts(got.x, got.scale if spec.recv_is_fp8 else None, got.group_sizes, p), got)
        if shared == "overlap":
            back, out = a2a.overlap(back, shared_down, h, p["w2s"])
            return comm.combine_recv(back, out=out)
        y = comm.combine_recv(back)
        if shared == "none":
            return y
        y, x = jax.lax.optimization_barrier((y, x))
        return y + shared_down(shared_up(x, p["w1s"]), p["w2s"])

    def plain_layer(x, ids, w, num, p, slot):
        t, k = ids.shape
        valid = (jnp.arange(t) < num)[:, None] & (ids >= 0)
        key = jnp.where(valid, ids % local, local).reshape(-1)
        order = jnp.argsort(key, stable=True)
        tok = order // k
        group_sizes = jnp.bincount(key, length=local + 1)[:local].astype(jnp.int32)
        if shared == "overlap":
            out = shared_down(shared_up(x, p["w1s"]), p["w2s"]).astype(jnp.float32)
        else:
            out = jnp.zeros(x.shape, jnp.float32)
        y = run_experts(x[tok].astype(jnp.bfloat16), None, group_sizes, p)
        wf = jnp.where(valid, w, 0.0).reshape(-1)[order]
        out = out.at[tok].add(y.astype(jnp.float32) * wf[:, None])
        if shared == "after":
            out, x = jax.lax.optimization_barrier((out, x))
            out = out + shared_down(shared_up(x, p["w1s"]), p["w2s"]).astype(jnp.float32)
        return out.astype(spec.combine_dtype)

    layer = plain_layer if plain else comm_layer

    def step(x, ids, w, num, p):
        for i in range(num_layers):
            x = layer(x, ids, w, num, p, i % spec.slots)
        return x
    return step


# (experts, shared placements): the headline's grouped fp8 experts with every placement, the others once
_OLD_CASES = [("grouped", "overlap"), ("grouped", "after"), ("grouped", "none"), ("identity", "none"),
              ("ragged_dot", "after")]


@pytest.mark.parametrize("experts,shared", _OLD_CASES, ids=[f"{e}-{s}" for e, s in _OLD_CASES])
@pytest.mark.parametrize("backend", BACKENDS)
def test_moe_block_is_the_old_benchmark_layer(backend, experts, shared, mesh, num_ranks):
    """Two layers of moe_block(overlap=True, routing=(ids, w), shared_at=..., slot=layer) with fp8 dispatch
    and bf16 combine (the benchmark's options; --shared none = shared_ffn 0) = the old benchmark formulation
    above; and local_moe_block with ids mod L on the local experts = the old plain-XLA layer."""
    n = num_ranks
    cfg, _, params, x, num, (ids, w) = _opt_setup(n, experts, "fp8", shared_ffn=0 if shared == "none" else 64)
    spec = a2a.Spec(num_experts=cfg.num_experts, experts_per_token=cfg.topk, hidden=cfg.hidden, max_tokens_per_rank=8,
                    dispatch_dtype=jnp.float8_e4m3fn, scale_block=64, combine_dtype=jnp.bfloat16)
    w = w / w.sum(-1, keepdims=True)
    x = x.astype(jnp.bfloat16)
    comm = a2a.init(spec, mesh, "ep", backend=backend, collect_stats=False)
    place = {"overlap": "overlap", "after": "after", "none": None}[shared]
    local = spec.local_experts(n)
    plain_cfg = dataclasses.replace(cfg, num_experts=local)

    def new(x, ids, w, num, p, plain):
        for i in range(2):
            if plain:
                x = models.local_moe_block(plain_cfg, spec, p, x, num, routing=(ids % local, w), shared_at=place)
            else:
                x = models.moe_block(comm, cfg, p, x, num, overlap=True, routing=(ids, w), shared_at=place, slot=i)
        return x

    def run(plain, old):
        """[T, H] per rank -> [1, T, H]: two layers of one formulation (one jit each: the FFI backends
        run one program's exchanges in their trace order only)."""
        def fn(x, ids, w, num, p):
            if old:
                return _old_benchmark_step(comm, spec, experts, shared, 2, plain)(x, ids, w, num[0], p)[None]
            return new(x, ids, w, num[0], p, plain)[None]
        f = jax.jit(T.shard_map(fn, mesh=mesh, in_specs=(P("ep"),) * 4 + (specs,), out_specs=P("ep")))
        return np.asarray(f(x, ids, w, num, params), np.float32)

    specs = models.moe_param_specs(cfg)
    old, new_, old_plain, new_plain = (run(plain, o) for plain in (False, True) for o in (True, False))
    _close(new_, old, f"{backend}: moe_block vs the old benchmark layer", rel=1e-2)
    _close(new_plain, old_plain, "local_moe_block vs the old plain-XLA layer", rel=1e-2)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_rms_norm_matches_numpy(dtype):
    """models.rms_norm against NumPy on fresh random rows (a zero row included: eps keeps it 0), in
    x's dtype."""
    seed = T.fresh_seed()
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((5, 3, 48)).astype(np.float32) * rng.uniform(0.01, 100, (5, 3, 1)).astype(np.float32)
    x[0, 0] = 0
    got = models.rms_norm(jnp.asarray(x, dtype))
    assert got.dtype == dtype and got.shape == x.shape
    xin = np.asarray(jnp.asarray(x, dtype), np.float32)
    want = xin / np.sqrt(np.mean(xin * xin, axis=-1, keepdims=True) + 1e-6)
    tol = 1e-5 if dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=tol, atol=tol, err_msg=f"seed {seed}")
    assert not np.asarray(got[0, 0], np.float32).any()


def test_toy_model_deep_stack_stays_bounded(mesh, num_ranks):
    """toy_model's layers read their input through rms_norm: 24 layers (one parameter set repeated)
    keep the stream finite and growing at most linearly; without the norm the SwiGLU experts,
    quadratic in their input, overflow it."""
    cfg, spec, params, x = _small_model(num_ranks, "sigmoid")
    comm = a2a.init(spec, mesh, "ep", backend="reference", collect_stats=False)
    specs = [models.moe_param_specs(cfg)] * 24
    f = jax.jit(T.shard_map(lambda x, layers: models.toy_model(comm, cfg, layers, x), mesh=mesh,
                            in_specs=(P("ep"), specs), out_specs=P("ep"), check_vma=False))
    out = np.asarray(f(x, [params[0]] * 24), np.float32)
    x0 = np.abs(np.asarray(x, np.float32)).max()
    assert np.isfinite(out).all() and np.abs(out).max() < x0 + 24 * 10, (np.abs(out).max(), x0, _model_seed())
