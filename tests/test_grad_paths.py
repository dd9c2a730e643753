"""Gradients along the paths the basic gradient tests (test_grad.py) do not take: debug=True,
a combine on another slot than its dispatch over two layers, got.weights in the loss, an `out`
of another dtype than Spec.combine_dtype, a combine that is not differentiated, after= under
jax.grad, stats() under jax.checkpoint. Every backend against the reference backend or plain JAX
(review of 2026-12-04, /work/team/review_python.md findings 1-8)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_moe_a2a as a2a
from jax_moe_a2a import oracle, testing as T

from conftest import BACKENDS, xla_collectives_refused  # noqa: E402

pytestmark = pytest.mark.mpi

# Every backend, and the host backend's proxied mode as one more.
VARIANTS = list(BACKENDS) + (["host-proxied"] if "host" in BACKENDS else [])
# The variants compared with the reference backend (reference against itself could not fail).
COMPARED = [v for v in VARIANTS if v != "reference"]


def _init(spec, mesh, variant, **kw):
    """A communicator of `variant` ("host-proxied": the host backend with proxied=True)."""
    # 20 s: a deadlock still fails the test (DEADLINE_EXCEEDED), and a peer's first step, which
    # waits for the others to compile theirs too (seconds apart under mpirun -n 4 on a loaded
    # 2-core machine), has room (10 s left less of it)
    kw.setdefault("timeout_s", 20)
    if variant == "host-proxied":
        return a2a.init(spec, mesh, "ep", backend="host", proxied=True, **kw)
    return a2a.init(spec, mesh, "ep", backend=variant, **kw)


def _spec(**kw):
    base = dict(num_experts=2 * jax.device_count(), experts_per_token=2, hidden=16, max_tokens_per_rank=8,
                dispatch_dtype=jnp.float32, combine_dtype=jnp.float32)
    base.update(kw)
    return a2a.Spec(**base)


def _args(spec, mesh, seed, fields=("x", "topk_ids", "topk_weights"), **kw):
    inputs = T.make_inputs(spec, jax.device_count(), seed, **kw)
    return T.global_args(mesh, inputs, fields)


def _close(got, want, what, rtol=2e-5, atol=2e-5):
    for name, g, w in zip(("dx", "dw", "d3", "d4"), got, want):
        g, w = T.local_ranks_of(g), T.local_ranks_of(w)
        for r in w:
            np.testing.assert_allclose(np.asarray(g[r], np.float32), np.asarray(w[r], np.float32), rtol=rtol,
                                       atol=atol, equal_nan=False, err_msg=f"{what} rank {r} {name}")


def _run(mesh, f, *args):
    """f(*args), finished, after device memory was filled with NaN (stale buffers show)."""
    T.poison_devices(mesh)
    return jax.block_until_ready(f(*args))


def _nonzero(arr):
    return any(np.abs(np.asarray(v, np.float32)).max() > 0 for v in T.local_ranks_of(arr).values())


def _skip_if_no_reference():
    if xla_collectives_refused():
        pytest.skip("the reference backend's XLA collectives refuse several processes on one GPU")


# ---- finding 1: debug=True kept the gradients -----------------------------------------------
@pytest.mark.parametrize("variant", VARIANTS)
def test_debug_true_keeps_the_gradients(variant, mesh):
    """debug=True's check made the dispatch's results data-dependent on it through a bit round
    trip that had no derivative: the reference and ragged backends returned zero gradients w.r.t.
    x and the router weights (silently). debug=True gives debug=False's gradients."""
    spec = _spec()
    seed = T.fresh_seed()
    args = _args(spec, mesh, seed, num_tokens=spec.max_tokens_per_rank)
    res = []
    for debug in (False, True):
        comm = _init(spec, mesh, variant, debug=debug)

        def per_rank(x, ids, w):
            def loss(x, w):
                got = comm.dispatch(x, ids, w)
                y = jnp.where((got.src[..., 0] >= 0)[..., None], got.x * 2, 0.0)
                return jnp.sum(comm.combine(y, got) ** 2)
            return tuple(g[None] for g in jax.grad(loss, argnums=(0, 1))(x, w))

        f = jax.jit(T.shard_map(per_rank, mesh=mesh, in_specs=(P("ep"),) * 3, out_specs=P("ep")))
        res.append(_run(mesh, f, *args))
        comm.close()
    assert _nonzero(res[0][0]) and _nonzero(res[0][1])
    _close(res[1], res[0], f"seed {seed} {variant} debug=True vs False")


