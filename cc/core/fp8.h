// fp8 (e4m3fn) block quantisation rules shared by the CPU code and the CUDA kernels.
//
// A block of `scale_block` consecutive values of one row shares one f32 scale:
//   amax  = max |x| over the block (f32)
//   scale = max(amax, kMinAmax) * f32(1/448)           (or that value rounded up to a power of two)
//   q     = e4m3fn(x * (1 / scale)), round to nearest even, saturating at +-448
// (a reciprocal then a multiply: what XLA makes of a division by a broadcast scale, so the
// pure-JAX twin agrees bit for bit)
// Dequantisation is q * scale. These rules are the contract the NumPy oracle mirrors.
#pragma once

#include <cstdint>
#include <cstring>
#include <cmath>

#if defined(__CUDACC__)
#define A2A_HD __host__ __device__ __forceinline__
#else
#define A2A_HD inline
#endif

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
// Host reference implementation (the CUDA kernels use the hardware conversion, which agrees).
inline uint8_t f32_to_e4m3fn(float f) {
  uint8_t sign = (f32_bits(f) >> 24) & 0x80;
  float a = std::fabs(f);
  if (std::isnan(a)) return sign | 0x7F;
  if (a >= kFp8E4M3Max) return sign | 0x7E;
  if (a < 0.015625f) {  // below 2^-6: subnormal, code == mantissa in units of 2^-9 (8 -> 2^-6)
    return sign | static_cast<uint8_t>(std::nearbyint(a * 512.0f));
  }
  int e;
  float m = std::frexp(a, &e);  // a = m * 2^e, m in [0.5, 1)
  m *= 2.0f;
  e -= 1;                        // a = m * 2^e, m in [1, 2)
  int q = static_cast<int>(std::nearbyint((m - 1.0f) * 8.0f));
  if (q == 8) {
    q = 0;
    e += 1;
  }
  return sign | static_cast<uint8_t>(((e + 7) << 3) | q);
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
