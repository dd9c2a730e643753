"""Two dispatches in flight on one slot inside one trace are refused at trace time (ValueError
naming the slot), on every backend; sequential uses of a slot, two slots, grads and remat pass."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import jax_moe_a2a as a2a
from jax_moe_a2a.testing import shard_map

BACKENDS = [b for b in ("reference", "host") if b in a2a.available_backends()]
T_, H, K = 4, 32, 2


def _trace(comm, fn):
    n = comm.num_ranks
    f = jax.jit(shard_map(fn, mesh=comm.mesh, in_specs=(P("ep"),) * 3, out_specs=P("ep")))
    args = (jax.ShapeDtypeStruct((n * T_, H), jnp.bfloat16), jax.ShapeDtypeStruct((n * T_, K), jnp.int32),
            jax.ShapeDtypeStruct((n * T_, K), jnp.float32))
    return f.lower(*args)  # traces (and lowers) without running


@pytest.fixture(params=BACKENDS)
def comm(request, mesh):
    spec = a2a.Spec(num_experts=2 * mesh.size, experts_per_token=K, hidden=H, max_tokens_per_rank=T_)
    return a2a.init(spec, mesh, "ep", backend=request.param)


def _experts(got):
    return got.x.astype(jnp.bfloat16)


def test_two_sends_on_one_slot(comm):
    def fn(x, i, w):
        a = comm.dispatch_send(x, i, w, slot=0)
        b = comm.dispatch_send(x, i, w, slot=0)
        return comm.combine_recv(comm.combine_send(_experts(comm.dispatch_recv(a)), comm.dispatch_recv(a)))
    with pytest.raises(ValueError, match=r"slot 0: a dispatch on slot 0 is still in flight.*free: \[1\]"):
        _trace(comm, fn)


def test_send_after_recv_before_combine(comm):
    def fn(x, i, w):
        got = comm.dispatch(x, i, w, slot=1)
        comm.dispatch(x, i, w, slot=1)
        return comm.combine(_experts(got), got)
    with pytest.raises(ValueError, match="slot 1: a dispatch on slot 1 is still in flight"):
        _trace(comm, fn)


def test_sequential_layers_and_two_slots_pass(comm):
    def fn(x, i, w):
        for _ in range(3):  # layers one after another on slot 0
            got = comm.dispatch(x, i, w)
            x = comm.combine(_experts(got), got).astype(x.dtype)
        ha = comm.dispatch_send(x, i, w, slot=0)   # two micro-batches, two slots
        hb = comm.dispatch_send(x, i, w, slot=1)
        ga, gb = comm.dispatch_recv(ha), comm.dispatch_recv(hb)
        ca, cb = comm.combine_send(_experts(ga), ga), comm.combine_send(_experts(gb), gb)
        return comm.combine_recv(ca) + comm.combine_recv(cb)
    _trace(comm, fn)
    _trace(comm, fn)  # a second trace of the same function by the same communicator


def test_failed_trace_does_not_poison_the_next(comm):
    def bad(x, i, w):
        comm.dispatch_send(x, i, w)
        comm.dispatch_send(x, i, w)
        return x

    def good(x, i, w):
        got = comm.dispatch(x, i, w)
        return comm.combine(_experts(got), got)
    with pytest.raises(ValueError, match="slot 0"):
        _trace(comm, bad)
    _trace(comm, good)


def test_grad_and_remat_pass(comm):
    def layer(x, i, w):
        got = comm.dispatch(x, i, w)
        return comm.combine(_experts(got) * 2, got)

    def fn(x, i, w):
        def loss(x, w):
            y = jax.checkpoint(layer)(x, i, w)
            y = layer(y.astype(x.dtype), i, w)
            return jnp.sum(y.astype(jnp.float32))
        gx, gw = jax.grad(loss, argnums=(0, 1))(x, w)
        return gx.astype(jnp.float32) + jnp.sum(gw)
    _trace(comm, fn)


def test_combine_onto_a_busy_slot_is_refused(comm):
    """Review finding 4: combine_send(slot=c) onto a slot where another dispatch is in flight was
    accepted (the host backend then waited for the slot until timeout_s) and freed that slot in
    the tracker. It is refused at trace time, naming the free slots."""
    def fn(x, i, w):
        ga = comm.dispatch_recv(comm.dispatch_send(x, i, w, slot=0))
        gb = comm.dispatch_recv(comm.dispatch_send(x, i, w, slot=1))
        oa = comm.combine_recv(comm.combine_send(_experts(ga), ga, slot=1))  # B's slot
        return oa + comm.combine(_experts(gb), gb)
    with pytest.raises(ValueError, match=r"slot 1: combine_send\(slot=1\) onto a slot that is in use.*free: \[0\]"):
        _trace(comm, fn)


def test_a_combine_holds_its_slot_until_its_recv(comm):
    """A combine on another (free) slot holds it until its combine_recv: a dispatch_send there
    before that is refused; after it, and on the dispatch's freed slot, it passes."""
    def busy(x, i, w):
        ga = comm.dispatch(x, i, w, slot=0)
        ca = comm.combine_send(_experts(ga), ga, slot=1)
        comm.dispatch_send(x, i, w, slot=1)
        return comm.combine_recv(ca)

    def fine(x, i, w):
        ga = comm.dispatch(x, i, w, slot=0)
        ca = comm.combine_send(_experts(ga), ga, slot=1)
        gb = comm.dispatch(x, i, w, slot=0)   # the dispatch's slot is free after its combine_send
        out = comm.combine_recv(ca)
        gc = comm.dispatch(x, i, w, slot=1)   # the combine's slot after its combine_recv
        return out + comm.combine(_experts(gb), gb) + comm.combine(_experts(gc), gc)
    with pytest.raises(ValueError, match="slot 1: a dispatch on slot 1 is still in flight"):
        _trace(comm, busy)
    _trace(comm, fine)


def test_a_cycle_that_ends_in_a_nested_trace_frees_the_enclosing_traces_slot(comm):
    """Review finding 15: a combine inside a jax.checkpoint body for a dispatch of the enclosing
    trace freed the slot only when the body had no slot state of its own (then in EVERY trace
    holding that slot). With a cycle of its own on another slot in the body, the enclosing
    trace's slot stayed busy and its next dispatch there was refused. The slot is freed in the
    nearest enclosing trace that holds it."""
    def fn(x, i, w):
        got0 = comm.dispatch(x, i, w, slot=0)

        def body(x, got0):
            got1 = comm.dispatch(x, i, w, slot=1)
            o1 = comm.combine(_experts(got1), got1)
            return o1 + comm.combine(_experts(got0), got0)
        out = jax.checkpoint(body)(x, got0)
        got2 = comm.dispatch(x, i, w, slot=0)  # slot 0 is free again
        return out + comm.combine(_experts(got2), got2)
    _trace(comm, fn)
