"""The interface every backend implements. The communicator validates, the backend moves data.

All methods run inside `jax.shard_map` on one rank's shard; shapes in `jax_moe_a2a.types`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from ..spec import Spec


@dataclasses.dataclass(frozen=True)
class Ctx:
    """Static facts a backend needs on every call, plus the traced rank."""

    spec: Spec
    num_ranks: int
    axis: Any           # mesh axis name(s) of the EP axis
    rank: Any           # [] int32, jax.lax.axis_index(axis)
    comm_id: int
    call_id: int        # distinct per call site, so XLA never merges two calls
    options: dict


def varying(tree, axis):
    """Marks FFI outputs as varying over the EP axis inside shard_map (they differ per rank);
    without it JAX types them as replicated and autodiff/check_vma reject them. No-op on JAX
    versions without `jax.lax.pcast`."""
    import jax

    pcast = getattr(jax.lax, "pcast", None)
    if pcast is None:
        return tree
    axes = axis if isinstance(axis, tuple) else (axis,)

    def cast(a):
        if a is None or getattr(a, "dtype", None) == jax.dtypes.float0:
            return a
        try:
            return pcast(a, axes, to="varying")
        except (ValueError, TypeError, NameError):  # already varying, or outside shard_map
            return a

    return jax.tree.map(cast, tree)


def recv_result_shapes(spec, n, counts_shape):
    """Result shapes of an FFI dispatch_recv: x, scale, group_sizes, weights, src, recv_slot,
    recv_counts (counts_shape), overflow; rows flattened to R' = prod(recv_shape)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    rows = int(np.prod(spec.recv_shape(n)))
    i32, f32 = jnp.int32, jnp.float32
    return (jax.ShapeDtypeStruct((rows, spec.hidden), spec.dispatch_dtype),
            jax.ShapeDtypeStruct((rows, spec.num_scales), f32),
            jax.ShapeDtypeStruct((spec.local_experts(n),), i32),
            jax.ShapeDtypeStruct((rows,), f32),
            jax.ShapeDtypeStruct((rows, 2), i32),
            jax.ShapeDtypeStruct((rows,), i32),
            jax.ShapeDtypeStruct(counts_shape, i32),
            jax.ShapeDtypeStruct((), i32))


def finish_recv(spec, n, outs, route):
    """FFI dispatch_recv results -> the tuple Backend.dispatch_recv returns (layout reshapes,
    routing arrays for combine added to `route`)."""
    x, scale, sizes, weights, src, recv_slot, recv_counts, overflow = outs
    shape = spec.recv_shape(n)
    route = dict(route, recv_src=src, recv_slot=recv_slot, recv_counts=recv_counts)
    x = x.reshape(*shape, spec.hidden)
    scale = scale.reshape(*shape, spec.num_scales) if spec.is_fp8 else None
    return x, scale, sizes, weights.reshape(shape), src.reshape(*shape, 2), overflow, route


class Backend:
    """Backend protocol. Subclasses fill in the four halves."""

    name = "?"
    # The backend-specific options of `jax_moe_a2a.init` this backend reads (name -> meaning);
    # the communicator refuses any other. Read them from `comm.options` in `init`.
    OPTIONS: dict = {}

    def buffer_bytes(self, spec: Spec, num_ranks: int) -> int:
        """Communication buffer bytes one rank holds (all slots)."""
        raise NotImplementedError

    def dispatch_send(self, ctx: Ctx, x, x_scale, topk_ids, topk_weights, num_tokens, slot: int, after=None):
        """x [T, H] (input dtype, or fp8 with x_scale [T, S]); topk_ids [T, K] int32;
        topk_weights [T, K] f32; num_tokens [] int32; after: an array this send must follow
        (XLA orders calls only by data dependencies), or None.
        Returns (handle_arrays: dict, route_arrays: dict, num_dropped [] int32)."""
        raise NotImplementedError

    def dispatch_recv(self, ctx: Ctx, handle_arrays: dict, route_arrays: dict, slot: int):
        """Returns (x, scale|None, group_sizes [L], weights, src, num_overflow [], route_arrays)."""
        raise NotImplementedError

    def combine_send(self, ctx: Ctx, y, route, slot: int, after=None) -> dict:
        """y in the layout of Dispatched.x (bf16/f16/f32). Returns handle arrays."""
        raise NotImplementedError

    # True when JAX autodiff differentiates the halves directly (pure-JAX backends); otherwise the
    # communicator wraps the one-shot ops in custom_vjp (jax_moe_a2a/autodiff.py).
    autodiff = False
    # True when the halves move data with XLA collectives (pure-JAX backends). A rank that stops
    # (debug=True raising) would leave the others waiting in XLA's next collective forever (on
    # XLA:CPU until its rendezvous aborts the process), so the debug check must stop every rank
    # at once. FFI backends time out and name the missing rank instead.
    xla_collectives = False

    def combine_recv(self, ctx: Ctx, handle_arrays: dict, route, slot: int, out: Optional[Any],
                     pairs: bool = False):
        """Returns [T, H] in Spec.combine_dtype: sum_k w * y_row (f32 accumulation), plus `out`
        when given; rows at or past num_tokens are 0 (or `out`). With pairs=True also returns the
        unweighted row of every pair, [T, K, H] f32 (0 where the pair was not routed or dropped),
        which the weight gradient needs."""
        raise NotImplementedError
