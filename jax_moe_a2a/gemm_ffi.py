"""Grouped expert GEMMs as XLA FFI custom calls on NVIDIA Hopper GPUs (cc/gemm, issue 31).

The thin wrapper of the native kernels (CUTLASS pointer-array grouped GEMMs, sm_90a). The public
API is `jax_moe_a2a.experts` (grouped_matmul, expert_mlp), which calls these when
`native_reason()` and `native_supported(...)` both return None and falls back to plain JAX
otherwise. The contract between the two is team/GEMM_CONTRACT.md; shapes (L local experts):

    ragged:       x [R, K], group_sizes [L] int32 on the device (rows sorted by local expert;
                  rows at or past sum(group_sizes) give ZERO output rows)
    expert_major: x [L, C, K], group_sizes = counts [L] int32 (rows c >= counts[l] give ZERO
                  output rows and cost no FLOPs or bytes)
    w [L, N, K] (K contiguous); with transpose_w, w [L, K, N] (y = x @ w[l]), bf16 only
    fp8: x float8_e4m3fn with x_scale f32 [rows, K/128] ([L, C, K/128] expert_major); w
         float8_e4m3fn with w_scale f32 [L, N/128, K/128]; f32 accumulation
    wgrad (grouped_gemm_wgrad): x [R, K] / [L, C, K] and dy [R, N] / [L, C, N] bf16 -> dw [L, N, K]
         f32, dw[l] = dy_l^T @ x_l over group l's rows (zero for a group with no rows)

Every call only launches device work (group sizes are read on the device): usable under jit,
inside shard_map, with no host synchronisation, and in XLA command buffers.

JAX_MOE_A2A_GEMM_TILE_M (for measurements) forces the kernel configuration; it is read and parsed
(`parse_tuning`) when a call is traced, and the same values size the workspace and reach the
kernels as the custom call's attributes (a jitted function keeps the setting it was traced with).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from . import _ffi, env
from .axes import varying, vma
from .dtypes import FP8

BF16 = jnp.bfloat16
_BLOCK = 128  # the native fp8 kernels' scale block (1x128 rows, 128x128 weights)
_MAX_ROWS = 2**31 - 1
# the custom call's `mode` attribute (gemm::Mode, cc/gemm/grouped_gemm.h)
_MODE_FORWARD, _MODE_TRANSPOSE_W, _MODE_WGRAD = 0, 1, 2
# the custom call's `kernel` attribute (gemm::KernelChoice): who runs an fp8 forward call
_KERNEL_AUTO, _KERNEL_CUTLASS, _KERNEL_WGMMA, _KERNEL_SWAP = 0, 1, 2, 3


@dataclasses.dataclass(frozen=True)
class Tuning:
    """The kernel configuration a call asks for (gemm::TuningRequest, cc/gemm/grouped_gemm.h):
    tile_m 0 (auto: 64-row tiles when the mean rows per expert is <= 128, else 128), 64 or 128;
    raster 0 (along M), 1 (along N) or 2 (CUTLASS's heuristic); swizzle 1, 2, 4 or 8 (maximum);
    kernel 0 (auto: our own fp8 kernel at decode shapes, CUTLASS otherwise), 1 (CUTLASS), 2 (wgmma:
    our own fp8 kernel, fp8 forward calls only) or 3 (swap: our own swap-AB kernel at every shape,
    at prefill with its largest token tile; measurements).
    fuse_swiglu (Python only, not an attribute): the fp8 MLP's gate+up GEMM and its SwiGLU as one
    kernel where our own kernel runs: None (the default) where it measured faster (the swap-AB
    kernel's token tiles <= 64: _C.gemm.swiglu_by_default), True wherever our kernel runs, False
    never (fused_swiglu_reason)."""
    tile_m: int = 0
    raster: int = 0
    swizzle: int = 1
    kernel: int = _KERNEL_AUTO
    fuse_swiglu: bool | None = None

    def native_kwargs(self) -> dict:
        """gemm::TuningRequest's fields as ints (workspace_bytes' keyword arguments)."""
        return {f: int(getattr(self, f)) for f in ("tile_m", "raster", "swizzle", "kernel")}

    def attrs(self) -> dict:
        """The custom call's attributes (gemm::TuningRequest's fields)."""
        return {f: np.int32(v) for f, v in self.native_kwargs().items()}


# JAX_MOE_A2A_GEMM_TILE_M's words and the field each sets
_TUNING_WORDS = {"64": ("tile_m", 64), "128": ("tile_m", 128), "rasterM": ("raster", 0), "rasterN": ("raster", 1),
                 "rasterH": ("raster", 2), "s1": ("swizzle", 1), "s2": ("swizzle", 2), "s4": ("swizzle", 4),
                 "s8": ("swizzle", 8), "cutlass": ("kernel", _KERNEL_CUTLASS), "wgmma": ("kernel", _KERNEL_WGMMA),
                 "swap": ("kernel", _KERNEL_SWAP),
                 "fused": ("fuse_swiglu", True), "unfused": ("fuse_swiglu", False)}


def parse_tuning(text: str | None) -> Tuning:
    """JAX_MOE_A2A_GEMM_TILE_M's value -> Tuning: None, '' or 'auto' are the defaults; otherwise a
    comma list of 64 | 128 (the tile's rows), rasterM | rasterN | rasterH (the scheduler's order),
    s1 | s2 | s4 | s8 (its maximum swizzle), cutlass | wgmma | swap (the fp8 forward kernel:
    CUTLASS's, our own, cc/gemm/fp8_wgmma.cuh, or our swap-AB one at every shape), fused | unfused
    (the gate+up GEMM and the SwiGLU as one kernel wherever our kernel runs: at decode shapes, or
    everywhere with wgmma; or never; without either, where it measured faster); a later word wins. Any other word raises ValueError
    naming the accepted ones (a misspelt setting would otherwise measure the default)."""
    t = Tuning()
    if text is None or text.strip() in ("", "auto"):
        return t
    for word in (w.strip() for w in text.split(",")):
        if not word:
            continue
        if word not in _TUNING_WORDS:
            raise ValueError(f"{env.PREFIX}GEMM_TILE_M={text!r}: unknown word {word!r}; the accepted words are "
                             f"'auto' alone, or a comma list of {', '.join(_TUNING_WORDS)}")
        field, value = _TUNING_WORDS[word]
        t = dataclasses.replace(t, **{field: value})
    return t


def tuning() -> Tuning:
    """The configuration JAX_MOE_A2A_GEMM_TILE_M asks for now (read when a call is traced)."""
    return parse_tuning(env.get("GEMM_TILE_M"))


def _gemm_module():
    c = _ffi._C
    return getattr(c, "gemm", None) if c is not None else None


def _build_reason() -> str | None:
    """Why the extension has no grouped-GEMM kernels (None when it has them)."""
    if _ffi._C is None:
        return f"jax_moe_a2a's native extension is not built ({_ffi._IMPORT_ERROR})"
    g = _gemm_module()
    if g is None:
        return "this build of jax_moe_a2a's extension predates the grouped-GEMM kernels"
    if not g.built():
        return g.reason() or "the grouped-GEMM kernels were not built"
    return None


@functools.lru_cache(maxsize=None)
def _device_reason(platform: str, kinds: tuple) -> str | None:
    if platform != "gpu":
        return f"jax's default backend is {platform!r}, not 'gpu'"
    for kind, cc in kinds:
        if cc is not None and not str(cc).startswith("9."):
            return (f"the grouped-GEMM kernels are built for Hopper (sm_90a) only; device {kind!r} "
                    f"has compute capability {cc}")
    return None


def native_reason() -> str | None:
    """None when the extension has the grouped-GEMM kernels and jax's default backend is a Hopper
    GPU; otherwise a one-line reason."""
    why = _build_reason()
    if why is not None:
        return why
    platform = jax.default_backend()
    kinds = ()
    if platform == "gpu":
        kinds = tuple(sorted({(d.device_kind, getattr(d, "compute_capability", None)) for d in jax.devices()}))
    return _device_reason(platform, kinds)


def _dtype(a):
    return None if a is None else np.dtype(a.dtype)


def _typed_like(out, *inputs):
    """An FFI result typed as varying over every mesh axis its inputs vary over inside shard_map
    (jax.ffi.ffi_call types it from nothing, as if every rank computed the same): a per-rank
    result typed as replicated would make a custom_vjp's cotangent for a replicated weight skip
    its sum over the ranks. No-op outside shard_map."""
    axes = tuple(sorted(set().union(*(vma(a) for a in inputs if a is not None))))
    return varying(out, axes) if axes else out


def native_supported(x, w, x_scale=None, w_scale=None, *, transpose_w: bool = False) -> str | None:
    """None when the native kernels take these shapes and dtypes (a static check on .shape and
    .dtype only: arrays or jax.ShapeDtypeStruct), else why not.

    Native limits: x and w both bf16, or both float8_e4m3fn with x_scale [rows, K/128] and
    w_scale [L, N/128, K/128] f32 (128 blocks: K % 128 == 0 and N % 128 == 0); bf16 needs
    K % 8 == 0 and N % 8 == 0; fewer than 2^31 rows; transpose_w bf16 only."""
    if x.ndim not in (2, 3):
        return f"x must be [R, K] or [L, C, K], got shape {tuple(x.shape)}"
    if w.ndim != 3:
        return f"w must be [L, N, K], got shape {tuple(w.shape)}"
    L = w.shape[0]
    n, k = (w.shape[2], w.shape[1]) if transpose_w else (w.shape[1], w.shape[2])
    if x.shape[-1] != k:
        return f"x's last dimension {x.shape[-1]} is not w's K = {k}"
    if x.ndim == 3 and x.shape[0] != L:
        return f"expert_major x [L, C, K] has L = {x.shape[0]}, w has {L}"
    rows = x.shape[0] if x.ndim == 2 else x.shape[0] * x.shape[1]
    if n <= 0 or k <= 0:
        return "N and K must be positive"
    if rows > _MAX_ROWS or n > _MAX_ROWS or k > _MAX_ROWS:
        return "more than 2^31 - 1 rows, N or K"
    dx, dw = _dtype(x), _dtype(w)
    if dx != dw:
        return f"x and w must have one dtype, got {dx} and {dw}"
    if dx == np.dtype(BF16):
        if x_scale is not None or w_scale is not None:
            return "bf16 inputs take no scales"
        if k % 8 or n % 8:
            return f"bf16 needs K % 8 == 0 and N % 8 == 0 (16-byte rows), got K = {k}, N = {n}"
        return None
    if dx != np.dtype(FP8):
        return f"x and w must be bfloat16 or float8_e4m3fn, got {dx}"
    if transpose_w:
        return "fp8 with transpose_w is not implemented natively"
    if x_scale is None or w_scale is None:
        return "fp8 needs x_scale and w_scale"
    if k % _BLOCK or n % _BLOCK:
        return f"fp8 needs K % 128 == 0 and N % 128 == 0 (128x128 weight blocks), got K = {k}, N = {n}"
    want_xs = tuple(x.shape[:-1]) + (k // _BLOCK,)
    if tuple(x_scale.shape) != want_xs or _dtype(x_scale) != np.dtype(np.float32):
        return f"the native fp8 kernels need x_scale f32 {want_xs} (1x128 blocks), got {tuple(x_scale.shape)} {_dtype(x_scale)}"
    want_ws = (L, n // _BLOCK, k // _BLOCK)
    if tuple(w_scale.shape) != want_ws or _dtype(w_scale) != np.dtype(np.float32):
        return f"the native fp8 kernels need w_scale f32 {want_ws} (128x128 blocks), got {tuple(w_scale.shape)} {_dtype(w_scale)}"
    return None


def _require(x, w, x_scale, w_scale, transpose_w=False):
    why = native_reason() or native_supported(x, w, x_scale, w_scale, transpose_w=transpose_w)
    if why is not None:
        raise ValueError(f"jax_moe_a2a.gemm_ffi: the native grouped GEMM cannot run this: {why}")
    _ffi.register_targets()


def grouped_gemm(x, w, group_sizes, *, x_scale=None, w_scale=None, out_dtype=jnp.bfloat16,
                 transpose_w: bool = False):
    """y = x @ w[l]^T for the rows of each local expert l (native kernels).

    x [R, K] (ragged) or [L, C, K] (expert_major), bf16 or float8_e4m3fn; w [L, N, K] (or, with
    transpose_w, [L, K, N]: y = x @ w[l]); group_sizes [L] int32; fp8: x_scale f32 [..., K/128],
    w_scale f32 [L, N/128, K/128]. Returns y [R, N] or [L, C, N] in out_dtype (bf16 or f32),
    f32 accumulation; rows outside the groups are zero."""
    _require(x, w, x_scale, w_scale, transpose_w)
    out_dtype = np.dtype(out_dtype)
    if out_dtype not in (np.dtype(BF16), np.dtype(np.float32)):
        raise ValueError(f"grouped_gemm: out_dtype must be bfloat16 or float32, got {out_dtype}")
    if transpose_w and out_dtype != np.dtype(BF16):
        raise ValueError("grouped_gemm: transpose_w is built for bf16 out only")
    L = w.shape[0]
    n, k = (w.shape[2], w.shape[1]) if transpose_w else (w.shape[1], w.shape[2])
    fp8 = _dtype(x) == np.dtype(FP8)
    expert_major = x.ndim == 3
    rows = x.shape[1] if expert_major else x.shape[0]
    mode = _MODE_TRANSPOSE_W if transpose_w else _MODE_FORWARD
    tune = tuning()
    ws_bytes = int(_gemm_module().workspace_bytes(fp8, out_dtype == np.dtype(np.float32), mode,
                                                  L, rows, n, k, expert_major, **tune.native_kwargs()))
    empty = jnp.zeros((0,), jnp.float32)
    xs = empty if x_scale is None else x_scale.astype(jnp.float32)
    wsc = empty if w_scale is None else w_scale.astype(jnp.float32)
    y_shape = tuple(x.shape[:-1]) + (n,)
    call = jax.ffi.ffi_call(
        "jax_moe_a2a_grouped_gemm",
        (jax.ShapeDtypeStruct(y_shape, out_dtype), jax.ShapeDtypeStruct((ws_bytes,), jnp.uint8)),
    )
    y, _ = call(x, w, group_sizes.astype(jnp.int32), xs, wsc, mode=np.int32(mode), **tune.attrs())
    return _typed_like(y, x, w, group_sizes, x_scale, w_scale)


def swiglu(gu, *, quantize_hidden: bool = False, block: int = _BLOCK):
    """gu f32 or bf16 [..., 2F] (gate columns 0..F-1, up F..2F-1; other floats are cast to f32) ->
    h = silu(gate) * up computed in f32: (h bf16 [..., F], None), or with quantize_hidden (h
    float8_e4m3fn [..., F], h_scale f32 [..., ceil(F/block)]) by the library's quantiser rule
    (jax_moe_a2a.quant)."""
    why = native_reason()
    if why is not None:
        raise ValueError(f"jax_moe_a2a.gemm_ffi.swiglu: {why}")
    if gu.shape[-1] % 2:
        raise ValueError(f"swiglu: gu's last dimension must be even (2F), got {gu.shape}")
    if not (0 < int(block) <= 256):
        raise ValueError(f"swiglu: block must be in 1..256, got {block}")
    _ffi.register_targets()
    f = gu.shape[-1] // 2
    lead = tuple(gu.shape[:-1])
    nb = -(-f // int(block)) if quantize_hidden else 0
    h_dtype = FP8 if quantize_hidden else BF16
    scale_shape = lead + (nb,) if quantize_hidden else (0,)
    call = jax.ffi.ffi_call(
        "jax_moe_a2a_swiglu",
        (jax.ShapeDtypeStruct(lead + (f,), h_dtype), jax.ShapeDtypeStruct(scale_shape, jnp.float32)),
    )
    gu_in = gu if _dtype(gu) == np.dtype(BF16) else gu.astype(jnp.float32)
    h, hs = call(gu_in, block=np.int64(block))
    h, hs = _typed_like(h, gu), _typed_like(hs, gu)
    return (h, hs) if quantize_hidden else (h, None)


def gu_dtype(quantize_hidden: bool):
    """The dtype the expert MLP's gate+up GEMM writes before the SwiGLU: bf16 when h is re-quantised
    to fp8 (the same rounding in the native and the plain-JAX MLP, jax_moe_a2a.experts), else f32."""
    return jnp.bfloat16 if quantize_hidden else jnp.float32


def grouped_gemm_swiglu(x, w_gate_up, group_sizes, *, x_scale=None, w_scale=None,
                        quantize_hidden: bool = False, block: int = _BLOCK):
    """The first expert-MLP GEMM with the SwiGLU epilogue.

    x as in grouped_gemm; w_gate_up [L, 2F, H] (rows 0..F-1 gate, F..2F-1 up). The GEMM
    accumulates in f32 and writes gu [.., 2F]: f32, or bf16 with quantize_hidden (GU_DTYPE: half
    the bytes written and read back; h's e4m3 rounding, 2^-4, dwarfs bf16's 2^-9); the epilogue
    kernel computes h = silu(gate) * up in f32 and returns (h bf16 [.., F], None), or (h
    float8_e4m3fn [.., F], h_scale f32 [.., F/block]) with quantize_hidden. Rows outside the groups
    give h = 0 (and, quantised, the scale of an all-zero block). Where fused_swiglu_reason says
    None (by default at the swap-AB kernel's token tiles <= 64; JAX_MOE_A2A_GEMM_TILE_M=fused or
    wgmma,fused asks for it wherever our kernel runs, unfused never) the GEMM and the SwiGLU run as
    one kernel with the same values."""
    tune = tuning()
    if quantize_hidden and fused_swiglu_reason(x, w_gate_up, x_scale, w_scale, block, tune) is None:
        return _grouped_gemm_swiglu_fused(x, w_gate_up, group_sizes, x_scale, w_scale, tune)
    gu = grouped_gemm(x, w_gate_up, group_sizes, x_scale=x_scale, w_scale=w_scale,
                      out_dtype=gu_dtype(quantize_hidden))
    return swiglu(gu, quantize_hidden=quantize_hidden, block=block)


def fused_swiglu_reason(x, w_gate_up, x_scale, w_scale, block: int = _BLOCK, tune: Tuning | None = None) -> str | None:
    """None when grouped_gemm_swiglu(..., quantize_hidden=True) runs as ONE kernel (our own fp8
    kernel with the SwiGLU epilogue), else why not (then the GEMM writes bf16 gu and the SwiGLU
    kernel reads it back; the values are the same). For fp8 x and w [L, 2F, K], block 128, where
    the kernel's own rule, _C.gemm.swiglu_reason, takes the call (our kernel runs it: at decode
    shapes, mean rows per expert <= 128, the swap-AB kernel's epilogue; with `wgmma` also at
    prefill, the row-major kernel's, 1.3-1.9x the unfused pair's time on an H200), F % 128 == 0,
    1 to 1,024 local experts, rows and L * 2F below 2^31. By default (tune.fuse_swiglu None) only
    where it measured faster than the pair: the swap-AB kernel's token tiles <= 64 (mean rows per
    expert <= 51; _C.gemm.swiglu_by_default; docs/performance.md). JAX_MOE_A2A_GEMM_TILE_M=fused
    asks for it wherever our kernel runs, unfused never."""
    tune = tuning() if tune is None else tune
    if tune.fuse_swiglu is False:
        return "the fused SwiGLU GEMM was turned off (JAX_MOE_A2A_GEMM_TILE_M=unfused)"
    if tune.kernel == _KERNEL_CUTLASS:
        return "the fused SwiGLU GEMM runs only with our own fp8 kernel (not with JAX_MOE_A2A_GEMM_TILE_M=cutlass)"
    why = native_reason() or native_supported(x, w_gate_up, x_scale, w_scale)
    if why is not None:
        return why
    if _dtype(x) != np.dtype(FP8):
        return "the fused SwiGLU GEMM is fp8 only"
    if int(block) != _BLOCK:
        return f"the fused SwiGLU GEMM quantises h in 128-column blocks, asked {block}"
    L, n2, k = w_gate_up.shape
    expert_major = x.ndim == 3
    shape = (L, x.shape[1] if expert_major else x.shape[0], n2, k, expert_major)
    why = _gemm_module().swiglu_reason(*shape, **tune.native_kwargs())
    if why:
        return why
    if tune.fuse_swiglu is None and not _gemm_module().swiglu_by_default(*shape, **tune.native_kwargs()):
        return ("by default the SwiGLU is fused only at the swap-AB kernel's token tiles <= 64, where it measured "
                "faster than the GEMM and the SwiGLU kernel (JAX_MOE_A2A_GEMM_TILE_M=fused asks for it here)")
    return None


def _grouped_gemm_swiglu_fused(x, w_gate_up, group_sizes, x_scale, w_scale, tune: Tuning):
    """(h float8_e4m3fn [.., F], h_scale f32 [.., F/128]) from one custom call (fused_swiglu_reason
    said None)."""
    _ffi.register_targets()
    f = w_gate_up.shape[1] // 2
    lead = tuple(x.shape[:-1])
    call = jax.ffi.ffi_call(
        "jax_moe_a2a_grouped_gemm_swiglu",
        (jax.ShapeDtypeStruct(lead + (f,), FP8), jax.ShapeDtypeStruct(lead + (f // _BLOCK,), jnp.float32)),
    )
    h, hs = call(x, w_gate_up, group_sizes.astype(jnp.int32), x_scale.astype(jnp.float32), w_scale.astype(jnp.float32),
                 **tune.attrs())
    args = (x, w_gate_up, group_sizes, x_scale, w_scale)
    return _typed_like(h, *args), _typed_like(hs, *args)


def wgrad_supported(x, dy, group_sizes) -> str | None:
    """None when the native wgrad takes these (a static check on .shape and .dtype), else why not.

    x [R, K] / [L, C, K] and dy [R, N] / [L, C, N] both bf16 with the same rows, group_sizes [L];
    K % 8 == 0 and N % 8 == 0; fewer than 2^31 rows."""
    if x.ndim not in (2, 3) or dy.ndim != x.ndim or tuple(x.shape[:-1]) != tuple(dy.shape[:-1]):
        return (f"x and dy must have the same rows: [R, K] and [R, N] (or [L, C, K] and [L, C, N]), got "
                f"{tuple(x.shape)}, {tuple(dy.shape)}")
    if getattr(group_sizes, "ndim", None) != 1:
        return "group_sizes must be [L]"
    L = group_sizes.shape[0]
    if x.ndim == 3 and x.shape[0] != L:
        return f"expert_major x [L, C, K] has L = {x.shape[0]}, group_sizes has {L}"
    if _dtype(x) != np.dtype(BF16) or _dtype(dy) != np.dtype(BF16):
        return f"the native wgrad takes bf16 x and dy, got {_dtype(x)} and {_dtype(dy)}"
    k, n = x.shape[-1], dy.shape[-1]
    if k <= 0 or n <= 0 or k % 8 or n % 8:
        return f"the native wgrad needs K % 8 == 0 and N % 8 == 0 (16-byte rows), got K = {k}, N = {n}"
    rows = x.shape[0] if x.ndim == 2 else x.shape[0] * x.shape[1]
    if rows > _MAX_ROWS or L * n * k > 2**62:
        return "more than 2^31 - 1 rows"
    return None


def grouped_gemm_wgrad(x, dy, group_sizes, *, out_dtype=jnp.float32):
    """dw [L, N, K] with dw[l] = dy_l^T @ x_l over the rows of group l (native kernels, bf16).

    x [R, K] (ragged) or [L, C, K] (expert_major) bf16; dy [R, N] / [L, C, N] bf16 (the same
    rows); group_sizes [L] int32 on the device. Returns dw [L, N, K] in out_dtype (float32, or
    bfloat16: the f32 result rounded), f32 accumulation over the group's rows; a group with no
    rows gives dw[l] = 0; rows outside the groups add nothing (whatever they hold)."""
    why = native_reason() or wgrad_supported(x, dy, group_sizes)
    if why is not None:
        raise ValueError(f"jax_moe_a2a.gemm_ffi.grouped_gemm_wgrad: the native wgrad cannot run this: {why}")
    out_dtype = np.dtype(out_dtype)
    if out_dtype not in (np.dtype(BF16), np.dtype(np.float32)):
        raise ValueError(f"grouped_gemm_wgrad: out_dtype must be bfloat16 or float32, got {out_dtype}")
    _ffi.register_targets()
    L = group_sizes.shape[0]
    k, n = x.shape[-1], dy.shape[-1]
    expert_major = x.ndim == 3
    rows = x.shape[1] if expert_major else x.shape[0]
    # the exact size of the wgrad kernel's workspace (the handler refuses a shorter one)
    tune = tuning()
    ws_bytes = int(_gemm_module().workspace_bytes(False, True, _MODE_WGRAD, L, rows, n, k, expert_major,
                                                  **tune.native_kwargs()))
    empty = jnp.zeros((0,), jnp.float32)
    call = jax.ffi.ffi_call(
        "jax_moe_a2a_grouped_gemm",
        (jax.ShapeDtypeStruct((L, n, k), jnp.float32), jax.ShapeDtypeStruct((ws_bytes,), jnp.uint8)),
    )
    dw, _ = call(x, dy, group_sizes.astype(jnp.int32), empty, empty, mode=np.int32(_MODE_WGRAD), **tune.attrs())
    dw = _typed_like(dw, x, dy, group_sizes)
    return dw.astype(out_dtype)
