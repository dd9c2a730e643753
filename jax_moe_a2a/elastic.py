"""Elastic EP rank masks: checking a mask, and the send side every backend shares (the pairs a
mask stops). docs/api.md "Elastic EP"; the recovery itself is the backends' (Backend.recover)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .errors import shape_err
from .routing import routed_pairs


def _check_shape(rank_mask, n: int):
    shape, dtype = tuple(rank_mask.shape), np.dtype(rank_mask.dtype)
    if shape != (n,):
        raise shape_err("rank_mask", f"shape [N] = [{n}] (one flag per EP rank)", list(shape))
    if dtype != np.bool_ and not np.issubdtype(dtype, np.integer):
        raise shape_err("rank_mask", "dtype bool or an integer (nonzero = alive)", dtype)


def check_rank_mask(rank_mask, n: int, unsupported):
    """rank_mask ([N] bool/int, nonzero = alive; NumPy, a list, a jax.Array or a tracer) -> int32
    [N] (1 = alive) or None. A concrete all-alive mask is None: the same program as no mask, so
    every backend takes it. Otherwise `unsupported()` (Backend.rank_mask_unsupported) must return
    None, else ValueError with its reason."""
    if rank_mask is None:
        return None
    if not hasattr(rank_mask, "shape") or not hasattr(rank_mask, "dtype"):
        rank_mask = np.asarray(rank_mask)  # a list or tuple
    _check_shape(rank_mask, n)
    try:
        concrete = np.asarray(rank_mask)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError, TypeError):
        concrete = None
    if concrete is not None and concrete.dtype != object and bool(np.all(concrete != 0)):
        return None
    reason = unsupported()
    if reason is not None:
        raise ValueError(reason)
    if concrete is not None and concrete.dtype != object and not bool(np.any(concrete != 0)):
        raise ValueError("rank_mask: every rank is masked (at least the calling ranks must be alive)")
    return (jnp.asarray(rank_mask) != 0).astype(jnp.int32)


def survivors(rank_mask, n: int) -> np.ndarray:
    """The concrete mask of `Communicator.recover` -> int32 [N] NumPy (1 = survivor); ValueError
    for a wrong shape or dtype, or when every rank is masked."""
    mask = np.asarray(rank_mask)
    _check_shape(mask, n)
    alive = (mask != 0).astype(np.int32)
    if not alive.any():
        raise ValueError("rank_mask: every rank is masked (at least the survivors must be alive)")
    return alive


def mask_ids(spec, num_ranks: int, rank, topk_ids, num_tokens, mask):
    """(physical ids with the pairs the mask stops set to E, masked [] int32): a pair is stopped
    when its expert's rank or its sender (the tp member g * tp + t % tp; this rank for its own
    tokens) is masked; counted when routed and this rank sends it. The backend sees E, drops
    the pair and counts it as dropped: the caller subtracts `masked` from that count. Every tp
    member stops the same pairs of the group's tokens, so none reads back a combine row that
    a masked member never sent.

    topk_ids [T, K] int32 physical; num_tokens [] int32; mask [N] int32; rank [] int32."""
    s = spec
    alive = mask != 0
    l_count = s.local_experts(num_ranks)
    routed, _ = routed_pairs(s, topk_ids, num_tokens)
    in_range = (topk_ids >= 0) & (topk_ids < s.num_experts)
    dest = jnp.clip(topk_ids, 0, s.num_experts - 1) // l_count
    tok = jnp.arange(topk_ids.shape[0], dtype=jnp.int32)
    sender = rank // s.tp_size * s.tp_size + tok % s.tp_size
    stop = in_range & ~(alive[dest] & alive[sender][:, None])
    mine = (tok % s.tp_size == rank % s.tp_size)[:, None]
    masked = jnp.sum(routed & stop & mine, dtype=jnp.int32)
    return jnp.where(stop, jnp.int32(s.num_experts), topk_ids).astype(jnp.int32), masked


__all__ = ["check_rank_mask", "survivors", "mask_ids"]
