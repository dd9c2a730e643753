// fp8 (e4m3fn) block quantisation rules shared by the CPU code and the CUDA kernels.
//
// A block of `scale_block` consecutive values of one row shares one f32 scale. A row of H values
// has ceil(H / scale_block) blocks; when scale_block does not divide H the last block is partial
// (H % scale_block values) and everything below is over the values it has:
//   amax  = max |x| over the block's finite values (f32; 0 when it has none)
//   scale = max(amax, kMinAmax) * f32(1/448)           (or that value rounded up to a power of two)
//   q     = e4m3fn(x * (1 / scale)), round to nearest even, saturating at +-448, for finite x;
//           0x7F (the e4m3fn NaN, positive) for a NaN or +-Inf x
// A NaN or Inf thus stays a NaN at its own position and changes nothing else: the block's scale
// and its other values are those of the block with that value replaced by 0 (docs/api.md,
// "fp8 quantisation"). fp8_amax_term and fp8_quantize_value below are that rule; every quantiser
// (CPU, the CUDA quantize kernel and the send kernels) goes through them.
// (a reciprocal then a multiply: what XLA makes of a division by a broadcast scale, so the
// pure-JAX twin agrees bit for bit)
// Dequantisation is q * scale. These rules are the contract the NumPy oracle mirrors.
#pragma once

#include <cstdint>
#include <cstring>
#include <cmath>

#include "core/hd.h"

namespace a2a {

constexpr float kFp8E4M3Max = 448.0f;
constexpr float kMinAmax = 1e-12f;
// scale = amax * (1/448) with the reciprocal rounded to f32: a multiply, so that XLA (which turns
// division by a constant into this multiply) and every other implementation agree bit for bit.
constexpr float kInvFp8E4M3Max = 1.0f / 448.0f;

A2A_HD uint32_t f32_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
#endif
}

A2A_HD float bits_f32(uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(b);
#else
  float f;
  std::memcpy(&f, &b, 4);
  return f;
#endif
}

// Scales per row: ceil(hidden / block) (block > 0).
A2A_HD int64_t fp8_num_blocks(int64_t hidden, int64_t block) { return (hidden + block - 1) / block; }

// Values in block b of a row: block, or what is left of the row for the last block.
A2A_HD int64_t fp8_block_len(int64_t hidden, int64_t block, int64_t b) {
  const int64_t left = hidden - b * block;
  return left < block ? left : block;
}

// Whether v is finite (neither NaN nor +-Inf), from its bits (immune to fast-math flags).
A2A_HD bool fp8_finite(float v) { return (f32_bits(v) & 0x7FFFFFFFu) < 0x7F800000u; }

// One value's contribution to its block's amax: |v| when finite, else 0 (so a plain max, fmaxf
// included, never meets a NaN).
A2A_HD float fp8_amax_term(float v) { return fp8_finite(v) ? bits_f32(f32_bits(v) & 0x7FFFFFFFu) : 0.0f; }

// The code a non-finite value quantises to: the e4m3fn NaN with the sign bit clear (e4m3fn has no
// Inf; the sign of a NaN means nothing, and fixing it keeps every implementation bit-identical).
constexpr uint8_t kFp8E4M3NaN = 0x7F;

// The per-block scale from the block's max-abs value. pow2: round the scale up to a power of two
// (exact bit arithmetic, so every implementation agrees).
A2A_HD float fp8_block_scale(float amax, bool pow2) {
  float s = fmaxf(amax, kMinAmax) * kInvFp8E4M3Max;
  if (pow2) {
    uint32_t b = f32_bits(s);
    if (b & 0x007FFFFFu) b = (b & 0x7F800000u) + 0x00800000u;
    s = bits_f32(b);
  }
  return s;
}

// float -> e4m3fn bits, round to nearest even, saturating to +-448, NaN -> 0x7F.
// Host implementation on the f32 bits (the CUDA kernels use the hardware conversion, which
// agrees; tests/test_quant.py checks every e4m3 value and every midpoint against the oracle).
inline uint8_t f32_to_e4m3fn(float f) {
  // Branch-free (every case computed, then selected), in signed 32-bit lanes (the magnitude's top
  // bit is clear): with core/quantize.cc's amax over the bits, the host packer's 64 x 1,024 bf16
  // tokens went from 188 to 120 us on the 2-core VM (2026-12-06; from 130 with the branching
  // form). Bit-identical to the branching form on all 2^32 inputs (checked exhaustively then).
  const int32_t bits = static_cast<int32_t>(f32_bits(f));
  const int32_t sign = (bits >> 24) & 0x80;
  const int32_t mag = bits & 0x7FFFFFFF;
  // below 2^-6: subnormal, the code is |f| in units of 2^-9 (8 -> 2^-6, the first normal).
  // |f| * 512 is exact and < 8; adding and removing 2^23 rounds it to nearest even. (Other
  // magnitudes go in as 0, keeping the float arithmetic finite.)
  const bool small = mag < 0x3C800000;
  const float units = bits_f32(static_cast<uint32_t>(small ? mag : 0)) * 512.0f;
  const int32_t subnormal = static_cast<int32_t>((units + 8388608.0f) - 8388608.0f);
  // normal: keep 3 mantissa bits, round to nearest even (a carry moves into the exponent), and
  // rebias the exponent from 127 to 7. (mag + 0x80000 < 2^31 for every mag.)
  const int32_t r = mag + 0x7FFFF + ((mag >> 20) & 1);
  int32_t code = small ? subnormal : (r >> 20) - (120 << 3);
  code = mag >= 0x43E00000 ? 0x7E : code;  // >= 448 (and inf): saturate
  code = mag > 0x7F800000 ? 0x7F : code;   // NaN
  return static_cast<uint8_t>(sign | code);
}

// One quantised value on the host: v * inv (inv = 1 / its block's scale) as e4m3fn, or
// kFp8E4M3NaN for a NaN or Inf v. The device twin is gpu/fp8_code.cuh's.
inline uint8_t fp8_quantize_value(float v, float inv) {
  return fp8_finite(v) ? f32_to_e4m3fn(v * inv) : kFp8E4M3NaN;
}

// e4m3fn bits -> float (exact).
inline float e4m3fn_to_f32(uint8_t v) {
  float sign = (v & 0x80) ? -1.0f : 1.0f;
  int e = (v >> 3) & 0xF, m = v & 0x7;
  if (e == 0xF && m == 0x7) return NAN;
  if (e == 0) return sign * std::ldexp(static_cast<float>(m), -9);
  return sign * std::ldexp(1.0f + m / 8.0f, e - 7);
}

}  // namespace a2a
