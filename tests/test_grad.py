"""Differentiability: gradients of combine(expert(dispatch(x))) w.r.t. x and the router weights
match the closed form computed from the oracle's routing."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import multihost_utils
from jax.sharding import PartitionSpec as P

import jax_moe_a2a as a2a
from jax_moe_a2a import oracle
from jax_moe_a2a import testing as T

pytestmark = pytest.mark.mpi


from conftest import BACKENDS, PURE_JAX, xla_collectives_refused  # noqa: E402  (JAX_MOE_A2A_TEST_BACKENDS or every available one)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["ragged", "expert_major"])
@pytest.mark.parametrize("tp", [1, 2])
def test_grad_matches_closed_form(backend, layout, tp, num_ranks, mesh):
    if num_ranks % tp:
        pytest.skip("tp does not divide ranks")
    spec = a2a.Spec(num_experts=16, experts_per_token=3, hidden=64, max_tokens_per_rank=12,
                    dispatch_dtype=jnp.float32, combine_dtype=jnp.float32, layout=layout, tp_size=tp,
                    recv_capacity=None if layout == "ragged" else 5)
    n = num_ranks
    comm = a2a.init(spec, mesh, "ep", backend=backend, collect_stats=False)
    seed = T.fresh_seed()
    inputs = T.make_inputs(spec, n, seed, minus_one_frac=0.1, invalid_frac=0.05)
    rng = np.random.default_rng(seed + 1)
    g = [rng.standard_normal((spec.max_tokens_per_rank, spec.hidden)).astype(np.float32) for _ in range(n // tp)]
    g = [g[r // tp] for r in range(n)]

    def per_rank(x, ids, w, nt, gg):
        def loss(x, w):
            got = comm.dispatch(x, ids, w, nt)
            y = T.expert_fn_jax(spec, n, got, jnp.float32)
            return jnp.sum(comm.combine(y, got) * gg)
        dx, dw = jax.grad(loss, argnums=(0, 1))(x, w)
        return dx[None], dw[None]

    args = T.global_args(mesh, inputs)
    args.append(T.stack_global(mesh, "ep", g))
    f = jax.jit(T.shard_map(per_rank, mesh=mesh, in_specs=(P("ep"),) * 5, out_specs=P("ep")))
    if tp > 1 and backend not in PURE_JAX:
        with pytest.raises(NotImplementedError, match="tp_size > 1"):
            f(*args)
        return
    dx, dw = f(*args)
    dx, dw = T.local_ranks_of(dx), T.local_ranks_of(dw)

    # Closed form. Each token's loss term is counted on every tp member (each member holds the
    # full combined output), and the pair is sent by member t % tp, so gradients land on that member.
    got = oracle.dispatch(spec, inputs)
    l_count = spec.local_experts(n)
    kept = {(s, t, e * l_count + l) for e in range(n) for l, rows in enumerate(got[e].rows) for s, t in rows}
    for r in dx:
        inp = inputs[r]
        routed, _ = oracle.routed_pairs(spec, inp)
        want_dx = np.zeros_like(inp.x)
        want_dw = np.zeros_like(inp.topk_weights)
        g0 = r // tp * tp
        for t in range(inp.num_tokens):
            if t % tp != r % tp:
                continue
            for k in range(spec.experts_per_token):
                ex = int(inp.topk_ids[t, k])
                if routed[t, k] and (r, t, ex) in kept:
                    fac = np.float32(1 + (ex % l_count) / 4)
                    gsum = sum(g[m][t] for m in range(g0, g0 + tp))
                    want_dx[t] += inp.topk_weights[t, k] * fac * gsum
            for k in range(spec.experts_per_token):
                ex = int(inp.topk_ids[t, k])
                if routed[t, k] and (r, t, ex) in kept:
                    want_dw[t, k] = np.float32(1 + (ex % l_count) / 4) * np.dot(g[r][t], inp.x[t])
        np.testing.assert_allclose(dx[r], want_dx, rtol=1e-5, atol=1e-5, err_msg=f"seed {seed} rank {r} dx")
        if tp == 1:  # with tp > 1 the weight gradient also collects the other members' loss terms
            np.testing.assert_allclose(dw[r], want_dw, rtol=1e-5, atol=1e-4, err_msg=f"seed {seed} rank {r} dw")


@pytest.mark.parametrize("backend", BACKENDS)
def test_stats_count_the_forward_dispatches_on_every_backend(backend, num_ranks, mesh):
    """Issue 33.9: 5 training steps counted 160 dispatches on host and 80 on reference (the host
    backend's backward dispatch, run by the combine's custom_vjp rule, was counted too). stats()
    counts the dispatches the program calls, once each, and the drops of those: a backward pass's
    exchanges are not counted (docs/api.md, "Counters")."""
    spec = a2a.Spec(num_experts=16, experts_per_token=3, hidden=32, max_tokens_per_rank=8,
                    dispatch_dtype=jnp.float32, combine_dtype=jnp.float32)
    n = num_ranks
    comm = a2a.init(spec, mesh, "ep", backend=backend, collect_stats=True)
    seed = T.fresh_seed()
    inputs = T.make_inputs(spec, n, seed, num_tokens=spec.max_tokens_per_rank, minus_one_frac=0.1, invalid_frac=0.1)
    for i in inputs:  # a bad id on every rank (each process checks its own ranks' counts)
        i.topk_ids[0, 0] = spec.num_experts + 3

    def per_rank(x, ids, w, nt):
        def loss(x, w):
            got = comm.dispatch(x, ids, w, nt)
            y = T.expert_fn_jax(spec, n, got, jnp.float32)
            return jnp.sum(comm.combine(y, got) ** 2)
        dx, dw = jax.grad(loss, argnums=(0, 1))(x, w)
        return dx[None]

    args = T.global_args(mesh, inputs)
    f = jax.jit(T.shard_map(per_rank, mesh=mesh, in_specs=(P("ep"),) * 4, out_specs=P("ep")))
    steps = 5
    for _ in range(steps):
        dx = jax.block_until_ready(f(*args))
    jax.effects_barrier()
    local = sorted(T.local_ranks_of(dx))
    st = comm.stats()
    assert st["dispatches"] == steps * len(local), st
    dropped = sum(int(oracle.routed_pairs(spec, inputs[r])[1].sum()) for r in local)
    assert dropped > 0 and st["dropped"] == steps * dropped, (seed, st)


def _split_step(comm, spec, n, with_out):
    """Per rank: gradients of a loss through the four split halves (an expert matrix W between
    them, a shared output `out`) w.r.t. x, the router weights and W."""
    def per_rank(x, ids, w, nt, W):
        def loss(x, w, W):
            sent = comm.dispatch_send(x, ids, w, nt)
            got = comm.dispatch_recv(sent)
            xin = jnp.where((got.src[..., 0] >= 0)[..., None], got.x.astype(jnp.float32), 0.0)  # rows past the
            y = (xin @ W).astype(got.x.dtype)                                                # counts: unspecified
            back = comm.combine_send(y, got)
            out = comm.combine_recv(back, out=jnp.tanh(x) if with_out else None)
            return jnp.sum(out.astype(jnp.float32) ** 2)
        dx, dw, dW = jax.grad(loss, argnums=(0, 1, 2))(x, w, W)
        return dx[None], dw[None], dW[None]
    return jax.jit(T.shard_map(per_rank, mesh=comm.mesh, in_specs=(P("ep"),) * 4 + (P(),),
                               out_specs=P("ep")))


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "reference"])  # each against reference
@pytest.mark.parametrize("layout,with_out", [("ragged", True), ("expert_major", False)])
def test_split_halves_are_differentiable_like_reference(backend, layout, with_out, num_ranks, mesh):
    """Issue 33.4: gradients through dispatch_send/dispatch_recv/combine_send/combine_recv (what
    the README teaches) raised 'Differentiation rule for jax_moe_a2a_comm_call not implemented' on
    the host backend while the reference backend differentiated the same code. Every backend now
    gives the reference backend's gradients (w.r.t. x, the router weights and an expert matrix)."""
    if xla_collectives_refused():
        pytest.skip("the reference backend's XLA collectives refuse several processes on one GPU")
    spec = a2a.Spec(num_experts=16, experts_per_token=3, hidden=32, max_tokens_per_rank=8,
                    dispatch_dtype=jnp.float32, combine_dtype=jnp.float32, layout=layout,
                    recv_capacity=None if layout == "ragged" else 6)
    n = num_ranks
    seed = T.fresh_seed()
    inputs = T.make_inputs(spec, n, seed, minus_one_frac=0.1, invalid_frac=0.05)
    # Rank 0 sends at least its first token's first pair, which every layout keeps (the first
    # arrival at its expert): the gradients below are not all zero for any draw (num_tokens is
    # 0 for 1 rank in 9, and under mpirun -n 4 the one rank of a process is all it sees).
    inputs[0] = T.with_a_routed_pair(spec, inputs[0])
    args = T.global_args(mesh, inputs)
    args.append(jnp.asarray(np.random.default_rng(seed + 1).standard_normal((spec.hidden, spec.hidden)) / 6,
                            jnp.float32))
    want = None
    for b in ("reference", backend):
        comm = a2a.init(spec, mesh, "ep", backend=b, collect_stats=False)
        got = [T.local_ranks_of(a) for a in _split_step(comm, spec, n, with_out)(*args)]
        if want is None:
            want = got
            continue
        for name, g, w in zip(("dx", "dw", "dW"), got, want):
            for r in w:
                np.testing.assert_allclose(g[r], w[r], rtol=2e-5, atol=2e-5, err_msg=f"seed {seed} {b} rank {r} {name}")
    # the gradients are not all zero (over every process's ranks: rank 0's at least, by its inputs)
    local = max(float(np.abs(v).max(initial=0.0)) for v in want[0].values())
    assert multihost_utils.process_allgather(np.float32(local)).max() > 0, seed


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("split", [False, True])
def test_fp8_dispatch_has_no_gradient_on_any_backend(backend, split, num_ranks, mesh):
    """Issue 33.4: one rule for fp8: the reference backend returned a gradient through an fp8
    dispatch silently while the host backend refused. Every backend raises the same ValueError
    when JAX transposes (at trace time), one-shot or split, through dispatch or combine."""
    spec = a2a.Spec(num_experts=16, experts_per_token=2, hidden=128, max_tokens_per_rank=8,
                    dispatch_dtype=jnp.float8_e4m3fn, recv_dtype=jnp.bfloat16)
    comm = a2a.init(spec, mesh, "ep", backend=backend, collect_stats=False)
    inputs = T.make_inputs(spec, num_ranks, 2, input_dtype=jnp.bfloat16)  # any draw: only tracing is checked
    args = T.global_args(mesh, inputs, ("x", "topk_ids", "topk_weights"))

    def per_rank(x, ids, w, which):
        def loss(x):
            if split:
                got = comm.dispatch_recv(comm.dispatch_send(x, ids, w))
            else:
                got = comm.dispatch(x, ids, w)
            if which == "dispatch":  # through dispatch alone
                return jnp.sum(got.x.astype(jnp.float32))
            y = jax.lax.stop_gradient(got.x) * x[:1, :1].astype(got.x.dtype)  # through combine alone
            out = comm.combine_recv(comm.combine_send(y, got)) if split else comm.combine(y, got)
            return jnp.sum(out.astype(jnp.float32))
        return jax.grad(loss)(x)

    for which in ("dispatch", "combine"):
        f = jax.jit(T.shard_map(lambda x, i, w: per_rank(x, i, w, which), mesh=mesh, in_specs=(P("ep"),) * 3,
                                out_specs=P("ep")))
        with pytest.raises(ValueError, match=f"{which} has no gradient with an fp8 Spec.dispatch_dtype"):
            f.lower(*args)