# ---- finding 2: a combine on another slot than its dispatch, over two layers -------------------
def _two_layers(comm, W, d, c):
    def layer(x, ids, w):
        got = comm.dispatch_recv(comm.dispatch_send(x, ids, w, slot=d))
        xin = jnp.where((got.src[..., 0] >= 0)[..., None], got.x, 0.0)
        return comm.combine_recv(comm.combine_send(jnp.tanh(xin @ W), got, slot=c))

    def per_rank(x, i1, w1, i2, w2, W):
        def loss(x, w1, w2):
            return jnp.sum(layer(layer(x, i1, w1), i2, w2) ** 2)
        return tuple(g[None] for g in jax.grad(loss, argnums=(0, 1, 2))(x, w1, w2))
    return jax.jit(T.shard_map(per_rank, mesh=comm.mesh, in_specs=(P("ep"),) * 5 + (P(),), out_specs=P("ep")))


@pytest.mark.parametrize("variant", COMPARED)
@pytest.mark.parametrize("d,c", [(0, 1), (1, 0), (0, 0)])
def test_two_layers_combining_on_another_slot_match_reference(variant, d, c, mesh):
    """Two layers each dispatching on slot d and combining on slot c: the host backend's backward
    combine (of layer 1's dispatch) took its offsets from the last dispatch on slot d, which was
    layer 2's, when the combine's rule re-dispatched on slot c: wrong dx (by more than dx itself).
    The backward's exchanges now run on the dispatch's slot, as the forward's routing state."""
    _skip_if_no_reference()
    spec = _spec(slots=2)
    seed = T.fresh_seed()
    a1 = _args(spec, mesh, seed)
    a2 = _args(spec, mesh, seed + 1, fields=("topk_ids", "topk_weights"))
    W = jnp.asarray(np.random.default_rng(seed + 2).standard_normal((spec.hidden, spec.hidden)) / 4, jnp.float32)
    res = []
    for v in ("reference", variant):
        comm = _init(spec, mesh, v, collect_stats=False)
        res.append(_run(mesh, _two_layers(comm, W, d, c), *a1, *a2, W))
        comm.close()
    assert _nonzero(res[0][0])
    _close(res[1], res[0], f"seed {seed} {variant} d={d} c={c}")


# ---- findings 6, 7: got.weights carries no gradient; out's gradient has out's dtype ---------------
@pytest.mark.parametrize("variant", COMPARED)
def test_got_weights_carry_no_gradient_on_any_backend(variant, mesh):
    """docs/api.md: got.weights carries no gradient. The reference backend differentiated them
    (JAX autodiff through its all_to_all) while the FFI rules dropped them: the router weights'
    gradient differed by backend when the loss used got.weights. Every backend now gives the
    gradient of the same loss with stop_gradient(got.weights)."""
    _skip_if_no_reference()
    spec = _spec()
    seed = T.fresh_seed()
    args = _args(spec, mesh, seed, num_tokens=spec.max_tokens_per_rank)
    W = jnp.asarray(np.random.default_rng(seed + 2).standard_normal((spec.hidden, spec.hidden)) / 4, jnp.float32)

    def step(comm, stop):
        def per_rank(x, ids, w, W):
            def loss(x, w):
                got = comm.dispatch_recv(comm.dispatch_send(x, ids, w))
                xin = jnp.where((got.src[..., 0] >= 0)[..., None], got.x, 0.0)
                gw = jax.lax.stop_gradient(got.weights) if stop else got.weights
                y = jnp.tanh(xin @ W) * gw[..., None]
                return jnp.sum(comm.combine_recv(comm.combine_send(y, got), out=x) ** 2)
            return tuple(g[None] for g in jax.grad(loss, argnums=(0, 1))(x, w))
        return jax.jit(T.shard_map(per_rank, mesh=mesh, in_specs=(P("ep"),) * 3 + (P(),), out_specs=P("ep")))

    comm = _init(spec, mesh, "reference", collect_stats=False)
    want = _run(mesh, step(comm, True), *args, W)
    comm.close()
    comm = _init(spec, mesh, variant, collect_stats=False)
    got = _run(mesh, step(comm, False), *args, W)
    comm.close()
    assert _nonzero(want[1])
    _close(got, want, f"seed {seed} {variant} got.weights in the loss")


