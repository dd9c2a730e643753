"""custom_vjp rules for backends that JAX cannot differentiate (FFI calls).

The cotangent of dispatch is a combine of the row cotangents with unit weights; the cotangent of
combine is a dispatch of the output cotangent (rows scaled by their router weight) plus the weight
gradient <cotangent, expert row>, for which the forward combine also returns every pair's row.
Only the one-shot `dispatch` / `combine` are differentiable; the split halves are for inference.

The rules see the communicator only through `Halves`: its four halves without checks or slot
tracking, held weakly. The custom_vjp equation keeps the rules in the traced program, which JAX
caches with the jitted function, and a strong reference would keep the communicator (its
buffers, engines and threads) alive as long as that function.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from .axes import like_primal, varying, vma
from .spec import Spec
from .types import Dispatched


@dataclasses.dataclass(frozen=True)
class Halves:
    """A communicator's halves for the rules, without checks or slot tracking (the rules trace
    them at times JAX picks, in traces of their own; the one-shot call is tracked in the caller's
    trace). Each is a `weakref.WeakMethod` of the communicator's:
      send(x, ids, w, n, slot, *, x_scale, after, mask) -> DispatchHandle
      recv(handle, count=True) -> Dispatched (count=False: not in stats(), no debug check)
      combine_send(y, got, slot, after=None) -> CombineHandle
      combine_recv(handle, out, pairs=False) -> [T, H] (and [T, K, H] f32 rows with pairs)."""

    spec: Spec
    axis: Any
    send_ref: Callable
    recv_ref: Callable
    combine_send_ref: Callable
    combine_recv_ref: Callable

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
    def z(a):
        if jnp.issubdtype(a.dtype, jnp.floating):
            return varying(jnp.zeros(a.shape, a.dtype), tuple(vma(a)) or axis)
        return np.zeros(a.shape, jax.dtypes.float0)
    return jax.tree.map(z, tree)


def _axes_of(a, comm):
    """The axes primal `a` varies over, or (not in shard_map's typed mode) the EP axis."""
    axes = tuple(sorted(vma(a)))
    return axes or (comm.axis if isinstance(comm.axis, tuple) else (comm.axis,))


def _fp8_error():
    return NotImplementedError(
        "jax_moe_a2a: gradients through a non-JAX backend need a 16/32-bit Spec.dispatch_dtype "
        "(fp8 rows have no useful cotangent); use bf16 dispatch for training")


def dispatch(comm: Halves, x, topk_ids, topk_weights, num_tokens, slot, rank_mask=None, tokens_given=None):
    """Differentiable one-shot dispatch (w.r.t. x and topk_weights). Shapes as Communicator.dispatch.
    rank_mask: int32 [N] or None (the combines of the backward take it from the route);
    tokens_given: num_tokens before the clamp ([] int32) or None (DispatchHandle.tokens_given)."""
    spec = comm.spec
    x_axes, w_axes = _axes_of(x, comm), _axes_of(topk_weights, comm)  # the cotangents' types

    def raw(x, ids, w, n, mask, given):
        return comm.recv(comm.send(x, ids, w, n, slot, mask=mask, given=given))

    @jax.custom_vjp
    def f(x, ids, w, n, mask, given):
        return raw(x, ids, w, n, mask, given)

    def fwd(x, ids, w, n, mask, given):
        got = raw(x, ids, w, n, mask, given)
        return got, (got, jnp.zeros((0,), x.dtype))

    def bwd(res, g):
        got, x_dtype_carrier = res
        if spec.is_fp8:
            raise _fp8_error()
        # rows past the counts carry no gradient
        valid = got.src[..., 0] >= 0
        gx = jnp.where(valid[..., None], g.x.astype(jnp.float32), 0.0)
        unit = dataclasses.replace(got.route, topk_weights=jnp.ones_like(got.route.topk_weights))
        gx = gx.astype(spec.combine_wire_dtype(jnp.float32))
        back = comm.combine_recv(comm.combine_send(gx, dataclasses.replace(got, route=unit), slot, after=g.x), None)
        if spec.tp_size > 1:  # only the member that sent a token gets its gradient
            rank = jax.lax.axis_index(comm.axis)
            t = jnp.arange(spec.max_tokens_per_rank)
            back = jnp.where((t % spec.tp_size == rank % spec.tp_size)[:, None], back, 0)
        grad_x = back.astype(x_dtype_carrier.dtype)
        grad_w = g.route.topk_weights
        return like_primal(grad_x, x_axes), None, like_primal(grad_w, w_axes), None, None, None

    f.defvjp(fwd, bwd)
    return f(x, topk_ids, topk_weights, num_tokens, rank_mask, tokens_given)


def combine(comm: Halves, y, got: Dispatched, out, slot):
    """Differentiable one-shot combine (w.r.t. y, the router weights in got.route, and out)."""
    spec = comm.spec
    has_out = out is not None
    y_axes, w_axes = _axes_of(y, comm), _axes_of(got.route.topk_weights, comm)
    out_axes = _axes_of(out, comm) if has_out else ()

    @jax.custom_vjp
    def f(y, got, out):
        return comm.combine_recv(comm.combine_send(y, got, slot), out if has_out else None)

    def fwd(y, got, out):
        res, pairs = comm.combine_recv(comm.combine_send(y, got, slot), out if has_out else None, pairs=True)
        return res, (got, pairs, jnp.zeros((0,), y.dtype))

    def bwd(res, g):
        got, pairs, y_carrier = res
        if spec.tp_size > 1:
            raise NotImplementedError(
                "jax_moe_a2a: combine gradients with tp_size > 1 on a non-JAX backend are not supported "
                "yet (the cotangent must first be summed over the tp group); use backend='reference'")
        gf = g.astype(jnp.float32)
        grad_w = jnp.einsum("th,tkh->tk", gf, pairs)
        r = got.route
        if spec.is_fp8:
            raise _fp8_error()
        # `after=pairs`: this second dispatch on the slot must follow the forward's combine_recv
        # (its FREE signals), and nothing else in the data says so.
        # count=False: stats() count the dispatches the program calls, not the backward's exchanges
        got_g = comm.recv(comm.send(gf, r.topk_ids, r.topk_weights, r.num_tokens, slot,
                                    after=pairs, mask=r.rank_mask), count=False)
        valid = got.src[..., 0] >= 0
        rows = got_g.x.astype(jnp.float32) * got.weights[..., None]
        grad_y = jnp.where(valid[..., None], rows, 0.0).astype(y_carrier.dtype)
        grad_got = _zero_cotangent(got, comm.axis)
        grad_out = like_primal(g, out_axes) if has_out else None
        grad_w = like_primal(grad_w, w_axes)
        grad_got = dataclasses.replace(grad_got, route=dataclasses.replace(grad_got.route, topk_weights=grad_w))
        return like_primal(grad_y, y_axes), grad_got, grad_out

    f.defvjp(fwd, bwd)
    return f(y, got, out if has_out else None)
