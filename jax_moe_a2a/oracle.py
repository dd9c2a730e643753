"""The NumPy oracle: from every rank's inputs, every rank's expected outputs. No collectives.

The canonical arrangement (what every backend produces, and what `recv_capacity` drops):
received rows are ordered by (local expert, source rank, source token index); a pair (t, k) of
DP group g is sent by member g * tp + t % tp; a token id repeated within its row is routed once;
ids outside [0, E) other than -1 are dropped and counted. Ragged: rows at canonical position >=
R are dropped. expert_major: rows at index >= C within their expert are dropped.

Redundant experts (EPLB, `expert_map=`): the logical ids are first mapped to physical ones by
`map_experts` (the rule of jax_moe_a2a/eplb.py, in NumPy), then everything above applies.

Rank mask (elastic EP, `rank_mask=`, [N] bool or int, nonzero = alive): the map skips replicas on
masked ranks while a live one exists (eplb.py); then a routed pair whose destination rank is
masked, or whose sending rank is masked, is not sent: it is counted in `num_masked` of the
sending rank (not in num_dropped) and contributes nothing to combine. A masked rank receives
nothing, and its combine output is 0 (or `out`). `mask_pairs` applies it to the inputs.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, List, Optional

import ml_dtypes
import numpy as np

from .spec import Spec

FP8 = ml_dtypes.float8_e4m3fn
_INV_448 = np.float32(1.0) / np.float32(448.0)


def round_bf16(a) -> np.ndarray:
    """a (any float array) rounded to bfloat16 through f32 (nearest, ties to even), as float64."""
    return np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)


def num_blocks(h: int, block: int) -> int:
    """Scales per row: ceil(h / block) (the last block is partial when block does not divide h)."""
    if block <= 0:
        raise ValueError(f"block must be a positive int, got {block}")
    return -(-h // block)


def quantize_fp8(x: np.ndarray, block: int = 128, pow2: bool = False):
    """x [rows, H] float -> (q [rows, H] float8_e4m3fn, scale [rows, ceil(H/block)] f32).

    Block b covers values [b * block, min((b + 1) * block, H)): when block does not divide H the
    last block is partial and its scale comes from its own values only. A NaN or +-Inf value is
    left out of its block's amax and quantises to the e4m3fn NaN 0x7F (sign bit clear)."""
    x = np.asarray(x).astype(np.float32)
    rows, h = x.shape
    nb = num_blocks(h, block)
    xp = np.pad(x, ((0, 0), (0, nb * block - h)))  # zeros: |0| never raises a block's amax
    xb = xp.reshape(rows, nb, block)
    finite = np.isfinite(xb)
    xb = np.where(finite, xb, np.float32(0.0))
    amax = np.max(np.abs(xb), axis=-1)
    scale = (np.maximum(amax, np.float32(1e-12)) * _INV_448).astype(np.float32)
    if pow2:
        b = scale.view(np.uint32)
        up = (b & np.uint32(0x7F800000)) + np.uint32(0x00800000)
        scale = np.where((b & np.uint32(0x007FFFFF)) != 0, up, b).astype(np.uint32).view(np.float32)
    inv = (np.float32(1.0) / scale).astype(np.float32)
    q = np.clip(xb * inv[..., None], -448.0, 448.0).astype(FP8)
    q.view(np.uint8)[~finite] = 0x7F  # the e4m3fn NaN
    return np.ascontiguousarray(q.reshape(rows, nb * block)[:, :h]), scale


def dequantize_fp8(q, scale, block: int = 128) -> np.ndarray:
    """q [..., H] e4m3fn, scale [..., ceil(H/block)] f32 -> [..., H] f32 (value h uses scale h // block)."""
    q = np.asarray(q)
    h = q.shape[-1]
    s = np.repeat(np.asarray(scale, np.float32), block, axis=-1)[..., :h]
    return q.astype(np.float32) * s


