"""Grouped expert GEMMs over what `dispatch_recv` returns (issue 31): the public API.

One rank's L local experts. Two layouts, told apart by x's rank:
  ragged:       x [R, K], rows sorted by local expert, group_sizes [L] int32 (sum <= R);
                output rows at or past sum(group_sizes) are ZERO.
  expert_major: x [L, C, K], group_sizes = per-expert counts [L] int32 (each <= C);
                output rows c >= counts[l] are ZERO.
Weights are [L, N, K] ("out x in", K contiguous: nn.Linear's layout in DeepSeek-V3 / Kimi-K2
checkpoints). Two dtype paths:
  bf16: x bf16 (f16/f32 accepted by the XLA implementation), w of a 16/32-bit float dtype;
        f32 accumulation; differentiable (jax.custom_vjp, dgrad and wgrad as grouped GEMMs).
  fp8:  x float8_e4m3fn with x_scale f32 [R, K/bk] (ragged) or [L, C, K/bk], w float8_e4m3fn with
        w_scale f32 [L, N/bn, K/bk]:
        y[r, n] = sum_b x_scale[r, b] * w_scale[l, n // bn, b] * sum_{k in block b} x[r, k] * w[l, n, k]
        in f32. Forward only.

`impl`: "auto" (the native kernels of `jax_moe_a2a.gemm_ffi` when they are built, jax's backend is a
GPU and they take these shapes; else plain JAX), "native" (ValueError with the reason when not
available), "xla" (plain JAX: the same function up to f32 rounding order). Users' documentation:
docs/api.md, "Grouped expert GEMMs"; the native wrapper's functions (grouped_gemm, grouped_gemm_wgrad,
grouped_gemm_swiglu, native_reason, native_supported) are called only through this module.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from .axes import like_primal, vma
from .quant import FP8, dequantize_fp8, quantize_fp8_jax

from . import gemm_ffi as _gemm_ffi  # the native kernels' calls (they say when they are not built)

IMPLS = ("auto", "native", "xla")
_FLOATS = tuple(np.dtype(d) for d in (jnp.bfloat16, jnp.float16, jnp.float32))
_OUT_DTYPES = tuple(np.dtype(d) for d in (jnp.bfloat16, jnp.float32))
_FP8 = np.dtype(FP8)
_F32 = np.dtype(jnp.float32)
_HIGHEST = jax.lax.Precision.HIGHEST
_TILE = 16   # rows per work item of the XLA:CPU ragged GEMM (see _ragged_tiles)


# --- argument checks (trace time) ----------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Gemm:
    """One grouped GEMM's static description (from the arguments' shapes and dtypes).

    layout "ragged" | "expert_major"; L groups; K contraction; N outputs; fp8; x_block / w_block_n /
    w_block_k: the fp8 block sizes inferred from the scale shapes (None for bf16)."""

    layout: str
    groups: int
    k: int
    n: int
    fp8: bool
    x_block: Optional[int] = None
    w_block_n: Optional[int] = None
    w_block_k: Optional[int] = None


def _dt(a):
    return np.dtype(a.dtype)


def _block(total: int, scales: int, what: str) -> int:
    if scales <= 0 or total % scales:
        raise ValueError(f"{what}: {scales} scales do not divide {total} values into equal blocks")
    return total // scales


def check_gemm(op: str, x, w, group_sizes, x_scale=None, w_scale=None, *, names=("x", "w", "x_scale", "w_scale"),
               out_dtype=jnp.bfloat16) -> Gemm:
    """Validates one grouped GEMM's arguments (anything with .shape and .dtype); ValueError naming
    the argument. Returns its `Gemm` description."""
    nx, nw, nxs, nws = names
    if x.ndim not in (2, 3):
        raise ValueError(f"{op}: {nx} must be [R, K] (ragged) or [L, C, K] (expert_major), got shape {x.shape}")
    if w.ndim != 3:
        raise ValueError(f"{op}: {nw} must be [L, N, K] (out x in), got shape {w.shape}")
    layout = "ragged" if x.ndim == 2 else "expert_major"
    groups, n, k = w.shape
    if x.shape[-1] != k:
        raise ValueError(f"{op}: {nw} {w.shape} is [L, N, K] with K = {k}, but {nx} {x.shape} has K = {x.shape[-1]}")
    if layout == "expert_major" and x.shape[0] != groups:
        raise ValueError(f"{op}: expert_major {nx} {x.shape} has {x.shape[0]} experts, {nw} {w.shape} has {groups}")
    if getattr(group_sizes, "ndim", None) != 1 or group_sizes.shape[0] != groups:
        raise ValueError(f"{op}: group_sizes must be [L] = [{groups}] (one count per local expert of {nw}), "
                         f"got shape {getattr(group_sizes, 'shape', None)}")
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"{op}: group_sizes must be int32, got {group_sizes.dtype}")
    if np.dtype(out_dtype) not in _OUT_DTYPES:
        raise ValueError(f"{op}: out_dtype must be bfloat16 or float32, got {np.dtype(out_dtype)}")
    fp8 = _dt(x) == _FP8
    if fp8:
        if _dt(w) != _FP8:
            raise ValueError(f"{op}: {nx} is float8_e4m3fn but {nw} is {w.dtype}: fp8 needs both fp8 "
                             f"(quantize_weights_fp8), or pass bf16 {nx} (dequantize_fp8) with bf16 {nw}")
        if x_scale is None or w_scale is None:
            raise ValueError(f"{op}: fp8 {nx} and {nw} need {nxs} and {nws} (f32 block scales)")
        for name, s in ((nxs, x_scale), (nws, w_scale)):
            if _dt(s) != _F32:
                raise ValueError(f"{op}: {name} must be float32, got {s.dtype}")
        if x_scale.ndim != x.ndim or tuple(x_scale.shape[:-1]) != tuple(x.shape[:-1]):
            want = "[R, K/block]" if layout == "ragged" else "[L, C, K/block]"
            raise ValueError(f"{op}: {nxs} must be {want} for {nx} {x.shape}, got shape {x_scale.shape}")
        if w_scale.ndim != 3 or w_scale.shape[0] != groups:
            raise ValueError(f"{op}: {nws} must be [L, N/block, K/block] for {nw} {w.shape}, got shape {w_scale.shape}")
        xb = _block(k, x_scale.shape[-1], f"{op}: {nxs} {x_scale.shape} along K = {k}")
        bn = _block(n, w_scale.shape[1], f"{op}: {nws} {w_scale.shape} along N = {n}")
        bk = _block(k, w_scale.shape[2], f"{op}: {nws} {w_scale.shape} along K = {k}")
        if xb != bk:
            raise ValueError(f"{op}: {nxs} has blocks of {xb} along K but {nws} of {bk}: the K blocks must match")
        return Gemm(layout, groups, k, n, True, xb, bn, bk)
    if _dt(x) not in _FLOATS:
        raise ValueError(f"{op}: {nx} must be bfloat16 (or f16/f32), or float8_e4m3fn with {nxs}; got {x.dtype}")
    if _dt(w) not in _FLOATS:
        raise ValueError(f"{op}: {nw} is {w.dtype} but {nx} is {x.dtype}: a 16/32-bit float {nx} needs a "
                         f"16/32-bit float {nw} (fp8 {nw} needs fp8 {nx}: quantize_fp8(x, block))")
    if x_scale is not None or w_scale is not None:
        raise ValueError(f"{op}: {nxs} / {nws} are for fp8 operands only ({nx} is {x.dtype}, {nw} {w.dtype})")
    return Gemm(layout, groups, k, n, False)


def _check_impl(op: str, impl: str):
    if impl not in IMPLS:
        raise ValueError(f"{op}: impl must be one of {IMPLS}, got {impl!r}")


def native_reason(x, w, x_scale=None, w_scale=None) -> Optional[str]:
    """None when the native kernels take this grouped GEMM here; else why not (one line)."""
    why = _gemm_ffi.native_reason()
    if why is None:
        why = _gemm_ffi.native_supported(x, w, x_scale, w_scale)
    return why


def _use_native(op: str, impl: str, *problems) -> bool:
    """impl -> whether to call gemm_ffi; problems: (x, w, x_scale, w_scale) tuples (every GEMM of the op)."""
    _check_impl(op, impl)
    if impl == "xla":
        return False
    why = next((r for r in (native_reason(*p) for p in problems) if r is not None), None)
    if why is not None and impl == "native":
        raise ValueError(f"{op}: impl='native' is not available: {why}")
    return why is None


# --- plain-JAX implementation ------------------------------------------------------------------
def _dequant_w(w, w_scale, bn, bk):
    """w [..., N, K] (fp8 with w_scale [..., N/bn, K/bk], or a float) -> f32 of the same shape."""
    wf = w.astype(jnp.float32)
    if w_scale is None:
        return wf
    return wf * jnp.repeat(jnp.repeat(w_scale, bn, axis=-2), bk, axis=-1)


def _bounds(group_sizes, rows: int):
    """Ragged groups' [start, end) row ranges, clipped to [0, rows] (negative sizes count as 0)."""
    gs = jnp.maximum(group_sizes.astype(jnp.int32), 0)
    ends = jnp.cumsum(gs)
    return jnp.minimum(ends - gs, rows), jnp.minimum(ends, rows)