@pytest.mark.parametrize("variant", COMPARED)
def test_gradient_of_out_has_outs_dtype(variant, mesh):
    """The gradient w.r.t. combine_recv's `out` had Spec.combine_dtype (bf16) on the FFI backends
    for an f32 `out`; JAX (and the reference backend) give a cotangent of the primal's dtype."""
    _skip_if_no_reference()
    spec = _spec(combine_dtype=jnp.bfloat16, dispatch_dtype=jnp.bfloat16)
    seed = T.fresh_seed()
    args = _args(spec, mesh, seed, num_tokens=6)
    o = T.stack_global(mesh, "ep", [np.random.default_rng(seed + 3 + r).standard_normal((8, 16)).astype(np.float32)
                                    for r in range(jax.device_count())])
    res = []
    for v in ("reference", variant):
        comm = _init(spec, mesh, v, collect_stats=False)

        def per_rank(x, ids, w, o):
            def loss(o):
                got = comm.dispatch(x, ids, w)
                y = jnp.where((got.src[..., 0] >= 0)[..., None], got.x, 0)
                return jnp.sum(comm.combine(y, got, out=o).astype(jnp.float32) ** 2)
            return jax.grad(loss)(o)[None]
        res.append(_run(mesh, jax.jit(T.shard_map(per_rank, mesh=mesh, in_specs=(P("ep"),) * 4, out_specs=P("ep"))),
                        *args, o))
        comm.close()
    assert res[0].dtype == jnp.float32 and res[1].dtype == jnp.float32, (res[0].dtype, res[1].dtype)
    _close([res[1]], [res[0]], f"seed {seed} {variant} d out", rtol=1e-2, atol=1e-2)


# ---- finding 5: after= under jax.grad, and a pytree as after= ----------------------------------------
@pytest.mark.parametrize("variant", COMPARED)
def test_after_on_the_differentiated_path_and_as_a_pytree(variant, mesh):
    """after= given a value on the differentiated path (jnp.tanh(x)) made jax.grad raise on the
    FFI backends (its tangent reached the FFI call), and a pytree raised an obscure TypeError
    there. after= carries no gradient and takes any pytree of arrays: the gradients are those of
    the same step without after=, the forward output the same too."""
    _skip_if_no_reference()
    spec = _spec()
    seed = T.fresh_seed()
    args = _args(spec, mesh, seed, num_tokens=spec.max_tokens_per_rank)
    res = []
    for v, use_after in (("reference", False), (variant, True)):
        comm = _init(spec, mesh, v, collect_stats=False)

        def per_rank(x, ids, w):
            def loss(x):
                h = jnp.tanh(x)
                a1 = h if use_after else None
                got = comm.dispatch_recv(comm.dispatch_send(x, ids, w, after=a1))
                y = jnp.where((got.src[..., 0] >= 0)[..., None], got.x * 2, 0.0)
                a2 = {"h": h, "pair": (got.x, ids), "none": None} if use_after else None
                out = comm.combine_recv(comm.combine_send(y, got, after=a2))
                return jnp.sum(out ** 2), out
            g, out = jax.grad(loss, has_aux=True)(x)
            return g[None], out[None]
        f = jax.jit(T.shard_map(per_rank, mesh=mesh, in_specs=(P("ep"),) * 3, out_specs=P("ep")))
        res.append(_run(mesh, f, *args))
        comm.close()
    assert _nonzero(res[0][0])
    _close(res[1], res[0], f"seed {seed} {variant} after=")


# ---- finding 3: the backward of a dispatch whose combine is not differentiated ----------------------
@pytest.mark.parametrize("variant", COMPARED)
def test_dispatch_gradient_when_the_combine_is_not_differentiated(variant, mesh):
    """The loss reaches got.x without its combine (the combine's output is an aux output, its input
    stop_gradient'ed): nothing in the data ordered the dispatch's backward combine on the slot after
    the forward's combine there, and the host backend's backward combine_send waited for the slot
    to be freed by a combine that XLA had scheduled after it (DEADLINE_EXCEEDED after timeout_s).
    The backward exchanges now follow the forward's combine of their cycle."""
    _skip_if_no_reference()
    spec = _spec()
    seed = T.fresh_seed()
    args = _args(spec, mesh, seed, num_tokens=spec.max_tokens_per_rank)
    res = []
    for v in ("reference", variant):
        comm = _init(spec, mesh, v, collect_stats=False)

        def per_rank(x, ids, w):
            def loss(x):
                got = comm.dispatch(x, ids, w)
                valid = got.src[..., :1] >= 0
                out = comm.combine(jax.lax.stop_gradient(jnp.where(valid, got.x, 0.0)), got)
                return jnp.sum(jnp.where(valid, got.x, 0.0) ** 2), out
            g, out = jax.grad(loss, has_aux=True)(x)
            return g[None], out[None]
        f = jax.jit(T.shard_map(per_rank, mesh=mesh, in_specs=(P("ep"),) * 3, out_specs=P("ep")))
        for _ in range(3):  # the schedule is XLA's: run it a few times
            r = _run(mesh, f, *args)
        res.append(r)
        comm.close()
    assert _nonzero(res[0][0])
    _close(res[1], res[0], f"seed {seed} {variant} undifferentiated combine")