@dataclasses.dataclass
class RankInputs:
    """One rank's dispatch inputs: x [T, H] (float, or fp8 with x_scale [T, S]), topk_ids [T, K]
    int32, topk_weights [T, K] f32, num_tokens int."""

    x: np.ndarray
    topk_ids: np.ndarray
    topk_weights: np.ndarray
    num_tokens: int
    x_scale: Optional[np.ndarray] = None


@dataclasses.dataclass
class RankDispatch:
    """One rank's expected dispatch outputs (same fields as `jax_moe_a2a.Dispatched`), plus
    `rows`: list over local experts of [(src rank, token)] in canonical order (kept rows only)."""

    x: np.ndarray
    scale: Optional[np.ndarray]
    group_sizes: np.ndarray
    weights: np.ndarray
    src: np.ndarray
    num_dropped: int
    num_overflow: int
    rows: list
    num_masked: int = 0  # pairs this rank did not send because of the rank mask


def _wire(spec: Spec, inp: RankInputs):
    """The rows as they travel: (x [T, H] wire dtype, scale [T, S] or None)."""
    if spec.is_fp8:
        if inp.x_scale is not None:
            return np.asarray(inp.x).astype(FP8), np.asarray(inp.x_scale, np.float32)
        return quantize_fp8(inp.x, spec.scale_block, spec.pow2_scale)
    return np.asarray(inp.x).astype(spec.dispatch_dtype), None


