// Float conversions used by the CPU paths (round to nearest even, as XLA and NumPy do).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "core/dtype.h"
#include "core/fp8.h"
#include "core/quantize.h"

namespace a2a {

inline uint16_t f32_to_bf16(float f) {
  uint32_t b = f32_bits(f);
  if ((b & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((b >> 16) | 0x40);  // quiet NaN
  b += 0x7FFFu + ((b >> 16) & 1u);
  return static_cast<uint16_t>(b >> 16);
}

inline uint16_t f32_to_f16(float f) {
  uint32_t b = f32_bits(f);
  uint16_t sign = static_cast<uint16_t>((b >> 16) & 0x8000u);
  uint32_t abs = b & 0x7FFFFFFFu;
  if (abs > 0x7F800000u) return sign | 0x7E00;                 // NaN
  if (abs >= 0x477FF000u) return sign | 0x7C00;                // rounds to >= 65520: inf
  if (abs < 0x38800000u) {                                     // below 2^-14: subnormal or zero
    float a = bits_f32(abs);
    return sign | static_cast<uint16_t>(std::nearbyint(a * 16777216.0f));  // units of 2^-24
  }
  uint32_t r = abs + 0xFFFu + ((abs >> 13) & 1u);              // round mantissa to 10 bits
  return sign | static_cast<uint16_t>(((r >> 13) - ((127 - 15) << 10)) & 0xFFFF);
}

inline float load_elem(const void* base, int64_t i, ElemKind k) {
  if (k == ElemKind::kF8E4M3) return e4m3fn_to_f32(static_cast<const uint8_t*>(base)[i]);
  return load_as_f32(base, i, k);
}

inline void store_elem(void* base, int64_t i, ElemKind k, float v) {
  switch (k) {
    case ElemKind::kF32: static_cast<float*>(base)[i] = v; break;
    case ElemKind::kBF16: static_cast<uint16_t*>(base)[i] = f32_to_bf16(v); break;
    case ElemKind::kF16: static_cast<uint16_t*>(base)[i] = f32_to_f16(v); break;
    case ElemKind::kF8E4M3: static_cast<uint8_t*>(base)[i] = f32_to_e4m3fn(v); break;
  }
}

}  // namespace a2a
