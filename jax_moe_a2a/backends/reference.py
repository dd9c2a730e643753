"""`reference` backend: pure JAX, `jax.lax.all_to_all` with worst-case padding.

The JAX-native baseline of every benchmark and a second opinion in tests. Differentiable by JAX
autodiff (gathers, scatters and all_to_all all have transposes).

Wire format (per rank): dispatch sends [N, P] rows per peer, P = ceil(T/tp) * min(K, L) (the
worst case), with per-row metadata (local expert, token index, weight); combine sends back
[N, tp, P] rows so that every member of the source's tp group gets every output.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .. import quant
from .base import Backend, Ctx


def _a2a(x, axis):
    """x [N, ...]: chunk i goes to rank i; result [N, ...], chunk s came from rank s."""
    return jax.lax.all_to_all(x, axis, 0, 0, tiled=True)


def routed_pairs(spec, num_ranks, topk_ids, num_tokens):
    """Which (token, k) pairs exist. Returns (routed [T,K] bool, bad [T,K] bool).

    routed: t < num_tokens, 0 <= id < E, and id not repeated earlier in the token's row.
    bad:    t < num_tokens, id != -1 and not routed (counted as dropped).
    """
    t_count, k = topk_ids.shape
    active = (jnp.arange(t_count) < num_tokens)[:, None]
    in_range = (topk_ids >= 0) & (topk_ids < spec.num_experts)
    earlier = jnp.tril(jnp.ones((k, k), bool), -1)  # [k, k'] k' < k
    dup = jnp.any((topk_ids[:, :, None] == topk_ids[:, None, :]) & earlier[None], axis=-1)
    routed = active & in_range & ~dup
    bad = active & (topk_ids != -1) & ~routed
    return routed, bad


class ReferenceBackend(Backend):
    name = "reference"
    autodiff = True

    def buffer_bytes(self, spec, num_ranks):
        p = spec.rows_per_peer(num_ranks)
        wire = num_ranks * p * (spec.token_bytes() + 12)  # + (expert, token, weight) per row
        back = num_ranks * spec.tp_size * p * spec.hidden * 4
        return 2 * (wire + back)  # send and receive copies (XLA temporaries, not pinned)

    # -- dispatch ------------------------------------------------------------------------------
    def dispatch_send(self, ctx: Ctx, x, x_scale, topk_ids, topk_weights, num_tokens, slot, after=None):
        spec, n = ctx.spec, ctx.num_ranks
        t_count, k = topk_ids.shape
        l_count = spec.local_experts(n)
        tp = spec.tp_size
        p = spec.rows_per_peer(n)

        routed, bad = routed_pairs(spec, n, topk_ids, num_tokens)
        tok = jnp.broadcast_to(jnp.arange(t_count, dtype=jnp.int32)[:, None], (t_count, k))
        member = tok % tp
        my_member = ctx.rank % tp
        dest = jnp.where(routed, topk_ids // l_count, n)          # n: not routed
        local = jnp.where(routed, topk_ids % l_count, 0)

        # Slot of each pair inside (member, dest): sorted by (local expert, token).
        if tp * (n + 1) * l_count * t_count >= 2**31:
            raise ValueError("reference backend: tp * (N + 1) * L * T must stay below 2^31")
        group = member * (n + 1) + dest
        key = ((group * l_count + local) * t_count + tok).reshape(-1)
        order = jnp.argsort(key, stable=True)
        sorted_group = group.reshape(-1)[order]
        first = jnp.searchsorted(sorted_group, sorted_group, side="left")
        rank_in_group = jnp.arange(t_count * k, dtype=jnp.int32) - first.astype(jnp.int32)
        slot_of = jnp.zeros(t_count * k, jnp.int32).at[order].set(rank_in_group).reshape(t_count, k)

        mine = routed & (member == my_member)
        dest_mine = jnp.where(mine, dest, n).reshape(-1)          # out of bounds -> dropped
        slot_flat = slot_of.reshape(-1)

        if spec.is_fp8:
            if x_scale is None:
                xq, xs = quant.quantize_fp8_jax(x, spec.scale_block, spec.pow2_scale)
            else:
                xq, xs = x, x_scale
        else:
            xq, xs = x.astype(spec.dispatch_dtype), None

        rows = jnp.repeat(jnp.arange(t_count), k)
        send_x = jnp.zeros((n, p, spec.hidden), xq.dtype).at[dest_mine, slot_flat].set(xq[rows], mode="drop")
        meta_local = jnp.full((n, p), -1, jnp.int32).at[dest_mine, slot_flat].set(local.reshape(-1), mode="drop")
        meta_tok = jnp.full((n, p), -1, jnp.int32).at[dest_mine, slot_flat].set(tok.reshape(-1), mode="drop")
        meta_w = jnp.zeros((n, p), jnp.float32).at[dest_mine, slot_flat].set(
            topk_weights.reshape(-1).astype(jnp.float32), mode="drop")

        arrays = {
            "x": _a2a(send_x, ctx.axis),
            "local": _a2a(meta_local, ctx.axis),
            "tok": _a2a(meta_tok, ctx.axis),
            "w": _a2a(meta_w, ctx.axis),
        }
        if xs is not None:
            send_s = jnp.zeros((n, p, spec.num_scales), jnp.float32).at[dest_mine, slot_flat].set(
                xs[rows], mode="drop")
            arrays["scale"] = _a2a(send_s, ctx.axis)
        route = {"dest": dest.astype(jnp.int32), "slot": slot_of}
        num_dropped = jnp.sum(bad & (member == my_member), dtype=jnp.int32)
        return arrays, route, num_dropped

    def dispatch_recv(self, ctx: Ctx, arrays, route, slot):
        spec, n = ctx.spec, ctx.num_ranks
        l_count = spec.local_experts(n)
        p = spec.rows_per_peer(n)
        local = arrays["local"]                                   # [N(src), P]
        valid = local >= 0
        seg = jnp.where(valid, jnp.arange(n)[:, None] * l_count + local, n * l_count)
        counts = jax.ops.segment_sum(valid.astype(jnp.int32).reshape(-1), seg.reshape(-1),
                                     num_segments=n * l_count + 1)[:-1].reshape(n, l_count)
        start_in_src = jnp.cumsum(counts, axis=1) - counts        # [N, L]
        before_src = jnp.cumsum(counts, axis=0) - counts          # [N, L]
        total = jnp.sum(counts, axis=0)                           # [L]
        lc = jnp.where(valid, local, 0)
        src_ids = jnp.broadcast_to(jnp.arange(n)[:, None], (n, p))
        i = jnp.arange(p)[None, :] - jnp.take_along_axis(start_in_src, lc, axis=1)
        j = jnp.take_along_axis(before_src, lc, axis=1) + i       # index within the expert
        if spec.layout == "ragged":
            cap = spec.recv_rows(n)
            offs = jnp.cumsum(total) - total
            pos = offs[lc] + j
            keep = valid & (pos < cap)
            group_sizes = jnp.clip(offs + total, 0, cap) - jnp.clip(offs, 0, cap)
            size = cap
        else:
            cap = spec.recv_rows(n)
            keep = valid & (j < cap)
            pos = lc * cap + j
            group_sizes = jnp.minimum(total, cap)
            size = l_count * cap
        pos = jnp.where(keep, pos, size).astype(jnp.int32)        # size: out of bounds -> dropped
        flat = pos.reshape(-1)
        shape = spec.recv_shape(n)
        x = jnp.zeros((size, spec.hidden), arrays["x"].dtype).at[flat].set(
            arrays["x"].reshape(n * p, -1), mode="drop").reshape(*shape, spec.hidden)
        scale = None
        if "scale" in arrays:
            scale = jnp.zeros((size, spec.num_scales), jnp.float32).at[flat].set(
                arrays["scale"].reshape(n * p, -1), mode="drop").reshape(*shape, spec.num_scales)
        weights = jnp.zeros((size,), jnp.float32).at[flat].set(arrays["w"].reshape(-1), mode="drop").reshape(shape)
        src_pair = jnp.stack([src_ids, arrays["tok"]], axis=-1).reshape(n * p, 2).astype(jnp.int32)
        src = jnp.full((size, 2), -1, jnp.int32).at[flat].set(src_pair, mode="drop").reshape(*shape, 2)
        num_overflow = jnp.sum(valid & ~keep, dtype=jnp.int32)
        route = dict(route, recv_pos=jnp.where(keep, pos, -1))
        return x, scale, group_sizes.astype(jnp.int32), weights, src, num_overflow, route

    # -- combine -------------------------------------------------------------------------------
    def combine_send(self, ctx: Ctx, y, route, slot, after=None):
        spec, n = ctx.spec, ctx.num_ranks
        tp = spec.tp_size
        flat = y.reshape(-1, spec.hidden)
        pos = route.arrays["recv_pos"]                            # [N(src), P]
        rows = jnp.where((pos >= 0)[..., None], flat[jnp.maximum(pos, 0)], jnp.zeros((), flat.dtype))
        # To rank d go the rows of every member of d's tp group: [N(dest), tp, P, H].
        members = (jnp.arange(n) // tp * tp)[:, None] + jnp.arange(tp)[None, :]
        return {"y": _a2a(rows[members], ctx.axis)}

    def combine_recv(self, ctx: Ctx, arrays, route, slot, out, pairs=False):
        spec, n = ctx.spec, ctx.num_ranks
        tp = spec.tp_size
        back = arrays["y"]                                        # [N(expert rank), tp, P, H]
        dest = route.arrays["dest"]                               # [T, K], n if not routed
        slot_of = route.arrays["slot"]
        t_count, k = dest.shape
        member = (jnp.arange(t_count) % tp)[:, None]
        routed = dest < n
        rows = back[jnp.minimum(dest, n - 1), jnp.broadcast_to(member, dest.shape), slot_of]  # [T, K, H]
        rows = jnp.where(routed[..., None], rows.astype(jnp.float32), 0.0)   # never 0 * inf
        w = jnp.where(routed, route.topk_weights.astype(jnp.float32), 0.0)
        acc = jnp.einsum("tk,tkh->th", w, rows)
        active = (jnp.arange(t_count) < route.num_tokens)[:, None]
        acc = jnp.where(active, acc, 0.0)
        if out is not None:
            acc = acc + out.astype(jnp.float32)
        acc = acc.astype(spec.combine_dtype)
        return (acc, jnp.where(active[..., None], rows, 0.0)) if pairs else acc
