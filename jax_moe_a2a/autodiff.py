"""custom_vjp rules for backends that JAX cannot differentiate (FFI calls): the receive halves.

Every half is differentiable in reverse mode on every backend (forward mode, jax.jvp, only on the
pure-JAX backends: these rules are custom_vjps). The FFI backends' halves are opaque calls, so the
rules sit on the receive halves and the send halves only carry their differentiable inputs through
the handles (`DispatchHandle.x`, `CombineHandle.y`, and the router weights in `Route`), while the
FFI calls see them through `stop_gradient`:

- the cotangent of dispatch_recv is a combine (the same exchange, backwards) of the row
  cotangents with unit weights, sent to `handle.x`; the weights' cotangent passes through;
- the cotangent of combine_recv is a dispatch of the output cotangent (rows then scaled by their
  router weight), sent to `handle.y`, plus the weight gradient <cotangent, expert row>, for which
  the forward combine also returns every pair's row.

The one-shot `dispatch` / `combine` are the two halves back to back, so they get the same rules.
fp8 (one rule on every backend): an fp8 Spec.dispatch_dtype has no gradient, through dispatch or
through combine; differentiating either raises ValueError when JAX transposes (`fp8_guard` makes
the pure-JAX backends, which JAX differentiates itself, refuse the same way).

The rules see the communicator only through `Halves`: its four halves without checks, slot
tracking or these rules, held weakly. The custom_vjp equation keeps the rules in the traced
program, which JAX caches with the jitted function, and a strong reference would keep the
communicator (its buffers, engines and threads) alive as long as that function.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from .axes import like_primal, varying, vma
from .spec import Spec
from .types import CombineHandle, DispatchHandle, Dispatched


@dataclasses.dataclass(frozen=True)
class Halves:
    """A communicator's halves for the rules, without checks, slot tracking or the rules (JAX
    traces the rules at times it picks, in traces of their own; the caller's calls are tracked
    in the caller's trace). Each is a `weakref.WeakMethod` of the communicator's:
      send(x, ids, w, n, slot, *, x_scale, after, mask, given) -> DispatchHandle
      recv(handle, count=True) -> Dispatched (count=False: not in stats(), no debug check)
      combine_send(y, got, slot, after=None) -> CombineHandle
      combine_recv(handle, out, pairs=False) -> [T, H] (and [T, K, H] f32 rows with pairs).
    order: the communicator's `slots.SlotOrder` (each slot's last exchange in each trace; holds
    no reference to the communicator), or None: no ordering of the backward's exchanges beyond
    their data."""

    spec: Spec
    axis: Any
    send_ref: Callable
    recv_ref: Callable
    combine_send_ref: Callable
    combine_recv_ref: Callable
    order: Any = None

    @staticmethod
    def _live(ref):
        fn = ref()
        if fn is None:
            raise RuntimeError("jax_moe_a2a: the communicator of this step was closed and collected")
        return fn

    def send(self, *a, **kw):
        return self._live(self.send_ref)(*a, **kw)

    def recv(self, *a, **kw):
        return self._live(self.recv_ref)(*a, **kw)

    def combine_send(self, *a, **kw):
        return self._live(self.combine_send_ref)(*a, **kw)

    def combine_recv(self, *a, **kw):
        return self._live(self.combine_recv_ref)(*a, **kw)


def _zero_cotangent(tree, axis):
    """A function () -> zero cotangents of `tree` (float zeros typed like each leaf, float0 for
    integers), built from the leaves' shapes, dtypes and axes only: a rule must not touch the
    primal tracers of the trace that defined it."""
    leaves, treedef = jax.tree.flatten(tree)
    info = [(a.shape, a.dtype, tuple(vma(a)) or axis) for a in leaves]

    def make():
        out = []
        for shape, dtype, axes in info:
            if jnp.issubdtype(dtype, jnp.floating):
                out.append(varying(jnp.zeros(shape, dtype), axes))
            else:
                out.append(np.zeros(shape, jax.dtypes.float0))
        return jax.tree.unflatten(treedef, out)
    return make


def _axes_of(a, comm):
    """The axes primal `a` varies over, or (not in shard_map's typed mode) the EP axis."""
    axes = tuple(sorted(vma(a)))
    return axes or (comm.axis if isinstance(comm.axis, tuple) else (comm.axis,))


def _fp8_error(what: str):
    return ValueError(
        f"jax_moe_a2a: {what} has no gradient with an fp8 Spec.dispatch_dtype (the rows are quantised; the "
        "same on every backend); train with a bf16/f16/f32 dispatch_dtype")


def fp8_guard(a, what: str):
    """`a` unchanged; differentiating through it raises _fp8_error(what) when JAX transposes."""
    @jax.custom_vjp
    def f(a):
        return a

    def bwd(_, g):
        raise _fp8_error(what)

    f.defvjp(lambda a: (a, None), bwd)
    return f(a)


def _slot_token(comm, slot, keep):
    """The communicator's `slots.SlotToken` of `slot` in the trace being built (or None), held
    in `keep` (a list of the rule's) as long as the rule: the SlotOrder holds it weakly."""
    if comm.order is None:
        return None
    tok = comm.order.token(slot)
    keep.append(tok)
    return tok


def _order(after, tok):
    """`after` for a backward exchange on a slot: `after` and the result of the slot's last
    exchange traced in this trace (`tok`, a slots.SlotToken or None), when there is one."""
    token = None if tok is None else tok.get()
    return after if token is None else (after, token)


def _note(tok, token):
    if tok is not None:
        tok.set(token)


def _axes_or(a, comm):
    return _axes_of(a, comm) if a is not None else ()


def dispatch_recv(comm: Halves, handle: DispatchHandle, count: bool = True) -> Dispatched:
    """Differentiable dispatch_recv (w.r.t. handle.x, the rows dispatch_send was given, and the
    router weights in handle.route). Shapes as Communicator.dispatch_recv."""
    spec = comm.spec
    x_axes = _axes_or(handle.x, comm)  # the cotangents' types
    w_axes = _axes_of(handle.route.topk_weights, comm)
    x_dtype = None if handle.x is None else handle.x.dtype
    zeros = _zero_cotangent(handle, comm.axis)
    # The slot's token (slots.SlotOrder): the forward combines leave their outputs there, and
    # this rule's backward combine on the slot runs after the slot's last exchange traced before
    # it (the forward's combine, or a backward exchange), whatever the cotangent depends on.
    # Taken in f/fwd too, so that it lives (held by this rule) until the backward is traced.
    keep, cycle = [], object()  # cycle: this dispatch's identity in the slot's token

    def begin():
        tok = _slot_token(comm, handle.slot, keep)
        if tok is not None:
            tok.cycle = tok.dispatched = cycle

    @jax.custom_vjp
    def f(handle):
        begin()
        return comm.recv(handle, count=count)

    def fwd(handle):
        begin()
        got = comm.recv(handle, count=count)
        return got, got

    def bwd(got, g):
        if spec.is_fp8:
            raise _fp8_error("dispatch")
        # rows past the counts carry no gradient
        valid = got.src[..., 0] >= 0
        gx = jnp.where(valid[..., None], g.x.astype(jnp.float32), 0.0).astype(spec.combine_wire_dtype(jnp.float32))
        unit = dataclasses.replace(got.route, topk_weights=jnp.ones_like(got.route.topk_weights))
        # after: the cotangent (this combine needs it anyway) and the slot's last exchange (the
        # forward's last combine there, or the backward exchange traced before this one): without
        # it, a loss that reaches got.x but not the combine left this combine free to run before
        # the forward's combine on the slot, or beside another layer's backward exchanges there,
        # and the host backend waited for the slot until timeout_s.
        tok = _slot_token(comm, got.slot, keep)
        if tok is not None and tok.dispatched is not None and tok.dispatched is not cycle:
            # The slot's routing state is known to be another dispatch's (a later layer's on the
            # slot, when this dispatch's combine is not differentiated, so that combine's backward
            # dispatch did not run just before): the host backend's combine would take that
            # dispatch's offsets. Dispatch this route again first (zero rows; not in stats()), so
            # that the slot holds it. Unknown (None: the forward halves were traced apart, as
            # under jax.checkpoint): the slot is taken to hold it, as combine's backward dispatch
            # on it left it.
            r = got.route
            zx = varying(jnp.zeros((spec.max_tokens_per_rank, spec.hidden), spec.dispatch_dtype), w_axes)
            again = comm.recv(comm.send(zx, r.topk_ids, r.topk_weights, r.num_tokens, got.slot,
                                        after=_order(g.x, tok), mask=r.rank_mask), count=False)
            _note(tok, again.x)
        back = comm.combine_recv(comm.combine_send(gx, dataclasses.replace(got, route=unit), got.slot,
                                                   after=_order(g.x, tok)), None)
        _note(tok, back)
        if spec.tp_size > 1:  # only the member that sent a token gets its gradient
            rank = jax.lax.axis_index(comm.axis)
            t = jnp.arange(spec.max_tokens_per_rank)
            back = jnp.where((t % spec.tp_size == rank % spec.tp_size)[:, None], back, 0)
        ct = zeros()
        route = dataclasses.replace(ct.route, topk_weights=like_primal(g.route.topk_weights, w_axes))
        grad_x = None if x_dtype is None else like_primal(back.astype(x_dtype), x_axes)
        return (dataclasses.replace(ct, route=route, x=grad_x),)

    f.defvjp(fwd, bwd)
    return f(handle)


def combine_recv(comm: Halves, handle: CombineHandle, out):
    """Differentiable combine_recv (w.r.t. handle.y, the expert outputs combine_send was given,
    the router weights in handle.route, and out). Shapes as Communicator.combine_recv."""
    spec = comm.spec
    has_out = out is not None
    y_axes, w_axes = _axes_or(handle.y, comm), _axes_of(handle.route.topk_weights, comm)
    out_axes = _axes_of(out, comm) if has_out else ()
    out_dtype = out.dtype if has_out else None  # its cotangent's dtype (g is Spec.combine_dtype's)
    y_dtype = None if handle.y is None else handle.y.dtype
    # The backward dispatch runs on the DISPATCH's slot (got.slot), not the combine's: the
    # dispatch's own backward (a combine on got.slot, dispatch_recv's rule) then finds that slot's
    # routing state (the host backend's combine offsets: its last dispatch's) to be this route's.
    # On the combine's slot, a later dispatch that reused got.slot would have left its own there.
    zeros, slot = _zero_cotangent(handle, comm.axis), handle.got.slot

    # This combine's output is the last exchange on its slots (the dispatch's and its own) in
    # the trace f or fwd run in: the next backward exchange there follows it (slots.SlotOrder).
    keep = []

    box = {}

    def note(res):
        for z in sorted({slot, handle.slot}):
            tok = _slot_token(comm, z, keep)
            _note(tok, res)
            if z == slot and tok is not None:
                box["cycle"] = tok.cycle  # the dispatch this combine answers (its latest on slot)

    @jax.custom_vjp
    def f(handle, out):
        res = comm.combine_recv(handle, out if has_out else None)
        note(res)
        return res

    def fwd(handle, out):
        res, pairs = comm.combine_recv(handle, out if has_out else None, pairs=True)
        note(res)
        return res, (handle.got, pairs)

    def bwd(res, g):
        got, pairs = res
        if spec.tp_size > 1:
            raise NotImplementedError(
                "jax_moe_a2a: combine gradients with tp_size > 1 on a non-JAX backend are not supported "
                "yet (the cotangent must first be summed over the tp group); use backend='reference'")
        if spec.is_fp8:
            raise _fp8_error("combine")
        gf = g.astype(jnp.float32)
        grad_w = jnp.einsum("th,tkh->tk", gf, pairs)
        r = got.route
        # after: `pairs` and the slot's last exchange traced so far (the forward's last combine
        # there, or another layer's backward exchange): this dispatch on the slot must follow
        # them (their FREE signals), and nothing else in the data says so. count=False: stats()
        # count the dispatches the program calls, not the backward's exchanges.
        tok = _slot_token(comm, slot, keep)
        got_g = comm.recv(comm.send(gf, r.topk_ids, r.topk_weights, r.num_tokens, slot,
                                    after=_order(pairs, tok), mask=r.rank_mask), count=False)
        _note(tok, got_g.x)  # the slot's next backward exchange follows this one
        if tok is not None:  # the slot holds the forward dispatch's route again
            tok.dispatched = box.get("cycle")
        valid = got.src[..., 0] >= 0
        rows = got_g.x.astype(jnp.float32) * got.weights[..., None]
        ct = zeros()
        route = dataclasses.replace(ct.route, topk_weights=like_primal(grad_w, w_axes))
        grad_y = None
        if y_dtype is not None:
            grad_y = like_primal(jnp.where(valid[..., None], rows, 0.0).astype(y_dtype), y_axes)
        grad_out = like_primal(g.astype(out_dtype), out_axes) if has_out else None
        return dataclasses.replace(ct, route=route, y=grad_y), grad_out

    f.defvjp(fwd, bwd)
    return f(handle, out if has_out else None)
