"""Shared plumbing of the backends whose halves are XLA FFI calls (host, cuda, nvshmem): the
ordering operand, and the four FFI calls (`comm_call`: side-effecting custom calls
that `jax.checkpoint` accepts and never recomputes). A subclass names its targets and
says which extra operands its handlers take."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from .. import _ffi, env
from ..axes import varying, vma
from ..commcall import comm_call
from ..dtypes import Dtype
from ..types import pytree
from .base import Backend, Ctx, Received, Sent


@pytree
class FfiDispatchWire:
    """dispatch_send -> dispatch_recv: the FFI call's handle [2] int32 (orders the halves); at
    EP = 1 (the local path) also every result of dispatch_recv, produced by the same call."""

    handle: Any
    local_recv: Optional[tuple] = None


@pytree
class FfiPlacement:
    """Where each pair went: dest [T, K] int32 (its expert's rank, N if not routed), slot [T, K]
    int32 (its row among the rows to dest), dest_counts (`_dest_counts_shape`: the nvshmem
    backend's [N] int32, the pairs of the tp group with dest == r, which combine_recv waits for;
    None on host, on cuda (its handlers' dest_counts is empty: combine_recv passes a fresh [0]
    operand, so no zero-size array travels in a handle; a jitted half taking one crashed XLA's
    Shardy pass on jax 0.11.2, GPU) and at EP = 1); after dispatch_recv also where each received row
    came from: recv_src [R', 2], recv_slot [R'] and recv_counts (per source; `_counts_shape`)."""

    dest: Any
    slot: Any
    dest_counts: Optional[Any] = None
    recv_src: Optional[Any] = None
    recv_slot: Optional[Any] = None
    recv_counts: Optional[Any] = None


@pytree(meta=("y_dtype",))
class FfiCombineWire:
    """combine_send -> combine_recv: the FFI call's handle [2] int32, or at EP = 1 the expert
    outputs y [R', H] themselves (combine_recv reduces them where they are); y_dtype: the dtype
    y was sent in (static)."""

    handle: Optional[Any] = None
    y: Optional[Any] = None
    y_dtype: Any = None


def recv_result_shapes(spec, n, counts_shape, dequant=False):
    """Result shapes of an FFI dispatch_recv: x, scale, group_sizes, weights, src, recv_slot,
    recv_counts (counts_shape), overflow; rows flattened to R' = prod(recv_shape). dequant: the
    kernels write x in spec.recv_dtype (fp8 dequantised on receive) and no scales ([R', 0])."""
    rows = int(np.prod(spec.recv_shape(n)))
    i32, f32 = jnp.int32, jnp.float32
    dequant = dequant and spec.recv_dtype is not None
    return (jax.ShapeDtypeStruct((rows, spec.hidden), spec.recv_dtype if dequant else spec.dispatch_dtype),
            jax.ShapeDtypeStruct((rows, 0 if dequant else spec.num_scales), f32),
            jax.ShapeDtypeStruct((spec.local_experts(n),), i32),
            jax.ShapeDtypeStruct((rows,), f32),
            jax.ShapeDtypeStruct((rows, 2), i32),
            jax.ShapeDtypeStruct((rows,), i32),
            jax.ShapeDtypeStruct(counts_shape, i32),
            jax.ShapeDtypeStruct((), i32))


def finish_recv(spec, n, outs, placement: FfiPlacement) -> Received:
    """FFI dispatch_recv results -> `Received` (layout reshapes; the placement completed with
    where each received row came from)."""
    x, scale, sizes, weights, src, recv_slot, recv_counts, overflow = outs
    shape = spec.recv_shape(n)
    placement = dataclasses.replace(placement, recv_src=src, recv_slot=recv_slot, recv_counts=recv_counts)
    x = x.reshape(*shape, spec.hidden)
    # no scales: 16/32-bit rows, or fp8 rows the kernels dequantised (recv_result_shapes' dequant)
    scale = scale.reshape(*shape, spec.num_scales) if spec.is_fp8 and scale.shape[-1] else None
    return Received(x, scale, sizes, weights.reshape(shape), src.reshape(*shape, 2), overflow, placement)


def after_operand(after):
    """The ordering operand of the send halves (never read): `after` is None, an array of any
    shape and dtype, or a pytree of them; the result is one array that exists only once every
    leaf does: the leaf itself when there is one, else the first element of each non-empty leaf
    as f32 [number of non-empty leaves] (an empty int32 [0] without any). No gradient flows
    through it (stop_gradient: the FFI call has no derivative, and the ordering needs none)."""
    leaves = [jax.lax.stop_gradient(jnp.asarray(a)) for a in jax.tree.leaves(after)
              if getattr(a, "dtype", None) != jax.dtypes.float0]
    if len(leaves) == 1:
        return leaves[0]
    axes = tuple(sorted(set().union(set(), *(vma(a) for a in leaves))))
    parts = [varying(a.reshape(-1)[:1].astype(jnp.float32), axes) if axes else a.reshape(-1)[:1].astype(jnp.float32)
             for a in leaves if a.size]
    return jnp.concatenate(parts) if parts else jnp.zeros((0,), jnp.int32)


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
    local_path = False  # the GPU backends: EP = 1 takes the local path
    # The kernels write fp8 rows dequantised into Spec.recv_dtype themselves (the GPU backends);
    # otherwise the communicator dequantises what the backend returns (Communicator.dispatch_recv).
    dequantizes_on_recv = False

    # ---- what differs between backends -----------------------------------------------------
    def _rank(self, ctx: Ctx) -> tuple:
        """Leading operands naming the rank (host: the axis index; cuda: none, the device is it)."""
        return ()

    def _counts_shape(self, spec, n) -> tuple:
        """Shape of dispatch_recv's per-source counts (`FfiPlacement.recv_counts`)."""
        raise NotImplementedError

    def _dest_counts_shape(self, n) -> Optional[tuple]:
        """Shape of dispatch_send's last result dest_counts, which combine_recv takes after the
        handle (`FfiPlacement.dest_counts`), or None: the handlers have neither."""
        return None

    def _dest_counts_operand(self, ctx: Ctx, placement: FfiPlacement) -> tuple:
        """combine_recv's dest_counts operand after the handle: the placement's, a fresh empty
        array where the handlers' is empty (dispatch_send does not carry it), or none."""
        if placement.dest_counts is not None:
            return (placement.dest_counts,)
        shape = self._dest_counts_shape(ctx.num_ranks)
        return () if shape is None else (jnp.zeros(shape, jnp.int32),)

    def _combine_send_routing(self, placement: FfiPlacement) -> tuple:
        """Routing operands of combine_send, from the placement dispatch_recv completed."""
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
                      rank_mask=None) -> Sent:
        t, k = topk_ids.shape
        i32 = jnp.int32
        outs = (jax.ShapeDtypeStruct((2,), i32), jax.ShapeDtypeStruct((t, k), i32),
                jax.ShapeDtypeStruct((t, k), i32), jax.ShapeDtypeStruct((), i32))
        xs = x_scale if x_scale is not None else jnp.zeros((0,), jnp.float32)
        local = self.uses_local_path(ctx.num_ranks)
        counts = None if local else self._dest_counts_shape(ctx.num_ranks)
        if local:  # dispatch_recv's results too, from the same call
            outs += recv_result_shapes(ctx.spec, 1, self._counts_shape(ctx.spec, 1), self.dequantizes_on_recv)
        elif counts is not None:
            outs += (jax.ShapeDtypeStruct(counts, i32),)
        res = self._call(
            "local_dispatch" if local else "dispatch_send", outs, ctx, x, xs, topk_ids,
            topk_weights.astype(jnp.float32), num_tokens.reshape(()), after_operand(after),
            *self._mask_operands(ctx, rank_mask), slot=np.int32(slot), call_id=np.int64(ctx.call_id))
        handle, dest, pair_slot, dropped = res[:4]
        wire = FfiDispatchWire(handle, tuple(res[4:]) if local else None)
        carried = res[4] if counts is not None and math.prod(counts) > 0 else None
        return Sent(wire, FfiPlacement(dest, pair_slot, carried), dropped)

    def dispatch_recv(self, ctx: Ctx, wire: FfiDispatchWire, placement: FfiPlacement, slot, rank_mask=None):
        spec, n = ctx.spec, ctx.num_ranks
        if wire.local_recv is not None:  # EP = 1: produced by dispatch_send's call
            return finish_recv(spec, n, wire.local_recv, placement)
        shapes = recv_result_shapes(spec, n, self._counts_shape(spec, n), self.dequantizes_on_recv)
        outs = self._call("dispatch_recv", shapes, ctx, wire.handle, *self._mask_operands(ctx, rank_mask),
                          slot=np.int32(slot))
        return finish_recv(spec, n, outs, placement)

    def combine_send(self, ctx: Ctx, y, route, slot, after=None, from_slot=None) -> FfiCombineWire:
        spec = ctx.spec
        if self.uses_local_path(ctx.num_ranks):  # EP = 1: combine_recv reads y where it is
            return FfiCombineWire(y=y.reshape(-1, spec.hidden), y_dtype=np.dtype(y.dtype))
        handle = self._call("combine_send", jax.ShapeDtypeStruct((2,), jnp.int32), ctx, y.reshape(-1, spec.hidden),
                            *self._combine_send_routing(route.placement), after_operand(after),
                            *self._mask_operands(ctx, route.rank_mask), slot=np.int32(slot),
                            from_slot=np.int32(slot if from_slot is None else from_slot), call_id=np.int64(ctx.call_id))
        return FfiCombineWire(handle=handle, y_dtype=np.dtype(y.dtype))

    def combine_recv(self, ctx: Ctx, wire: FfiCombineWire, route, slot, out, pairs=False):
        spec = ctx.spec
        t, h, k = spec.max_tokens_per_rank, spec.hidden, spec.experts_per_token
        out_in = out if out is not None else jnp.zeros((0,), spec.combine_dtype)
        outs = (jax.ShapeDtypeStruct((t, h), spec.combine_dtype),
                jax.ShapeDtypeStruct((t, k, h) if pairs else (0,), jnp.float32))
        p = route.placement
        routing = (p.dest, p.slot, route.topk_weights.astype(jnp.float32), route.num_tokens.reshape(()), out_in,
                   *self._mask_operands(ctx, route.rank_mask))
        if wire.y is not None:  # EP = 1
            res, rows = self._call("local_combine", outs, ctx, wire.y, p.recv_counts, *routing,
                                   slot=np.int32(slot), call_id=np.int64(ctx.call_id))
        else:
            counts = self._dest_counts_operand(ctx, p)
            res, rows = self._call("combine_recv", outs, ctx, wire.handle, *counts, *routing, slot=np.int32(slot),
                                   y_kind=np.int32(Dtype.of(wire.y_dtype)))
        return (res, rows) if pairs else res
