"""Shared plumbing of the backends whose halves are XLA FFI calls (host, cuda, nvshmem): the
ordering operand, and the four FFI calls (`comm_call`: side-effecting custom calls
that `jax.checkpoint` accepts and never recomputes). A subclass names its targets and
says which extra operands its handlers take."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .. import _ffi, env
from ..commcall import comm_call
from ..config import Dtype
from .base import Backend, Ctx, finish_recv, recv_result_shapes, varying, vma


def after_operand(after):
    """The ordering operand of the send halves: any array (never read), or an empty one."""
    return jnp.zeros((0,), jnp.int32) if after is None else after


def native_reason(flag: str, missing: str, backend: str, platform: str):
    """None when the extension is built with `flag` (e.g. 'built_with_cuda') and JAX's default
    backend is `platform` ("gpu", "cpu"), else why not (naming `backend`)."""
    if not _ffi.native_available():
        return _ffi.not_built_reason()
    if not getattr(_ffi, flag)():
        return missing
    if jax.default_backend() != platform:
        where = "NVIDIA GPUs" if platform == "gpu" else "CPU devices"
        return f"the {backend} backend runs on {where} (default backend here: {jax.default_backend()})"
    return None


class FfiBackend(Backend):
    """The four halves as FFI calls to `jax_moe_a2a_<target>_<half>`.

    EP = 1 (`local_path`, the GPU backends): with one rank on the EP axis nothing moves between
    ranks, so dispatch_send is one FFI call (`<target>_local_dispatch`) that produces
    dispatch_recv's results too, dispatch_recv only unpacks them, combine_send passes y on, and
    combine_recv is one FFI call (`<target>_local_combine`) that reduces y where it is
    (cc/gpu/local). The results are those of the exchange halves. $JAX_MOE_A2A_LOCAL_PATH=0
    (read at the communicator's first call) runs the exchange halves at EP = 1 too."""

    target = "?"
    takes_rank_mask = True
    local_path = False  # the GPU backends: EP = 1 takes the local path
    # The kernels write fp8 rows dequantised into Spec.recv_dtype themselves (the GPU backends);
    # otherwise the communicator dequantises what the backend returns (Communicator.dispatch_recv).
    dequantizes_on_recv = False

    # ---- what differs between backends -----------------------------------------------------
    def _rank(self, ctx: Ctx) -> tuple:
        """Leading operands naming the rank (host: the axis index; cuda: none, the device is it)."""
        return ()

    def _counts_shape(self, spec, n) -> tuple:
        """Shape of dispatch_recv's per-source counts (route array `recv_counts`)."""
        raise NotImplementedError

    def _combine_send_routing(self, route_arrays) -> tuple:
        """Routing operands of combine_send, from the route arrays dispatch_recv produced."""
        raise NotImplementedError

    def _mask_operands(self, ctx: Ctx, rank_mask) -> tuple:
        """Trailing operands of every half carrying the rank mask (int32 [N] or None). Handlers
        without one take none; rank_mask_unsupported() refused a mask before it got here."""
        if rank_mask is not None:
            raise ValueError(f"rank_mask is not supported by the {self.name} backend")
        return ()

    # ---- the four halves -----------------------------------------------------------------
    def _call(self, half, outs, ctx, *operands, **attrs):
        call = comm_call(f"jax_moe_a2a_{self.target}_{half}", outs)
        # The results vary over the EP axis and over every axis the data operands vary over (on a
        # multi-axis mesh, the EP groups' axes: each group has its own data). JAX would type them
        # as invariant (the FFI call's abstract evaluation adds no varying axes), and autodiff
        # would then sum their cotangents over those axes, mixing the groups.
        ep = ctx.axis if isinstance(ctx.axis, tuple) else (ctx.axis,)
        data_axes = set().union(*(vma(a) for a in operands)) - set(ep)
        axes = ep + tuple(a for a in ctx.group_axes if a in data_axes)
        return varying(call(*self._rank(ctx), *operands, comm_id=np.int64(ctx.comm_id), **attrs), axes)

    def uses_local_path(self, num_ranks: int) -> bool:
        """Whether the halves of a communicator over `num_ranks` EP ranks take the EP = 1 local
        path (decided once, when first asked, so that every call of a communicator agrees)."""
        if getattr(self, "_local_path_on", None) is None:
            self._local_path_on = self.local_path and num_ranks == 1 and env.get_str("LOCAL_PATH", "auto") != "0"
        return self._local_path_on

    def dispatch_send(self, ctx: Ctx, x, x_scale, topk_ids, topk_weights, num_tokens, slot, after=None,
                      rank_mask=None):
        t, k = topk_ids.shape
        i32 = jnp.int32
        outs = (jax.ShapeDtypeStruct((2,), i32), jax.ShapeDtypeStruct((t, k), i32),
                jax.ShapeDtypeStruct((t, k), i32), jax.ShapeDtypeStruct((), i32))
        xs = x_scale if x_scale is not None else jnp.zeros((0,), jnp.float32)
        local = self.uses_local_path(ctx.num_ranks)
        if local:  # dispatch_recv's results too, from the same call
            outs += recv_result_shapes(ctx.spec, 1, self._counts_shape(ctx.spec, 1), self.dequantizes_on_recv)
        res = self._call(
            "local_dispatch" if local else "dispatch_send", outs, ctx, x, xs, topk_ids,
            topk_weights.astype(jnp.float32), num_tokens.reshape(()), after_operand(after),
            *self._mask_operands(ctx, rank_mask), slot=np.int32(slot), call_id=np.int64(ctx.call_id))
        handle, dest, pair_slot, dropped = res[:4]
        arrays = {"handle": handle, "local_recv": tuple(res[4:])} if local else {"handle": handle}
        return arrays, {"dest": dest, "slot": pair_slot}, dropped

    def dispatch_recv(self, ctx: Ctx, arrays, route, slot):
        spec, n = ctx.spec, ctx.num_ranks
        if "local_recv" in arrays:  # EP = 1: produced by dispatch_send's call
            return finish_recv(spec, n, arrays["local_recv"], route)
        shapes = recv_result_shapes(spec, n, self._counts_shape(spec, n), self.dequantizes_on_recv)
        outs = self._call("dispatch_recv", shapes, ctx, arrays["handle"], *self._mask_operands(ctx, route.get("rank_mask")),
                          slot=np.int32(slot))
        return finish_recv(spec, n, outs, route)

    def combine_send(self, ctx: Ctx, y, route, slot, after=None, from_slot=None):
        spec = ctx.spec
        if self.uses_local_path(ctx.num_ranks):  # EP = 1: combine_recv reads y where it is
            return {"y": y.reshape(-1, spec.hidden), "y_dtype": jnp.zeros((0,), y.dtype)}
        handle = self._call("combine_send", jax.ShapeDtypeStruct((2,), jnp.int32), ctx, y.reshape(-1, spec.hidden),
                            *self._combine_send_routing(route.arrays), after_operand(after),
                            *self._mask_operands(ctx, route.arrays.get("rank_mask")), slot=np.int32(slot),
                            from_slot=np.int32(slot if from_slot is None else from_slot), call_id=np.int64(ctx.call_id))
        return {"handle": handle, "y_dtype": jnp.zeros((0,), y.dtype)}  # zero-size: carries y's dtype

    def combine_recv(self, ctx: Ctx, arrays, route, slot, out, pairs=False):
        spec = ctx.spec
        t, h, k = spec.max_tokens_per_rank, spec.hidden, spec.experts_per_token
        out_in = out if out is not None else jnp.zeros((0,), spec.combine_dtype)
        outs = (jax.ShapeDtypeStruct((t, h), spec.combine_dtype),
                jax.ShapeDtypeStruct((t, k, h) if pairs else (0,), jnp.float32))
        routing = (route.arrays["dest"], route.arrays["slot"], route.topk_weights.astype(jnp.float32),
                   route.num_tokens.reshape(()), out_in, *self._mask_operands(ctx, route.arrays.get("rank_mask")))
        if "y" in arrays:  # EP = 1
            res, rows = self._call("local_combine", outs, ctx, arrays["y"], route.arrays["recv_counts"], *routing,
                                   slot=np.int32(slot), call_id=np.int64(ctx.call_id))
        else:
            res, rows = self._call("combine_recv", outs, ctx, arrays["handle"], *routing, slot=np.int32(slot),
                                   y_kind=np.int32(Dtype.of(arrays["y_dtype"].dtype)))
        return (res, rows) if pairs else res
