"""fp8 (e4m3fn) block quantisation: the FFI op (CPU and CUDA) and its pure-JAX twin.

Rules (shared with cc/core/fp8.h and the NumPy oracle): for each block of `block` consecutive
values of a row (ceil(H / block) blocks; when `block` does not divide H the last one is partial
and its scale comes from its own H % block values only), amax = max|x| over the block's finite
values (0 when it has none), scale = max(amax, 1e-12) * f32(1/448) (optionally rounded up to a
power of two), q = e4m3fn(x * (1 / scale)) rounded to nearest even and saturated at +-448; a NaN
or +-Inf in x quantises to the e4m3fn NaN 0x7F at its own position and changes nothing else.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from . import _ffi
from .dtypes import FP8

FP8_MAX = 448.0
MIN_AMAX = 1e-12
INV_FP8_MAX = np.float32(1.0) / np.float32(FP8_MAX)  # f32(1/448), as in cc/core/fp8.h
FP8_NAN_CODE = 0x7F  # what a NaN or +-Inf in x quantises to (kFp8E4M3NaN in cc/core/fp8.h)


def _check(x, block: int):
    if x.ndim != 2:
        raise ValueError(f"x must be 2-D [rows, hidden], got shape {x.shape}")
    if np.dtype(x.dtype) not in (np.dtype(jnp.float32), np.dtype(jnp.bfloat16), np.dtype(jnp.float16)):
        raise ValueError(f"x must be f32, bf16 or f16, got {x.dtype}")
    if isinstance(block, bool) or not isinstance(block, (int, np.integer)) or block <= 0:
        raise ValueError(f"block must be a positive int, got {block!r}")


def num_blocks(h: int, block: int) -> int:
    """Scales per row: ceil(h / block)."""
    return -(-h // block)


def _pow2_round_up(s):
    bits = jax.lax.bitcast_convert_type(s, jnp.uint32)
    up = (bits & jnp.uint32(0x7F800000)) + jnp.uint32(0x00800000)
    bits = jnp.where((bits & jnp.uint32(0x007FFFFF)) != 0, up, bits)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _e4m3_codes(v):
    """e4m3fn codes (uint8) of f32 values: round to nearest even, saturating at +-448; the bit
    arithmetic of f32_to_e4m3fn in cc/core/fp8.h. (XLA:CPU's own f32 -> f8e4m3fn convert
    rounds twice, through f16: 75.99999 -> 76 -> 80 instead of 72.) Non-finite v: see the caller."""
    bits = jax.lax.bitcast_convert_type(v, jnp.uint32)
    sign = (bits >> 24) & jnp.uint32(0x80)
    mag = bits & jnp.uint32(0x7FFFFFFF)
    # normal: keep 3 mantissa bits, ties to even (a carry moves into the exponent), rebias 127 -> 7
    normal = ((mag + jnp.uint32(0x7FFFF) + ((mag >> 20) & jnp.uint32(1))) >> 20) - jnp.uint32(120 << 3)
    # below 2^-6: subnormal, |v| in units of 2^-9 rounded half to even (8 is the first normal, 2^-6)
    sub = jnp.round(jax.lax.bitcast_convert_type(mag, jnp.float32) * 512.0).astype(jnp.uint32)
    code = jnp.where(mag >= jnp.uint32(0x43E00000), jnp.uint32(0x7E),           # >= 448: saturate
                     jnp.where(mag < jnp.uint32(0x3C800000), sub, normal))
    return (code | sign).astype(jnp.uint8)


def _finite(v):
    """v [...] f32 -> bool: neither NaN nor +-Inf, from the bits (as fp8_finite in cc/core/fp8.h)."""
    return (jax.lax.bitcast_convert_type(v, jnp.uint32) & jnp.uint32(0x7FFFFFFF)) < jnp.uint32(0x7F800000)


def quantize_fp8_jax(x, block: int = 128, pow2_scale: bool = False):
    """Pure-JAX quantiser. x [rows, H] f32/bf16/f16 -> (q [rows, H] e4m3fn, scale [rows, ceil(H/block)] f32).

    Bit-identical to `quantize_fp8` (NaN positions included): a NaN or +-Inf in x is left out of
    its block's amax and quantises to the e4m3fn NaN 0x7F."""
    _check(x, block)
    rows, h = x.shape
    nb = num_blocks(h, block)
    xp = jnp.pad(x.astype(jnp.float32), ((0, 0), (0, nb * block - h)))  # zeros never raise an amax
    xb = xp.reshape(rows, nb, block)
    finite = _finite(xb)
    xb = jnp.where(finite, xb, 0.0)
    amax = jnp.max(jnp.abs(xb), axis=-1)
    scale = jnp.maximum(amax, np.float32(MIN_AMAX)) * INV_FP8_MAX
    if pow2_scale:
        scale = _pow2_round_up(scale)
    inv = 1.0 / scale
    codes = jnp.where(finite, _e4m3_codes(xb * inv[..., None]), jnp.uint8(FP8_NAN_CODE))
    q = jax.lax.bitcast_convert_type(codes, FP8)
    return q.reshape(rows, nb * block)[:, :h], scale


def quantize_fp8(x, block: int = 128, pow2_scale: bool = False):
    """fp8 block quantiser as an XLA FFI call (CPU handler, or the CUDA kernel on GPUs).

    Args:
      x: [rows, H] f32, bf16 or f16.
      block: values per scale (any positive int; the last block is partial when it does not divide H).
      pow2_scale: round each scale up to a power of two.
    Returns:
      (q [rows, H] float8_e4m3fn, scale [rows, ceil(H / block)] float32); x ~= q * scale per block.
      A NaN or +-Inf in x becomes the e4m3fn NaN (0x7F) at its position and is left out of its
      block's scale (docs/api.md, "fp8 quantisation").
    """
    _check(x, block)
    _ffi.register_targets()
    rows, h = x.shape
    call = jax.ffi.ffi_call(
        "jax_moe_a2a_quantize_fp8",
        (jax.ShapeDtypeStruct((rows, h), FP8), jax.ShapeDtypeStruct((rows, num_blocks(h, block)), jnp.float32)),
        vmap_method="sequential",
    )
    return call(x, block=np.int64(block), pow2=np.int32(bool(pow2_scale)))


def dequantize_fp8(q, scale, block: int = 128):
    """q [..., H] e4m3fn, scale [..., ceil(H/block)] f32 -> [..., H] f32 (value h uses scale h // block)."""
    h = q.shape[-1]
    return q.astype(jnp.float32) * jnp.repeat(scale.astype(jnp.float32), block, axis=-1)[..., :h]