def _zeros_like_all(shape, *arrays):
    """f32 zeros of `shape` that vary along every mesh axis any of `arrays` varies along (a loop
    carry inside shard_map must keep one type); NaN or Inf in the arrays do not reach them."""
    probe = sum(a.reshape(-1)[0].astype(jnp.float32) for a in arrays)
    return jnp.broadcast_to(jnp.where(True, jnp.float32(0.0), probe), shape)


def _tile_range(start, end, tile: int):
    """[first, last) tiles of `tile` rows that meet the rows [start, end) (empty when end <= start)."""
    first = start // tile
    return first, jnp.where(end > start, (end + tile - 1) // tile, first)


def _compute_dtype(x, w):
    """The tile loop's operand dtype: bf16 for fp8 (e4m3 values are exact in bf16) and for bf16 x
    bf16 (XLA:CPU's bf16 dot accumulates in f32 and is ~2.5x faster than its f32 dot on 16-row
    tiles), else f32."""
    if _dt(x) == _FP8 or (_dt(x) == np.dtype(jnp.bfloat16) and _dt(w) == np.dtype(jnp.bfloat16)):
        return jnp.bfloat16
    return jnp.float32


def _ragged_tiles(x, x_scale, w, w_scale, group_sizes, g: Gemm, transpose_w: bool):
    """XLA:CPU ragged GEMM: y [R, n] f32, y[r] = x[r] . w[l] for r in group l, 0 outside the groups
    (contracting w's K, or with transpose_w its N: w [L, N, K] read as [L, K_in, N_out]).

    A loop over the groups and, inside, over the tiles of _TILE rows that meet the group: about
    (rows present + _TILE * L) rows of work, where XLA:CPU's ragged_dot computes every row against
    every group. No cond in the loops (a cond passing the output through copies it each time on
    XLA:CPU). fp8: the contract's formula itself, y = sum_b x_scale[:, b] * w_scale[l, n // bn, b] *
    (x_b . w_b) with each block's dot of the exact e4m3 values accumulated in f32."""
    rows, k = x.shape
    n = w.shape[2] if transpose_w else w.shape[1]
    cdt = _compute_dtype(x, w)
    tile = min(_TILE, rows)
    nt = -(-rows // tile)
    xp = jnp.pad(x.astype(cdt), ((0, nt * tile - rows), (0, 0)))
    starts, ends = _bounds(group_sizes, rows)
    local = jnp.arange(tile, dtype=jnp.int32)
    contract = 0 if transpose_w else 1
    if g.fp8:
        nb = k // g.x_block
        xsp = jnp.pad(x_scale, ((0, nt * tile - rows), (0, 0)))

    def group(gi, y):
        start, end = starts[gi], ends[gi]
        wg = jax.lax.dynamic_index_in_dim(w, gi, 0, keepdims=False).astype(cdt)     # [N, K]
        if g.fp8:
            wsg = jax.lax.dynamic_index_in_dim(w_scale, gi, 0, keepdims=False)     # [N/bn, K/bk]
            wsg = jnp.repeat(wsg, g.w_block_n, axis=0).T                              # [nb, N]
            wgb = wg.reshape(n, nb, g.x_block)

        def one_tile(ti, y):
            r0 = ti * tile
            xt = jax.lax.dynamic_slice_in_dim(xp, r0, tile)
            if g.fp8:
                part = jnp.einsum("tbk,nbk->btn", xt.reshape(tile, nb, g.x_block), wgb,
                                  preferred_element_type=jnp.float32)
                xst = jax.lax.dynamic_slice_in_dim(xsp, r0, tile)                    # [tile, nb]
                yt = jnp.sum(part * xst.T[:, :, None] * wsg[:, None, :], axis=0)
            else:
                yt = jax.lax.dot_general(xt, wg, (((1,), (contract,)), ((), ())), precision=_HIGHEST,
                                         preferred_element_type=jnp.float32)
            mine = ((r0 + local >= start) & (r0 + local < end))[:, None]
            cur = jax.lax.dynamic_slice_in_dim(y, r0, tile)
            return jax.lax.dynamic_update_slice_in_dim(y, cur + jnp.where(mine, yt, 0.0), r0, 0)

        return jax.lax.fori_loop(*_tile_range(start, end, tile), one_tile, y)

    probe = (xp, group_sizes, w) + ((x_scale, w_scale) if g.fp8 else ())
    y0 = _zeros_like_all((nt * tile, n), *probe)
    return jax.lax.fori_loop(0, starts.shape[0], group, y0)[:rows]


def _ragged_rows_mask(group_sizes, rows: int):
    """[R] bool: the rows inside the groups."""
    return jnp.arange(rows) < jnp.minimum(jnp.sum(jnp.maximum(group_sizes.astype(jnp.int32), 0)), rows)


def _ragged_method() -> str:
    """XLA:CPU: the tile scan; elsewhere jax.lax.ragged_dot (XLA:GPU groups it for real)."""
    return "tiles" if jax.default_backend() == "cpu" else "ragged_dot"


def _xla_gemm(x, w, group_sizes, x_scale, w_scale, g: Gemm, *, transpose_w=False, method=None):
    """The plain-JAX grouped GEMM: f32 result [R, N] or [L, C, N] (rows outside the groups zero).

    transpose_w: multiply by w[l] itself (w [L, N, K] read as [L, K_in = N, N_out = K]; bf16 dgrad)."""
    method = method or _ragged_method()
    n_out = w.shape[2] if transpose_w else w.shape[1]
    if x.size == 0 or w.size == 0:
        return jnp.zeros(x.shape[:-1] + (n_out,), jnp.float32)
    if g.layout == "ragged" and method == "tiles":
        return _ragged_tiles(x, x_scale, w, w_scale, group_sizes, g, transpose_w)
    x32 = x.astype(jnp.float32) if x_scale is None else dequantize_fp8(x, x_scale, g.x_block)
    if g.layout == "expert_major":
        w32 = _dequant_w(w, w_scale, g.w_block_n, g.w_block_k)
        spec = "lck,lkn->lcn" if transpose_w else "lck,lnk->lcn"
        y = jnp.einsum(spec, x32, w32, precision=_HIGHEST)
        c = x.shape[1]
        live = jnp.arange(c)[None, :] < group_sizes.astype(jnp.int32)[:, None]
        return jnp.where(live[..., None], y, 0.0)
    if method == "ragged_dot":
        w32 = _dequant_w(w, w_scale, g.w_block_n, g.w_block_k)
        rhs = w32 if transpose_w else jnp.swapaxes(w32, 1, 2)   # [L, K_in, N_out]
        live = _ragged_rows_mask(group_sizes, x.shape[0])[:, None]
        y = jax.lax.ragged_dot(jnp.where(live, x32, 0.0), rhs, group_sizes.astype(jnp.int32), precision=_HIGHEST,
                               preferred_element_type=jnp.float32)
        return jnp.where(live, y, 0.0)
    raise ValueError(f"unknown ragged method {method!r}")


def _xla_wgrad(x, dy, group_sizes, layout: str, *, method=None):
    """dw [L, N, K] f32: dw[l] = dy_l^T @ x_l over group l's rows (x [.., K], dy [.., N] floats)."""
    method = method or _ragged_method()
    x32, dy32 = x.astype(jnp.float32), dy.astype(jnp.float32)
    groups = group_sizes.shape[0]
    if x.size == 0 or dy.size == 0 or groups == 0:
        return jnp.zeros((groups, dy.shape[-1], x.shape[-1]), jnp.float32)
    if layout == "expert_major":
        live = (jnp.arange(x.shape[1])[None, :] < group_sizes.astype(jnp.int32)[:, None])[..., None]
        return jnp.einsum("lcn,lck->lnk", jnp.where(live, dy32, 0.0), jnp.where(live, x32, 0.0), precision=_HIGHEST)
    rows, k = x.shape
    n = dy.shape[1]
    live = _ragged_rows_mask(group_sizes, rows)[:, None]
    x32, dy32 = jnp.where(live, x32, 0.0), jnp.where(live, dy32, 0.0)
    if method == "ragged_dot":
        zero = jnp.zeros((groups, k, n), jnp.float32)
        _, vjp = jax.vjp(lambda r: jax.lax.ragged_dot(x32, r, group_sizes.astype(jnp.int32), precision=_HIGHEST,
                                                      preferred_element_type=jnp.float32), zero)
        return jnp.swapaxes(vjp(dy32)[0], 1, 2)
    tile = min(_TILE, rows)
    nt = -(-rows // tile)
    xp = jnp.pad(x32, ((0, nt * tile - rows), (0, 0)))
    dyp = jnp.pad(dy32, ((0, nt * tile - rows), (0, 0)))
    starts, ends = _bounds(group_sizes, rows)
    local = jnp.arange(tile, dtype=jnp.int32)

    def group(gi, dw):   # as _ragged_tiles: groups outside, their tiles inside, no cond
        start, end = starts[gi], ends[gi]

        def one_tile(ti, acc):
            r0 = ti * tile
            mine = ((r0 + local >= start) & (r0 + local < end))[:, None]
            dyt = jnp.where(mine, jax.lax.dynamic_slice_in_dim(dyp, r0, tile), 0.0)
            return acc + jax.lax.dot_general(dyt, jax.lax.dynamic_slice_in_dim(xp, r0, tile), (((0,), (0,)), ((), ())),
                                             precision=_HIGHEST)

        acc = jax.lax.fori_loop(*_tile_range(start, end, tile), one_tile, _zeros_like_all((n, k), xp, dyp, group_sizes))
        return jax.lax.dynamic_update_index_in_dim(dw, acc, gi, 0)

    return jax.lax.fori_loop(0, groups, group, _zeros_like_all((groups, n, k), xp, dyp, group_sizes))


# --- one grouped GEMM: native or XLA ---------------------------------------------------------------
def _gemm(x, w, group_sizes, x_scale, w_scale, g: Gemm, out_dtype, native: bool):
    if native:
        return _gemm_ffi.grouped_gemm(x, w, group_sizes, x_scale=x_scale, w_scale=w_scale, out_dtype=out_dtype)
    return _xla_gemm(x, w, group_sizes, x_scale, w_scale, g).astype(out_dtype)


def _dgrad(dy, w, group_sizes, g: Gemm, native: bool, x_dtype):
    """dx [.., K] = dy [.., N] @ w[l] per group (w [L, N, K]; bf16 backward), in x's dtype (native:
    dy rounded to bf16, bf16 out; plain JAX where the native kernels do not take the shapes)."""
    if native:
        dyb = dy.astype(jnp.bfloat16)
        if _gemm_ffi.native_supported(dyb, w, None, None, transpose_w=True) is None:
            return _gemm_ffi.grouped_gemm(dyb, w, group_sizes, out_dtype=jnp.bfloat16, transpose_w=True).astype(x_dtype)
    return _xla_gemm(dy, w, group_sizes, None, None, g, transpose_w=True).astype(x_dtype)


def _wgrad(x, dy, group_sizes, g: Gemm, native: bool, w_dtype):
    """dw [L, N, K] = dy_l^T @ x_l per group (x [.., K], dy [.., N]), in w's dtype. Native: x and dy
    rounded to bf16, f32 accumulation (plain JAX where the native wgrad does not take the shapes)."""
    if native:
        xb, dyb = x.astype(jnp.bfloat16), dy.astype(jnp.bfloat16)
        if _gemm_ffi.wgrad_supported(xb, dyb, group_sizes) is None:
            return _gemm_ffi.grouped_gemm_wgrad(xb, dyb, group_sizes, out_dtype=jnp.float32).astype(w_dtype)
    return _xla_wgrad(x, dy, group_sizes, g.layout).astype(w_dtype)


def _no_grad_sizes(group_sizes):
    return np.zeros(group_sizes.shape, jax.dtypes.float0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _gemm_float(x, w, group_sizes, g, out_dtype, native):
    return _gemm(x, w, group_sizes, None, None, g, out_dtype, native)


def _gemm_float_fwd(x, w, group_sizes, g, out_dtype, native):
    return _gemm(x, w, group_sizes, None, None, g, out_dtype, native), (x, w, group_sizes)


def _typed(ct, primal):
    """A cotangent typed like its primal inside shard_map: the native kernels' results carry no
    varying axes (jax.ffi.ffi_call types them from nothing), and a custom_vjp rule must return
    exactly the primal's type (axes.like_primal: varying where the primal varies, summed where it
    does not). No-op outside shard_map."""
    return like_primal(ct, vma(primal))


def _gemm_float_bwd(g, out_dtype, native, res, dy):
    x, w, group_sizes = res
    return (_typed(_dgrad(dy, w, group_sizes, g, native, x.dtype), x),
            _typed(_wgrad(x, dy, group_sizes, g, native, w.dtype), w), _no_grad_sizes(group_sizes))


_gemm_float.defvjp(_gemm_float_fwd, _gemm_float_bwd)

FP8_NO_GRAD = ("fp8 grouped GEMMs are forward-only (inference): differentiate the bf16 path instead "
               "(bf16 x and bf16 weights, e.g. dequantize_fp8 the rows and keep bf16 master weights)")


def _forward_only(fn):
    """fn(*args) with a VJP that raises (fp8: no gradient)."""
    wrapped = jax.custom_vjp(fn)

    def bwd(_, dy):
        raise NotImplementedError(f"jax_moe_a2a.experts: {FP8_NO_GRAD}")
    wrapped.defvjp(lambda *a: (fn(*a), None), bwd)
    return wrapped


# --- public API --------------------------------------------------------------------------------
def grouped_matmul(x, w, group_sizes, *, x_scale=None, w_scale=None, out_dtype=jnp.bfloat16, impl: str = "auto"):
    """Per-expert matmul over the received layout: y = x_l @ w[l]^T for each local expert l.

    Args:
      x: ragged [R, K] (rows sorted by local expert, as `dispatch_recv` returns them with
        layout="ragged") or expert_major [L, C, K]; bfloat16 (float16/float32 accepted by the XLA
        implementation) or float8_e4m3fn with x_scale.
      w: [L, N, K] ("out x in"); bfloat16 (or f16/f32) with a float x, float8_e4m3fn with an fp8 x.
      group_sizes: [L] int32 on the device: rows of each expert (ragged, sum <= R) or per-expert
        counts (expert_major, each <= C).
      x_scale: fp8 only: f32 [R, K/bk] or [L, C, K/bk], one scale per 1 x bk block (`got.scale`).
      w_scale: fp8 only: f32 [L, N/bn, K/bk], one scale per bn x bk block (bk as x_scale's; 128 x 128
        in DeepSeek-V3 checkpoints; the XLA implementation takes any blocks that divide N and K).
      out_dtype: bfloat16 (default) or float32.
      impl: "auto" | "native" | "xla" (module docstring).
    Returns:
      y [R, N] or [L, C, N] in out_dtype, accumulated in f32; ZERO rows at or past sum(group_sizes)
      (ragged) and at c >= group_sizes[l] (expert_major), whatever those x rows hold.
    Differentiable for float x and w (not group_sizes); fp8 is forward-only (jax.grad raises).
    Raises ValueError at trace time on bad shapes, dtypes, scales or impl, naming the argument.
    """
    g = check_gemm("grouped_matmul", x, w, group_sizes, x_scale, w_scale, out_dtype=out_dtype)
    native = _use_native("grouped_matmul", impl, (x, w, x_scale, w_scale))
    out_dtype = np.dtype(out_dtype)
    if g.fp8:
        fn = _forward_only(lambda x, w, gs, xs, ws: _gemm(x, w, gs, xs, ws, g, out_dtype, native))
        return fn(x, w, group_sizes, x_scale, w_scale)
    return _gemm_float(x, w, group_sizes, g, out_dtype, native)


def _silu(v):
    return v * jax.lax.logistic(v)


def _round_bf16(v):
    """v rounded to bf16's precision (nearest even), kept f32. XLA may drop a bf16 round trip
    (astype(bf16).astype(f32)) inside a fusion ("excess precision", XLA:GPU's default); a
    reduce_precision it keeps, so the plain-JAX MLP rounds where the native one stores bf16
    (XLA:GPU without it: 11 of 2,048 outputs past the oracle's bound, test_experts, 2026-12-05)."""
    return jax.lax.reduce_precision(v.astype(jnp.float32), exponent_bits=8, mantissa_bits=7)


def _to_bf16(v):
    """v as bf16, rounded even where XLA would otherwise keep the f32 value (_round_bf16)."""
    return _round_bf16(v).astype(jnp.bfloat16)


def swiglu(a):
    """a [..., 2F] f32 (gate = a[..., :F], up = a[..., F:]) -> silu(gate) * up [..., F] f32."""
    f = a.shape[-1] // 2
    return _silu(a[..., :f]) * a[..., f:]


def quantize_rows_fp8(h, block: int):
    """h [..., F] float -> (e4m3fn [..., F], f32 scales [..., F/block]) with the library's 1 x block
    rule (jax_moe_a2a.quant.quantize_fp8_jax; blocks along the last axis)."""
    lead, f = h.shape[:-1], h.shape[-1]
    q, s = quantize_fp8_jax(h.reshape(-1, f), block)
    return q.reshape(*lead, f), s.reshape(*lead, s.shape[-1])


@dataclasses.dataclass(frozen=True)
class _Mlp:
    """expert_mlp's static description: its two GEMMs, whether h is re-quantised (block along F),
    and whether they run natively (both or neither: _use_native checks both)."""

    up: Gemm
    down: Gemm
    quantize_hidden: bool
    block: Optional[int]
    native: bool


def _mlp_hidden(x, w_gate_up, group_sizes, x_scale, w_scale, m: _Mlp):
    """First GEMM + SwiGLU: h [.., F] bf16 (h_scale None), or fp8 with h_scale [.., F/block]. With
    quantize_hidden the gate+up output is rounded to bf16 before the SwiGLU (gemm_ffi.gu_dtype), on
    both paths."""
    if m.native:
        return _gemm_ffi.grouped_gemm_swiglu(x, w_gate_up, group_sizes, x_scale=x_scale, w_scale=w_scale,
                                             quantize_hidden=m.quantize_hidden, block=m.block or 128)
    # gate+up rounded to the native MLP's gu dtype (bf16 when h is re-quantised), then SwiGLU in f32
    gu = _gemm(x, w_gate_up, group_sizes, x_scale, w_scale, m.up, jnp.float32, False)
    if np.dtype(_gemm_ffi.gu_dtype(m.quantize_hidden)) == np.dtype(jnp.bfloat16):
        gu = _round_bf16(gu)
    h = swiglu(gu)
    if m.quantize_hidden:
        return quantize_rows_fp8(h, m.block)
    return _to_bf16(h), None


def _mlp_forward(x, w_gate_up, w_down, group_sizes, x_scale, w_gate_up_scale, w_down_scale, m: _Mlp, out_dtype):
    h, h_scale = _mlp_hidden(x, w_gate_up, group_sizes, x_scale, w_gate_up_scale, m)
    return _gemm(h, w_down, group_sizes, h_scale, w_down_scale, m.down, out_dtype, m.native)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _mlp_float(x, w_gate_up, w_down, group_sizes, m, out_dtype):
    return _mlp_forward(x, w_gate_up, w_down, group_sizes, None, None, None, m, out_dtype)


def _mlp_float_fwd(x, w_gate_up, w_down, group_sizes, m, out_dtype):
    # unfused: the pre-activations a [.., 2F] f32 are the backward's residual
    a = _gemm(x, w_gate_up, group_sizes, None, None, m.up, jnp.float32, m.native)
    h = _to_bf16(swiglu(a))
    y = _gemm(h, w_down, group_sizes, None, None, m.down, out_dtype, m.native)
    return y, (x, w_gate_up, w_down, group_sizes, a, h)


def _mlp_float_bwd(m, out_dtype, res, dy):
    x, w_gate_up, w_down, group_sizes, a, h = res
    dh = _dgrad(dy, w_down, group_sizes, m.down, m.native, jnp.float32)
    dw_down = _wgrad(h, dy, group_sizes, m.down, m.native, w_down.dtype)
    dh = _round_bf16(dh)   # h's cotangent in h's dtype, as autodiff has it
    f = a.shape[-1] // 2
    gate, up = a[..., :f], a[..., f:]
    sig = jax.lax.logistic(gate)
    dgate = dh * up * sig * (1.0 + gate * (1.0 - sig))
    da = jnp.concatenate([dgate, dh * gate * sig], axis=-1)
    dx = _dgrad(da, w_gate_up, group_sizes, m.up, m.native, x.dtype)
    dw_gate_up = _wgrad(x, da, group_sizes, m.up, m.native, w_gate_up.dtype)
    return (_typed(dx, x), _typed(dw_gate_up, w_gate_up), _typed(dw_down, w_down), _no_grad_sizes(group_sizes))


_mlp_float.defvjp(_mlp_float_fwd, _mlp_float_bwd)


def expert_mlp(x, w_gate_up, w_down, group_sizes, *, x_scale=None, w_gate_up_scale=None, w_down_scale=None,
               quantize_hidden=None, out_dtype=jnp.bfloat16, impl: str = "auto"):
    """The routed experts' SwiGLU MLP over the received layout: y_l = (silu(x_l Wg^T) * x_l Wu^T) Wd^T.

    Args:
      x: ragged [R, H] or expert_major [L, C, H]; bfloat16 (or f16/f32), or float8_e4m3fn with
        x_scale f32 [R, H/bk] / [L, C, H/bk] (`got.x`, `got.scale`).
      w_gate_up: [L, 2F, H]: output rows 0..F-1 are the gate projection, F..2F-1 the up projection;
        bfloat16, or float8_e4m3fn with w_gate_up_scale f32 [L, 2F/bn, H/bk] (fp8 needs an fp8 x).
      w_down: [L, H_out, F]; bfloat16, or float8_e4m3fn with w_down_scale f32 [L, H_out/bn, F/bf].
      group_sizes: [L] int32 on the device (as grouped_matmul).
      quantize_hidden: re-quantise h = silu(gate) * up to float8_e4m3fn with one f32 scale per
        1 x bf block along F (bf: w_down_scale's block along F; the rule of quantize_fp8_jax) before
        the down GEMM. None (default): True iff w_down is fp8 (it must be: fp8 w_down needs fp8 h).
      out_dtype: bfloat16 (default) or float32.
      impl: "auto" | "native" | "xla" (as grouped_matmul).
    Returns:
      y [R, H_out] or [L, C, H_out] in out_dtype; h is computed in f32 from the f32 accumulators,
      then cast to bf16 (or re-quantised); ZERO rows outside the groups, as grouped_matmul.
    Differentiable w.r.t. x, w_gate_up and w_down when all three are 16/32-bit floats; fp8 is
    forward-only. ValueError at trace time on bad arguments, naming them.
    """
    op = "expert_mlp"
    up = check_gemm(op, x, w_gate_up, group_sizes, x_scale, w_gate_up_scale,
                    names=("x", "w_gate_up", "x_scale", "w_gate_up_scale"), out_dtype=out_dtype)
    if up.n % 2:
        raise ValueError(f"{op}: w_gate_up {w_gate_up.shape} must be [L, 2F, H] (gate rows, then up rows): "
                         f"{up.n} is odd")
    f = up.n // 2
    if w_down.ndim != 3 or w_down.shape[0] != up.groups or w_down.shape[2] != f:
        raise ValueError(f"{op}: w_down must be [L, H_out, F] = [{up.groups}, H_out, {f}] for w_gate_up "
                         f"{w_gate_up.shape}, got shape {w_down.shape}")
    down_fp8 = _dt(w_down) == _FP8
    if quantize_hidden is None:
        quantize_hidden = down_fp8
    if bool(quantize_hidden) != down_fp8:
        raise ValueError(f"{op}: quantize_hidden={quantize_hidden} but w_down is {w_down.dtype}: fp8 h needs fp8 "
                         "w_down (with w_down_scale) and bf16 h a 16/32-bit float w_down")
    block = None
    h_scale = None
    h_dtype = jnp.bfloat16
    if quantize_hidden:
        if w_down_scale is None or getattr(w_down_scale, "ndim", 0) != 3:
            raise ValueError(f"{op}: fp8 w_down needs w_down_scale [L, H_out/bn, F/bf], got "
                             f"{None if w_down_scale is None else w_down_scale.shape}")
        block = _block(f, w_down_scale.shape[2], f"{op}: w_down_scale {w_down_scale.shape} along F = {f}")
        h_dtype = FP8
        h_scale = jax.ShapeDtypeStruct(x.shape[:-1] + (f // block,), jnp.float32)
    h = jax.ShapeDtypeStruct(x.shape[:-1] + (f,), h_dtype)
    down = check_gemm(op, h, w_down, group_sizes, h_scale, w_down_scale,
                      names=("h (silu(gate) * up)", "w_down", "h_scale", "w_down_scale"), out_dtype=out_dtype)
    native = _use_native(op, impl, (x, w_gate_up, x_scale, w_gate_up_scale), (h, w_down, h_scale, w_down_scale))
    m = _Mlp(up, down, bool(quantize_hidden), block, native)
    out_dtype = np.dtype(out_dtype)
    if up.fp8 or down.fp8:
        fn = _forward_only(lambda *a: _mlp_forward(*a, m, out_dtype))
        return fn(x, w_gate_up, w_down, group_sizes, x_scale, w_gate_up_scale, w_down_scale)
    return _mlp_float(x, w_gate_up, w_down, group_sizes, m, out_dtype)


def quantize_weights_fp8(w, block=128):
    """Block-quantises expert weights for the fp8 path (DeepSeek-V3's checkpoint format).

    Args:
      w: [L, N, K] (or [N, K]) float32/bfloat16/float16, "out x in".
      block: int (block x block) or (bn, bk); must divide N and K.
    Returns:
      (w8 [L, N, K] float8_e4m3fn, w_scale [L, N/bn, K/bk] float32): one scale per bn x bk block,
      by the rule of quantize_fp8_jax (scale = max(amax, 1e-12) / 448, round to nearest even), so
      w ~= w8 * w_scale repeated over each block.
    """
    bn, bk = (block, block) if isinstance(block, (int, np.integer)) else tuple(block)
    for b in (bn, bk):
        if isinstance(b, bool) or not isinstance(b, (int, np.integer)) or b <= 0:
            raise ValueError(f"quantize_weights_fp8: block must be a positive int or a pair of them, got {block!r}")
    if w.ndim not in (2, 3):
        raise ValueError(f"quantize_weights_fp8: w must be [L, N, K] or [N, K], got shape {w.shape}")
    if _dt(w) not in _FLOATS:
        raise ValueError(f"quantize_weights_fp8: w must be f32, bf16 or f16, got {w.dtype}")
    lead, (n, k) = w.shape[:-2], w.shape[-2:]
    if n % bn or k % bk:
        raise ValueError(f"quantize_weights_fp8: block {bn} x {bk} must divide w's [N, K] = [{n}, {k}]")
    ln = int(np.prod(lead, dtype=np.int64))
    blocks = w.reshape(ln, n // bn, bn, k // bk, bk).transpose(0, 1, 3, 2, 4).reshape(-1, bn * bk)
    q, s = quantize_fp8_jax(blocks, bn * bk)          # one scale per block: the library's rule
    q = q.reshape(ln, n // bn, k // bk, bn, bk).transpose(0, 1, 3, 2, 4).reshape(*lead, n, k)
    return q, s.reshape(*lead, n // bn, k // bk)


def dequantize_weights_fp8(w8, w_scale):
    """(w8 [.., N, K] e4m3fn, w_scale [.., N/bn, K/bk] f32) -> [.., N, K] f32."""
    n, k = w8.shape[-2:]
    bn = _block(n, w_scale.shape[-2], f"dequantize_weights_fp8: w_scale {w_scale.shape} along N = {n}")
    bk = _block(k, w_scale.shape[-1], f"dequantize_weights_fp8: w_scale {w_scale.shape} along K = {k}")
    return _dequant_w(w8, w_scale, bn, bk)


__all__ = ["grouped_matmul", "expert_mlp", "quantize_weights_fp8", "dequantize_weights_fp8", "quantize_rows_fp8",
           "swiglu", "native_reason", "check_gemm", "Gemm", "IMPLS"]