# ---- finding 8: stats() under jax.checkpoint ---------------------------------------------------------
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("debug", [False, True])
def test_stats_count_each_dispatch_once_under_checkpoint(variant, debug, mesh):
    """The counting callback (jax.debug.callback) was rematerialised with the layer's local work
    under jax.checkpoint: a training step of one checkpointed layer counted 2 dispatches per rank
    (and 2x the drops) on every backend. It now runs once, in the forward pass."""
    spec = _spec()
    seed = T.fresh_seed()
    n = jax.device_count()
    inputs = T.make_inputs(spec, n, seed, num_tokens=spec.max_tokens_per_rank,
                          invalid_frac=0.0 if debug else 0.1)  # debug=True raises on invalid ids
    if not debug:  # every rank drops at least one pair (with 16 ids, 0.9**16 = 19% of ranks drew none)
        for inp in inputs:
            inp.topk_ids[0, -1] = spec.num_experts
    args = T.global_args(mesh, inputs, ("x", "topk_ids", "topk_weights"))
    comm = _init(spec, mesh, variant, collect_stats=True, debug=debug)

    def per_rank(x, ids, w):
        @jax.checkpoint
        def layer(x, w):
            got = comm.dispatch(x, ids, w)
            y = jnp.where((got.src[..., 0] >= 0)[..., None], jnp.tanh(got.x), 0.0)
            return comm.combine(y, got)
        return jax.grad(lambda x, w: jnp.sum(layer(x, w) ** 2))(x, w)[None]

    f = jax.jit(T.shard_map(per_rank, mesh=mesh, in_specs=(P("ep"),) * 3, out_specs=P("ep")))
    steps = 2
    for _ in range(steps):
        dx = _run(mesh, f, *args)
    jax.effects_barrier()
    st = comm.stats()
    comm.close()
    assert _nonzero(dx)
    local = sorted(T.local_ranks_of(dx))
    assert st["dispatches"] == steps * len(local), st
    dropped = sum(int(oracle.routed_pairs(spec, inputs[r])[1].sum()) for r in local)
    assert (dropped == 0 if debug else dropped > 0) and st["dropped"] == steps * dropped, (seed, st)


@pytest.mark.parametrize("variant", COMPARED)
def test_dispatch_gradient_of_an_undifferentiated_combine_before_a_later_layer_on_the_slot(variant, mesh):
    """Layer 1's combine is not differentiated (its output an aux output; the loss reaches
    got.x directly), and layer 2 dispatches on the same slot after it. Layer 1's backward
    combine then ran beside layer 2's backward exchanges on the slot (a deadlock, or the host
    backend taking layer 2's combine offsets: dx off by more than half its size). The backward
    exchanges on a slot now run one after another, and a backward combine whose route the slot
    no longer holds dispatches it again first."""
    _skip_if_no_reference()
    spec = _spec()
    seed = T.fresh_seed()
    a1 = _args(spec, mesh, seed)
    a2 = _args(spec, mesh, seed + 1, fields=("topk_ids", "topk_weights"))
    res = []
    for v in ("reference", variant):
        comm = _init(spec, mesh, v, collect_stats=False)

        def per_rank(x, ids, w, ids2, w2):
            def loss(x):
                got = comm.dispatch(x, ids, w)
                valid = got.src[..., :1] >= 0
                out = comm.combine(jax.lax.stop_gradient(jnp.where(valid, got.x, 0.0)), got)
                got2 = comm.dispatch_recv(comm.dispatch_send(x * 2, ids2, w2, after=out))
                out2 = comm.combine(jnp.where(got2.src[..., :1] >= 0, jnp.tanh(got2.x), 0.0), got2)
                return jnp.sum(jnp.where(valid, got.x, 0.0) ** 2) + jnp.sum(out2 ** 2), out
            g, out = jax.grad(loss, has_aux=True)(x)
            return g[None], out[None]
        f = jax.jit(T.shard_map(per_rank, mesh=mesh, in_specs=(P("ep"),) * 5, out_specs=P("ep")))
        for _ in range(2):
            r = _run(mesh, f, *a1, *a2)
        res.append(r)
        comm.close()
    assert _nonzero(res[0][0])
    _close(res[1], res[0], f"seed {seed} {variant} undifferentiated combine, then a layer on the slot")
