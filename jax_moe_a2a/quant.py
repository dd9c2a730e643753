"""fp8 (e4m3fn) block quantisation: the FFI op (CPU and CUDA) and its pure-JAX twin.

Rules (shared with cc/core/fp8.h and the NumPy oracle): for each block of `block` consecutive
values of a row (ceil(H / block) blocks; when `block` does not divide H the last one is partial
and its scale comes from its own H % block values only), amax = max|x|, scale = max(amax, 1e-12) * f32(1/448) (optionally rounded up to a power
of two), q = e4m3fn(x * (1 / scale)) rounded to nearest even and saturated at +-448.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from . import _ffi

FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0
MIN_AMAX = 1e-12
INV_FP8_MAX = np.float32(1.0) / np.float32(FP8_MAX)  # f32(1/448), as in cc/core/fp8.h


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


def _round_to_e4m3(v):
    """Rounds f32 values (|v| <= 448) to the nearest e4m3fn value, ties to even, staying in f32.

    XLA:CPU converts f32 -> f8e4m3fn through f16 (double rounding: 75.99999 -> 76 -> 80 instead
    of 72), so the rounding is done here exactly and the final cast only changes the type.
    """
    bits = jax.lax.bitcast_convert_type(v, jnp.uint32)
    lsb = (bits >> 20) & jnp.uint32(1)
    normal = jax.lax.bitcast_convert_type((bits + jnp.uint32(0x7FFFF) + lsb) & jnp.uint32(0xFFF00000), jnp.float32)
    sub = jnp.round(v * 512.0) / 512.0          # below 2^-6: multiples of 2^-9 (round half to even)
    return jnp.where(jnp.abs(v) < 2.0**-6, sub, normal)


def quantize_fp8_jax(x, block: int = 128, pow2_scale: bool = False):
    """Pure-JAX quantiser. x [rows, H] f32/bf16/f16 -> (q [rows, H] e4m3fn, scale [rows, ceil(H/block)] f32)."""
    _check(x, block)
    rows, h = x.shape
    nb = num_blocks(h, block)
    xp = jnp.pad(x.astype(jnp.float32), ((0, 0), (0, nb * block - h)))  # zeros never raise an amax
    xb = xp.reshape(rows, nb, block)
    amax = jnp.max(jnp.abs(xb), axis=-1)
    scale = jnp.maximum(amax, np.float32(MIN_AMAX)) * INV_FP8_MAX
    if pow2_scale:
        scale = _pow2_round_up(scale)
    inv = 1.0 / scale
    q = _round_to_e4m3(jnp.clip(xb * inv[..., None], -FP8_MAX, FP8_MAX)).astype(FP8)
    return q.reshape(rows, nb * block)[:, :h], scale


def quantize_fp8(x, block: int = 128, pow2_scale: bool = False):
    """fp8 block quantiser as an XLA FFI call (CPU handler, or the CUDA kernel on GPUs).

    Args:
      x: [rows, H] f32, bf16 or f16.
      block: values per scale (any positive int; the last block is partial when it does not divide H).
      pow2_scale: round each scale up to a power of two.
    Returns:
      (q [rows, H] float8_e4m3fn, scale [rows, ceil(H / block)] float32); x ~= q * scale per block.
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
