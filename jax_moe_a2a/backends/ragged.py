"""`ragged` backend: pure JAX, `jax.lax.ragged_all_to_all`, only the routed rows on the wire.

The second JAX-native baseline (next to `reference`'s padded `all_to_all`). Same outputs as the
oracle; differentiable by JAX autodiff (ragged_all_to_all has a transpose: the reverse exchange).
XLA:CPU does not implement ragged-all-to-all, so the backend is unavailable on CPU devices.

Dispatch, per rank r (tp member m = r % tp):
  1. the pairs member m sends are sorted by (dest, local expert, token) into a send buffer
     [Ms, H], Ms = ceil(T/tp) * K; counts[d] rows go to rank d;
  2. one all_gather of counts gives every rank the matrix C [N(src), N(dest)];
  3. one ragged_all_to_all per array (rows, and f32 metadata rows (weight, local, token, fp8
     scales)) moves C[r, d] rows to d, packed there by source: rows from s start at
     sum_{s' < s} C[s', d] of d's receive buffer [N * P, H] (P = rows_per_peer, the worst case);
  4. the receiver lays the packed rows out like `reference` (pure_jax.lay_out).
Combine is the reverse exchange: expert rank e sends every member m' of d's tp group the rows m'
sent it, into block m' % tp of d's buffer [tp * Ms, H], at the offset they had in m''s send buffer.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import jax.numpy as jnp

from ..axes import varying
from ..types import pytree
from .base import Backend, Ctx, Received, Sent
from .pure_jax import lay_out, reduce_pairs, sort_pairs, wire_rows


@pytree
class RaggedWire:
    """dispatch_send -> dispatch_recv: the rows as they arrived, packed by source: x [M, H] and
    meta [M, 3 + S] f32 (weight, local expert, token, fp8 scales)."""

    x: Any
    meta: Any


@pytree
class RaggedPlacement:
    """dest, slot [T, K] (as the reference backend's), counts [N(src), N(dest)] int32 (rows each
    rank sent each rank); after dispatch_recv, recv_pos [M]: each arrived row's index in the
    layout (-1: none)."""

    dest: Any
    slot: Any
    counts: Any
    recv_pos: Optional[Any] = None

def unavailable_reason(platforms=None):
    """None if ragged-all-to-all can run on `platforms` (default: JAX's default backend)."""
    platforms = set(platforms or [jax.default_backend()])
    if "cpu" in platforms:
        return (f"XLA:CPU does not implement ragged-all-to-all (jax {jax.__version__}: 'HLO opcode "
                f"ragged-all-to-all is not supported by XLA:CPU'); use the ragged backend on GPU devices")
    return None


def send_rows(spec):
    """Ms: rows of one rank's dispatch send buffer, ceil(T / tp) * K (every pair of its tokens)."""
    return spec.tokens_per_member() * spec.experts_per_token


def plan(counts, rank, tp, m_send):
    """The ragged_all_to_all arguments of rank `rank`, from counts [N, N] int32 (C[s, d]: rows
    rank s sends rank d, same on every rank). Returns two (input_offsets, send_sizes,
    output_offsets, recv_sizes) tuples of int32 vectors:
      dispatch: [N], slice d to rank d: C[rank, d] rows from send_off[rank, d] to recv_off[rank, d];
      combine: [N * tp], slice d * tp + j to rank d: the C[m, rank] rows that member
        m = d // tp * tp + j sent (at recv_off[m, rank] here) to j * m_send + send_off[m, rank].
    send_off[s, d] = sum_{d' < d} C[s, d'] (s's send buffer); recv_off[s, d] = sum_{s' < s} C[s', d]
    (d's receive buffer)."""
    n = counts.shape[0]
    send_off = jnp.cumsum(counts, axis=1) - counts
    recv_off = jnp.cumsum(counts, axis=0) - counts
    dispatch = (send_off[rank], counts[rank], recv_off[rank], counts[:, rank])
    d = jnp.repeat(jnp.arange(n), tp)
    j = jnp.tile(jnp.arange(tp), n)
    m = d // tp * tp + j                                  # the member whose rows slice i carries
    mine = rank // tp * tp + j                            # receiving: my group's member j, from rank d
    combine = (recv_off[m, rank], counts[m, rank], j * m_send + send_off[m, rank], counts[mine, d])
    return tuple(a.astype(jnp.int32) for a in dispatch), tuple(a.astype(jnp.int32) for a in combine)


class RaggedBackend(Backend):
    """collective: a function with `jax.lax.ragged_all_to_all`'s signature and semantics to use in
    its place (default: that collective, checked to exist on the mesh's platforms); with one given,
    the backend runs wherever that function does (e.g. tests/ragged_emulation.py's, built from
    dense all_to_all, on XLA:CPU)."""

    name = "ragged"
    autodiff = True
    xla_collectives = True

    def __init__(self, collective=None):
        self._collective = collective

    def open(self, config, mesh, axis, comm_id):
        reason = None if self._collective is not None else unavailable_reason({d.platform for d in mesh.devices.flat})
        if reason is not None:
            raise ValueError(f"backend 'ragged' is not available on this mesh: {reason}")
        self.config = config

    def buffer_regions(self, config):
        """XLA temporaries (not pinned): the dispatch rows sent and received (payload, weight,
        local expert, token, scales) and the combine rows."""
        c = config
        per_member = -(-c.max_tokens_per_rank // c.tp_size)
        m_send = per_member * c.experts_per_token                 # send_rows
        m_recv = c.num_ranks * per_member * min(c.experts_per_token, c.local_experts)  # worst_case_rows
        meta = 4 * (3 + c.num_scales)                             # (weight, local, token, scales)
        wire = (m_send + m_recv) * (c.hidden * c.dispatch_dtype.itemsize + meta)
        back = (m_recv + c.tp_size * m_send) * c.hidden * 4
        return {"dispatch_rows": wire, "combine_rows": back}

    def _exchange(self, ctx, operand, rows, args):
        """ragged_all_to_all of operand [M, ...] into a fresh zero buffer [rows, ...]."""
        out = jnp.zeros((rows,) + operand.shape[1:], operand.dtype)
        operand, out, *args = varying((operand, out) + tuple(args), ctx.axis)
        collective = self._collective or jax.lax.ragged_all_to_all
        return collective(operand, out, *args, axis_name=ctx.axis)

    # -- dispatch ------------------------------------------------------------------------------
    def dispatch_send(self, ctx: Ctx, x, x_scale, topk_ids, topk_weights, num_tokens, slot, after=None,
                      rank_mask=None) -> Sent:
        spec, n = ctx.spec, ctx.num_ranks
        t_count, k = topk_ids.shape
        if max(t_count, spec.local_experts(n)) >= 2**24:
            raise ValueError("ragged backend: T and L must stay below 2^24 (sent as exact f32)")
        m_send = send_rows(spec)
        pr = sort_pairs(spec, n, topk_ids, num_tokens, "ragged backend")
        mine = pr.routed & (pr.member == ctx.rank % spec.tp_size)
        counts = jax.ops.segment_sum(mine.reshape(-1).astype(jnp.int32), jnp.where(mine, pr.dest, n).reshape(-1),
                                     num_segments=n + 1)[:n]                   # [N(dest)]
        at = jnp.where(mine, (jnp.cumsum(counts) - counts)[jnp.minimum(pr.dest, n - 1)] + pr.slot, m_send)
        at = at.reshape(-1)                                                    # m_send: dropped
        xq, xs = wire_rows(spec, x, x_scale)
        rows = jnp.repeat(jnp.arange(t_count), k)
        meta = [topk_weights.reshape(-1, 1).astype(jnp.float32), pr.local.reshape(-1, 1).astype(jnp.float32),
                pr.tok.reshape(-1, 1).astype(jnp.float32)] + ([] if xs is None else [xs[rows]])
        send_x = jnp.zeros((m_send, spec.hidden), xq.dtype).at[at].set(xq[rows], mode="drop")
        send_meta = jnp.zeros((m_send, 3 + spec.num_scales), jnp.float32).at[at].set(
            jnp.concatenate(meta, axis=1), mode="drop")

        all_counts = jax.lax.all_gather(counts, ctx.axis, tiled=False).reshape(n, n)   # [N(src), N(dest)]
        args, _ = plan(all_counts, ctx.rank, spec.tp_size, m_send)
        m_recv = spec.worst_case_rows(n)
        wire = RaggedWire(self._exchange(ctx, send_x, m_recv, args), self._exchange(ctx, send_meta, m_recv, args))
        num_dropped = jnp.sum(pr.bad & (pr.member == ctx.rank % spec.tp_size), dtype=jnp.int32)
        return Sent(wire, RaggedPlacement(pr.dest, pr.slot, all_counts), num_dropped)

    def dispatch_recv(self, ctx: Ctx, wire: RaggedWire, placement: RaggedPlacement, slot, rank_mask=None):
        spec, n = ctx.spec, ctx.num_ranks
        recv = placement.counts[:, ctx.rank]                           # rows from each source
        end = jnp.cumsum(recv)
        q = jnp.arange(wire.x.shape[0], dtype=jnp.int32)               # packed by source
        src = jnp.minimum(jnp.searchsorted(end, q, side="right"), n - 1).astype(jnp.int32)
        idx = q - (end - recv)[src]
        meta = wire.meta
        x, scale, sizes, weights, src, num_overflow, pos = lay_out(
            spec, n, q < end[-1], src, idx, meta[:, 1].astype(jnp.int32), meta[:, 2].astype(jnp.int32),
            meta[:, 0], wire.x, meta[:, 3:] if spec.is_fp8 else None)
        return Received(x, scale, sizes, weights, src, num_overflow, dataclasses.replace(placement, recv_pos=pos))

    # -- combine -------------------------------------------------------------------------------
    def combine_send(self, ctx: Ctx, y, route, slot, after=None, from_slot=None):
        spec = ctx.spec
        flat = y.reshape(-1, spec.hidden)
        pos = route.placement.recv_pos                                 # [N * P], packed order
        rows = jnp.where((pos >= 0)[:, None], flat[jnp.maximum(pos, 0)], jnp.zeros((), flat.dtype))
        m_send = send_rows(spec)
        _, args = plan(route.placement.counts, ctx.rank, spec.tp_size, m_send)
        return self._exchange(ctx, rows, spec.tp_size * m_send, args)   # the wire: the rows as they arrive

    def combine_recv(self, ctx: Ctx, wire, route, slot, out, pairs=False):
        spec, n = ctx.spec, ctx.num_ranks
        tp = spec.tp_size
        counts = route.placement.counts
        dest, slot_of = route.placement.dest, route.placement.slot     # [T, K], dest n if not routed
        member = (jnp.arange(dest.shape[0]) % tp)[:, None]
        send_off = jnp.cumsum(counts, axis=1) - counts
        at = member * send_rows(spec) + send_off[ctx.rank // tp * tp + member, jnp.minimum(dest, n - 1)] + slot_of
        rows = wire[jnp.where(dest < n, at, 0)]                        # [T, K, H]
        return reduce_pairs(spec, route, dest < n, rows, out, pairs)
