"""Pytrees that carry data and routing state between the four halves.

All arrays are per rank (the shard seen inside `jax.shard_map`). N ranks, L local experts,
T = max_tokens_per_rank, K = experts_per_token, H = hidden, S = ceil(H / scale_block) (fp8 only),
R = ragged receive rows, C = expert_major rows per local expert.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax


def pytree(cls=None, *, meta: tuple = ()):
    """Class decorator: a frozen dataclass registered as a pytree whose fields are its leaves (in
    field order), except the static `meta` fields (hashable: slots, ids, dtypes). The handles
    below and the backends' typed wire and placement records (jax_moe_a2a/backends) are declared
    with it."""
    def wrap(c):
        c = dataclasses.dataclass(frozen=True)(c)
        names = [f.name for f in dataclasses.fields(c)]
        return jax.tree_util.register_dataclass(c, data_fields=[n for n in names if n not in meta],
                                                meta_fields=list(meta))
    return wrap(cls) if cls is not None else wrap


@pytree(meta=("comm_id",))
class Route:
    """Everything combine needs to know about one dispatch (pass it on inside `got`).

    Fields:
      topk_weights: [T, K] f32, the router weights given to dispatch (used by combine_recv).
      num_tokens:   [] int32, rows at or past it are ignored / zero in combine's output.
      topk_ids:     [T, K] int32 physical expert ids as dispatched (after `expert_map`, before the
                    rank mask); combine's backward (the FFI backends' rule, split halves or
                    one-shot) dispatches them again.
      placement:    the backend's record of where each pair went and where each received row
                    came from (a pytree of int32 arrays whose type the backend defines, e.g.
                    `jax_moe_a2a.backends.ffi.FfiPlacement`).
      rank_mask:    [N] int32 (1 = alive) of the dispatch, or None without one.
      comm_id:      the communicator that made it (static).
    """

    topk_weights: Any
    num_tokens: Any
    topk_ids: Any
    placement: Any
    rank_mask: Optional[Any] = None
    comm_id: int = 0


@pytree(meta=("slot", "comm_id"))
class DispatchHandle:
    """In-flight dispatch, from `dispatch_send` to `dispatch_recv` (pass it on unchanged).

    Fields:
      wire:        the backend's in-flight record (a pytree whose type the backend defines: the
                   wire buffers, or a small token array of the FFI backends).
      route:       `Route` of this dispatch.
      num_dropped: [] int32 pairs this rank could not route (bad expert ids; not masked ones).
      num_masked:  [] int32 pairs the rank mask stopped, or None without a mask.
      tokens_given: [] int32 `num_tokens` as given when it is a device array, before it was
                   clamped to [0, T] (route.num_tokens); None when given as an int or left out.
      x:           [T, H] the dispatched rows as given (what the gradient of `dispatch_recv`
                   flows back to; never read by the forward).
      bad_pair:    [5] int32 debug=True's first bad pair (jax_moe_a2a.debug.first_bad_pair: with
                   an expert map, of the logical ids as given), or None (debug=False).
      slot:        static buffer slot; comm_id: the communicator that made it.
    """

    wire: Any
    route: Route
    num_dropped: Any
    num_masked: Optional[Any] = None
    tokens_given: Optional[Any] = None
    x: Optional[Any] = None
    slot: int = 0
    comm_id: int = 0
    bad_pair: Optional[Any] = None


@pytree(meta=("slot", "comm_id"))
class Dispatched:
    """What a rank receives from dispatch (the `got` of the examples).

    Fields (ragged layout / expert_major layout):
      x:           [R, H] / [L, C, H] in Spec.dispatch_dtype (Spec.recv_dtype when set: fp8
                   rows dequantised on receive); rows sorted by local expert. Rows past the
                   counts are unspecified.
      scale:       [R, S] / [L, C, S] f32 fp8 block scales (x ~= x * scale per block), or None
                   when dispatch is 16/32-bit or Spec.recv_dtype is set.
      group_sizes: [L] int32 rows per local expert (ragged: `jax.lax.ragged_dot`'s group_sizes;
                   expert_major: valid rows of each [C, H] slab).
      weights:     [R] / [L, C] f32 router weight of each received row (0 past the counts).
      src:         [R, 2] / [L, C, 2] int32 (source rank, source token index) of each row,
                   -1 past the counts.
      num_dropped: [] int32 pairs this rank could not route (expert id out of range or repeated
                   within its token); they contribute nothing to combine.
      num_overflow: [] int32 rows that arrived at this rank beyond its capacity (dropped).
      num_masked:  [] int32 pairs this rank did not send because the `rank_mask` of the dispatch
                   masks their expert's rank (or this rank); None when no mask was given.
      route:       `Route` for combine (pass `got` to `combine_send`).
    """

    x: Any
    scale: Optional[Any]
    group_sizes: Any
    weights: Any
    src: Any
    num_dropped: Any
    num_overflow: Any
    route: Route
    slot: int = 0
    comm_id: int = 0
    num_masked: Optional[Any] = None


@pytree(meta=("slot", "comm_id"))
class CombineHandle:
    """In-flight combine, from `combine_send` to `combine_recv`.

    Fields:
      wire:  the backend's in-flight record (a pytree whose type the backend defines).
      route: the dispatch's `Route` (weights, num_tokens, where each pair went).
      y:     the expert outputs as sent (what the gradient of `combine_recv` flows back to).
      got:   the `Dispatched` they answer (its weights and sources, for that gradient).
      slot:  static buffer slot; comm_id: the communicator that made it.
    """

    wire: Any
    route: Route
    y: Optional[Any] = None
    got: Optional[Any] = None
    slot: int = 0
    comm_id: int = 0