def map_ids(physical, counts, ids, group: int, num_experts: int, alive=None) -> np.ndarray:
    """Logical ids [T, K] of one rank (DP group `group`) -> physical ids: replica
    (group * T + t) mod counts[e]; -1 stays -1; a logical id outside [0, E_logical), a logical
    expert with no replica, or a chosen entry outside [0, num_experts) -> num_experts.
    alive: optional [N] bool rank mask: the choice is among the replicas not on masked ranks
    (entries outside [0, num_experts) count as live), the mask-free one when none is live."""
    physical, counts = np.asarray(physical), np.asarray(counts)
    ids = np.asarray(ids)
    e_log, m = physical.shape
    out = np.empty(ids.shape, np.int32)
    for t in range(ids.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            if e == -1:
                out[t, k] = -1
                continue
            p = num_experts
            if 0 <= e < e_log:
                c = min(max(int(counts[e]), 0), m)
                if c > 0:
                    j = (group * ids.shape[0] + t) % c
                    if alive is not None:
                        local = num_experts // len(alive)
                        live = [i for i in range(c) if not (0 <= int(physical[e, i]) < num_experts)
                                or alive[int(physical[e, i]) // local]]
                        if live:
                            j = live[(group * ids.shape[0] + t) % len(live)]
                    q = int(physical[e, j])
                    if 0 <= q < num_experts:
                        p = q
            out[t, k] = p
    return out


def alive_of(rank_mask, n: int) -> Optional[np.ndarray]:
    """[n] bool from a rank mask (bool or int, nonzero = alive), or None."""
    if rank_mask is None:
        return None
    alive = np.asarray(rank_mask).reshape(-1) != 0
    if alive.shape != (n,):
        raise ValueError(f"rank_mask: expected shape [{n}], got {list(np.shape(rank_mask))}")
    return alive


def map_experts(spec: Spec, inputs: List[RankInputs], expert_map, rank_mask=None) -> List[RankInputs]:
    """inputs with logical topk_ids replaced by the physical ids `expert_map` gives (an
    `ExpertMap` or a (physical, counts) pair), skipping replicas on ranks `rank_mask` masks;
    None: inputs unchanged."""
    if expert_map is None:
        return inputs
    alive = alive_of(rank_mask, len(inputs))
    physical, counts = (expert_map.physical, expert_map.counts) if hasattr(expert_map, "physical") else expert_map
    return [dataclasses.replace(inp, topk_ids=map_ids(physical, counts, inp.topk_ids, r // spec.tp_size,
                                                      spec.num_experts, alive))
            for r, inp in enumerate(inputs)]


def mask_pairs(spec: Spec, inputs: List[RankInputs], rank_mask):
    """(inputs, masked): the (physical) ids of pairs that the rank mask stops (destination rank
    masked, or the token's sender, member g * tp + t % tp, masked) replaced by E, so that nothing
    routes them; masked[r] = routed pairs rank r would have sent (its tp member's tokens) and
    does not. None: unchanged."""
    n = len(inputs)
    alive = alive_of(rank_mask, n)
    if alive is None:
        return inputs, [0] * n
    l_count = spec.local_experts(n)
    tp = spec.tp_size
    out, masked = [], []
    for r, inp in enumerate(inputs):
        ids = np.asarray(inp.topk_ids)
        routed, _ = routed_pairs(spec, inp)
        in_range = (ids >= 0) & (ids < spec.num_experts)
        sender = r // tp * tp + np.arange(ids.shape[0]) % tp
        stop = in_range & ~(alive[np.clip(ids, 0, spec.num_experts - 1) // l_count] & alive[sender][:, None])
        mine = (np.arange(ids.shape[0]) % tp == r % tp)[:, None]
        masked.append(int(np.sum(routed & stop & mine)))
        out.append(dataclasses.replace(inp, topk_ids=np.where(stop, spec.num_experts, ids).astype(np.int32)))
    return out, masked


def routed_pairs(spec: Spec, inp: RankInputs):
    """(routed [T, K] bool, bad [T, K] bool), as documented in the module docstring."""
    ids = np.asarray(inp.topk_ids)
    t, k = ids.shape
    active = (np.arange(t) < inp.num_tokens)[:, None]
    in_range = (ids >= 0) & (ids < spec.num_experts)
    dup = np.zeros_like(in_range)
    for j in range(k):
        for i in range(j):
            dup[:, j] |= ids[:, i] == ids[:, j]
    routed = active & in_range & ~dup
    bad = active & (ids != -1) & ~routed
    return routed, bad


def dispatch(spec: Spec, inputs: List[RankInputs], expert_map=None, rank_mask=None) -> List[RankDispatch]:
    """Every rank's expected `Dispatched`. inputs[r] is rank r's inputs (members of one tp group
    should hold identical inputs; member s sends the tokens t with t % tp == s % tp).
    expert_map: logical -> physical map applied first (see `map_experts`).
    rank_mask: [N] alive flags (module docstring): pairs to or from masked ranks not sent."""
    inputs = map_experts(spec, inputs, expert_map, rank_mask)
    inputs, masked = mask_pairs(spec, inputs, rank_mask)
    n = len(inputs)
    l_count = spec.local_experts(n)
    tp = spec.tp_size
    wire = [_wire(spec, inp) for inp in inputs]
    pairs = [routed_pairs(spec, inp) for inp in inputs]
    # incoming[e][l] = canonical list of (src, t, k)
    incoming = [[[] for _ in range(l_count)] for _ in range(n)]
    dropped = [0] * n
    for s in range(n):
        routed, bad = pairs[s]
        member_mask = (np.arange(routed.shape[0]) % tp == s % tp)[:, None]
        dropped[s] = int(np.sum(bad & member_mask)) - masked[s]
        ids = np.asarray(inputs[s].topk_ids)
        for t in range(routed.shape[0]):
            if t % tp != s % tp:
                continue
            for k in range(routed.shape[1]):
                if routed[t, k]:
                    e, l = divmod(int(ids[t, k]), l_count)
                    incoming[e][l].append((s, t, k))
    out = []
    h, sc = spec.hidden, spec.num_scales
    cap = spec.recv_rows(n)
    for e in range(n):
        shape = spec.recv_shape(n)
        size = int(np.prod(shape))
        x = np.zeros((size, h), dtype=FP8 if spec.is_fp8 else spec.dispatch_dtype)
        scale = np.zeros((size, sc), np.float32) if spec.is_fp8 else None
        weights = np.zeros(size, np.float32)
        src = np.full((size, 2), -1, np.int32)
        sizes = np.zeros(l_count, np.int32)
        rows = []
        overflow = 0
        pos = 0
        for l in range(l_count):
            kept = []
            for j, (s, t, k) in enumerate(incoming[e][l]):
                if spec.layout == "ragged":
                    p, ok = pos, pos < cap
                    pos += 1
                else:
                    p, ok = l * cap + j, j < cap
                if not ok:
                    overflow += 1
                    continue
                x[p] = wire[s][0][t]
                if scale is not None:
                    scale[p] = wire[s][1][t]
                weights[p] = inputs[s].topk_weights[t, k]
                src[p] = (s, t)
                kept.append((s, t))
            sizes[l] = len(kept)
            rows.append(kept)
        out.append(RankDispatch(x.reshape(*shape, h), None if scale is None else scale.reshape(*shape, sc),
                                sizes, weights.reshape(shape), src.reshape(*shape, 2), dropped[e], overflow, rows,
                                masked[e]))
    return out


def combine(spec: Spec, inputs: List[RankInputs], expert_fn: Callable, y_dtype,
            out: Optional[List[np.ndarray]] = None, expert_map=None, rank_mask=None) -> List[np.ndarray]:
    """Every rank's expected `combine_recv` output [T, H] (combine_dtype).

    expert_fn(rows_f32 [n, H], local_expert int) -> [n, H]: the expert applied to dequantised
    received rows, rounded to Spec.recv_dtype when set (the test applies the same function in
    JAX); its result is cast to y_dtype and, when y_dtype is wider than spec.combine_dtype, to the
    combine dtype (as the expert output travels: `Spec.combine_wire_dtype`), then summed in f32
    with the router weights.
    expert_map: logical -> physical map applied first (expert_fn sees physical local experts).
    rank_mask: [N] alive flags: pairs to or from masked ranks contribute nothing; a masked rank's
    output is 0 (or `out`).
    """
    inputs = map_experts(spec, inputs, expert_map, rank_mask)
    inputs, _ = mask_pairs(spec, inputs, rank_mask)
    wire = spec.combine_wire_dtype(y_dtype)
    n = len(inputs)
    l_count = spec.local_experts(n)
    tp = spec.tp_size
    got = dispatch(spec, inputs)
    kept = set()
    for e in range(n):
        for l, rows in enumerate(got[e].rows):
            for s, t in rows:
                kept.add((s, t, e * l_count + l))
    routed_all = [routed_pairs(spec, inp)[0] for inp in inputs]
    rows_all = []
    for inp in inputs:
        xw, xs = _wire(spec, inp)
        rows = dequantize_fp8(xw, xs, spec.scale_block) if spec.is_fp8 else xw.astype(np.float32)
        if spec.recv_dtype is not None:  # what the experts see: the dequantised rows in recv_dtype
            rows = rows.astype(spec.recv_dtype).astype(np.float32)
        rows_all.append(rows)
    alive = alive_of(rank_mask, n)
    results = []
    for r in range(n):
        g0 = r // tp * tp
        inp = inputs[r]
        t_count = inp.topk_ids.shape[0]
        acc = np.zeros((t_count, spec.hidden), np.float32)
        for t in range(min(inp.num_tokens, t_count) if alive is None or alive[r] else 0):
            s = g0 + t % tp
            routed, row = routed_all[s], rows_all[s][t]
            for k in range(inp.topk_ids.shape[1]):
                ex = int(inputs[s].topk_ids[t, k])
                if routed[t, k] and (s, t, ex) in kept:
                    y = np.asarray(expert_fn(row[None], ex % l_count)).astype(y_dtype)
                    y = y.astype(wire).astype(np.float32)[0]
                    acc[t] += np.float32(inputs[s].topk_weights[t, k]) * y
        if out is not None:
            acc = acc + np.asarray(out[r]).astype(np.float32)
        results.append(acc.astype(spec.combine_dtype))
    return results
