"""`reference` backend: pure JAX, `jax.lax.all_to_all` with worst-case padding.

The JAX-native baseline of every benchmark and a second opinion in tests. Differentiable by JAX
autodiff (gathers, scatters and all_to_all all have transposes).

Wire format (per rank): dispatch sends [N, P] rows per peer, P = ceil(T/tp) * min(K, L) (the
worst case), with per-row metadata (local expert, token index, weight); combine sends back
[N, tp, P] rows so that every member of the source's tp group gets every output.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import jax.numpy as jnp

from ..types import pytree
from .base import Backend, Ctx, Received, Sent
from .pure_jax import lay_out, reduce_pairs, sort_pairs, wire_rows


@pytree
class ReferenceWire:
    """dispatch_send -> dispatch_recv: what arrived from each source, [N(src), P] rows: x [.., H],
    local expert, token, weight (-1 / 0 where no row), fp8 scales [.., S] or None."""

    x: Any
    local: Any
    tok: Any
    w: Any
    scale: Optional[Any] = None


@pytree
class ReferencePlacement:
    """dest [T, K] (N if not routed), slot [T, K] (row among the rows to dest); after
    dispatch_recv, recv_pos [N(src), P]: each arrived row's index in the layout (-1: none)."""

    dest: Any
    slot: Any
    recv_pos: Optional[Any] = None


def _a2a(x, axis):
    """x [N, ...]: chunk i goes to rank i; result [N, ...], chunk s came from rank s."""
    return jax.lax.all_to_all(x, axis, 0, 0, tiled=True)


class ReferenceBackend(Backend):
    name = "reference"
    autodiff = True
    xla_collectives = True

    def buffer_regions(self, config):
        """XLA temporaries (not pinned): send and receive copies of the dispatch rows (payload,
        scales, expert, token, weight) and of the combine rows."""
        c = config
        p = -(-c.max_tokens_per_rank // c.tp_size) * min(c.experts_per_token, c.local_experts)
        wire = c.num_ranks * p * (c.hidden * c.dispatch_dtype.itemsize + 4 * c.num_scales + 12)
        back = c.num_ranks * c.tp_size * p * c.hidden * 4
        return {"dispatch_rows": 2 * wire, "combine_rows": 2 * back}

    # -- dispatch ------------------------------------------------------------------------------
    def dispatch_send(self, ctx: Ctx, x, x_scale, topk_ids, topk_weights, num_tokens, slot, after=None,
                      rank_mask=None) -> Sent:
        spec, n = ctx.spec, ctx.num_ranks
        t_count, k = topk_ids.shape
        p = spec.rows_per_peer(n)
        pr = sort_pairs(spec, n, topk_ids, num_tokens, "reference backend")
        mine = pr.routed & (pr.member == ctx.rank % spec.tp_size)
        dest_mine = jnp.where(mine, pr.dest, n).reshape(-1)       # out of bounds -> dropped
        slot_flat = pr.slot.reshape(-1)
        local, tok, slot_of = pr.local, pr.tok, pr.slot
        xq, xs = wire_rows(spec, x, x_scale)

        rows = jnp.repeat(jnp.arange(t_count), k)
        send_x = jnp.zeros((n, p, spec.hidden), xq.dtype).at[dest_mine, slot_flat].set(xq[rows], mode="drop")
        meta_local = jnp.full((n, p), -1, jnp.int32).at[dest_mine, slot_flat].set(local.reshape(-1), mode="drop")
        meta_tok = jnp.full((n, p), -1, jnp.int32).at[dest_mine, slot_flat].set(tok.reshape(-1), mode="drop")
        meta_w = jnp.zeros((n, p), jnp.float32).at[dest_mine, slot_flat].set(
            topk_weights.reshape(-1).astype(jnp.float32), mode="drop")

        scale = None
        if xs is not None:
            send_s = jnp.zeros((n, p, spec.num_scales), jnp.float32).at[dest_mine, slot_flat].set(
                xs[rows], mode="drop")
            scale = _a2a(send_s, ctx.axis)
        wire = ReferenceWire(_a2a(send_x, ctx.axis), _a2a(meta_local, ctx.axis), _a2a(meta_tok, ctx.axis),
                             _a2a(meta_w, ctx.axis), scale)
        num_dropped = jnp.sum(pr.bad & (pr.member == ctx.rank % spec.tp_size), dtype=jnp.int32)
        return Sent(wire, ReferencePlacement(pr.dest, slot_of), num_dropped)

    def dispatch_recv(self, ctx: Ctx, wire: ReferenceWire, placement: ReferencePlacement, slot, rank_mask=None):
        spec, n = ctx.spec, ctx.num_ranks
        p = spec.rows_per_peer(n)
        local = wire.local                                        # [N(src), P]
        src = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32)[:, None], (n, p))
        idx = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32)[None, :], (n, p))
        x, scale, sizes, weights, src, num_overflow, pos = lay_out(
            spec, n, local >= 0, src, idx, local, wire.tok, wire.w, wire.x, wire.scale)
        return Received(x, scale, sizes, weights, src, num_overflow,
                        dataclasses.replace(placement, recv_pos=pos.reshape(n, p)))

    # -- combine -------------------------------------------------------------------------------
    def combine_send(self, ctx: Ctx, y, route, slot, after=None, from_slot=None):
        spec, n = ctx.spec, ctx.num_ranks
        tp = spec.tp_size
        flat = y.reshape(-1, spec.hidden)
        pos = route.placement.recv_pos                            # [N(src), P]
        rows = jnp.where((pos >= 0)[..., None], flat[jnp.maximum(pos, 0)], jnp.zeros((), flat.dtype))
        # To rank d go the rows of every member of d's tp group: [N(dest), tp, P, H].
        members = (jnp.arange(n) // tp * tp)[:, None] + jnp.arange(tp)[None, :]
        return _a2a(rows[members], ctx.axis)                      # the wire: the rows as they arrive

    def combine_recv(self, ctx: Ctx, wire, route, slot, out, pairs=False):
        spec, n = ctx.spec, ctx.num_ranks
        tp = spec.tp_size
        back = wire                                               # [N(expert rank), tp, P, H]
        dest = route.placement.dest                               # [T, K], n if not routed
        slot_of = route.placement.slot
        member = (jnp.arange(dest.shape[0]) % tp)[:, None]
        rows = back[jnp.minimum(dest, n - 1), jnp.broadcast_to(member, dest.shape), slot_of]  # [T, K, H]
        return reduce_pairs(spec, route, dest < n, rows, out, pairs)
