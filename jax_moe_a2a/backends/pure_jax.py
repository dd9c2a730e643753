"""Pieces shared by the pure-JAX backends (`reference`, `ragged`): which pairs are routed, their
order on the wire, fp8 quantisation, the receive-side layout and the combine reduction.

Everything here runs inside `jax.shard_map` on one rank's shard; no communication.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from .. import quant
from ..routing import routed_pairs


class Pairs(NamedTuple):
    """Every (token, k) pair of one rank, all [T, K]: member = t % tp sends it; dest = the rank of
    its expert (N if not routed); local = the expert on dest; slot = its index among the pairs
    of (member, dest), which are ordered by (local, token)."""
    routed: jax.Array   # bool
    bad: jax.Array      # bool, counted as dropped
    tok: jax.Array      # int32 token index
    member: jax.Array   # int32 in [0, tp)
    dest: jax.Array     # int32 in [0, N]
    local: jax.Array    # int32 in [0, L)
    slot: jax.Array     # int32


def sort_pairs(spec, num_ranks, topk_ids, num_tokens, who="pure-JAX backend") -> Pairs:
    """Orders the pairs for the wire: by (member, dest, local expert, token)."""
    n = num_ranks
    t_count, k = topk_ids.shape
    l_count = spec.local_experts(n)
    tp = spec.tp_size
    routed, bad = routed_pairs(spec, topk_ids, num_tokens)
    tok = jnp.broadcast_to(jnp.arange(t_count, dtype=jnp.int32)[:, None], (t_count, k))
    member = tok % tp
    dest = jnp.where(routed, topk_ids // l_count, n).astype(jnp.int32)   # n: not routed
    local = jnp.where(routed, topk_ids % l_count, 0).astype(jnp.int32)
    if tp * (n + 1) * l_count * t_count >= 2**31:
        raise ValueError(f"{who}: tp * (N + 1) * L * T must stay below 2^31")
    group = member * (n + 1) + dest
    key = ((group * l_count + local) * t_count + tok).reshape(-1)
    order = jnp.argsort(key, stable=True)
    sorted_group = group.reshape(-1)[order]
    first = jnp.searchsorted(sorted_group, sorted_group, side="left")
    rank_in_group = jnp.arange(t_count * k, dtype=jnp.int32) - first.astype(jnp.int32)
    slot = jnp.zeros(t_count * k, jnp.int32).at[order].set(rank_in_group).reshape(t_count, k)
    return Pairs(routed, bad, tok, member, dest, local, slot)


def wire_rows(spec, x, x_scale):
    """x [T, H] -> (rows [T, H] in dispatch dtype, scales [T, S] f32 or None); quantises to fp8
    unless x is already fp8 (then x_scale is passed through)."""
    if not spec.is_fp8:
        return x.astype(spec.dispatch_dtype), None
    if x_scale is None:
        return quant.quantize_fp8_jax(x, spec.scale_block, spec.pow2_scale)
    return x, x_scale


def lay_out(spec, num_ranks, valid, src, idx, local, tok, w, x, scale):
    """Places received rows into `Dispatched`'s layout, exactly as the oracle does.

    Rows come in any order and any leading shape [...]: valid (bool), src (sending rank), idx
    (the row's index among the rows from src, which are sorted by (local expert, token)), local,
    tok (token index on src), w (f32 weight) all [...]; x [..., H]; scale [..., S] f32 or None.
    Returns (x, scale|None, group_sizes [L], weights, src [..., 2], num_overflow [], recv_pos
    [R'] int32: each input row's flat index in the layout, -1 if invalid or overflowed), the
    outputs shaped by Spec.recv_shape.
    """
    n = num_ranks
    l_count = spec.local_experts(n)
    valid, src, idx, local, tok, w = (a.reshape(-1) for a in (valid, src, idx, local, tok, w))
    x = x.reshape(valid.shape[0], -1)
    seg = jnp.where(valid, src * l_count + local, n * l_count)
    counts = jax.ops.segment_sum(valid.astype(jnp.int32), seg,
                                 num_segments=n * l_count + 1)[:-1].reshape(n, l_count)
    start_in_src = jnp.cumsum(counts, axis=1) - counts        # [N, L]
    before_src = jnp.cumsum(counts, axis=0) - counts          # [N, L]
    total = jnp.sum(counts, axis=0)                           # [L]
    lc, sc = jnp.where(valid, local, 0), jnp.where(valid, src, 0)
    j = before_src[sc, lc] + idx - start_in_src[sc, lc]       # index within the expert
    cap = spec.recv_rows(n)
    if spec.layout == "ragged":
        offs = jnp.cumsum(total) - total
        pos = offs[lc] + j
        keep = valid & (pos < cap)
        group_sizes = jnp.clip(offs + total, 0, cap) - jnp.clip(offs, 0, cap)
        size = cap
    else:
        keep = valid & (j < cap)
        pos = lc * cap + j
        group_sizes = jnp.minimum(total, cap)
        size = l_count * cap
    pos = jnp.where(keep, pos, size).astype(jnp.int32)        # size: out of bounds -> dropped
    shape = spec.recv_shape(n)

    def place(rows, fill, dtype):
        out = jnp.full((size,) + rows.shape[1:], fill, dtype).at[pos].set(rows, mode="drop")
        return out.reshape(*shape, *rows.shape[1:])

    out_x = place(x, 0, x.dtype)
    out_scale = None if scale is None else place(scale.reshape(pos.shape[0], -1), 0, jnp.float32)
    weights = place(w, 0, jnp.float32)
    out_src = place(jnp.stack([src, tok], axis=-1).astype(jnp.int32), -1, jnp.int32)
    num_overflow = jnp.sum(valid & ~keep, dtype=jnp.int32)
    recv_pos = jnp.where(keep, pos, -1)
    return out_x, out_scale, group_sizes.astype(jnp.int32), weights, out_src, num_overflow, recv_pos


def reduce_pairs(spec, route, routed, rows, out, pairs):
    """The end of every pure-JAX combine_recv: rows [T, K, H] (expert outputs of each pair,
    garbage where not routed), routed [T, K] bool -> sum_k w * row in f32, masked past
    num_tokens, plus `out`, cast to combine_dtype; with pairs=True also the rows [T, K, H] f32."""
    t_count = rows.shape[0]
    rows = jnp.where(routed[..., None], rows.astype(jnp.float32), 0.0)   # never 0 * inf
    w = jnp.where(routed, route.topk_weights.astype(jnp.float32), 0.0)
    acc = jnp.einsum("tk,tkh->th", w, rows)
    active = (jnp.arange(t_count) < route.num_tokens)[:, None]
    acc = jnp.where(active, acc, 0.0)
    if out is not None:
        acc = acc + out.astype(jnp.float32)
    acc = acc.astype(spec.combine_dtype)
    return (acc, jnp.where(active[..., None], rows, 0.0)) if pairs else acc
