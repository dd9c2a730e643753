// CPU fp8 block quantiser (the CPU twin of cc/gpu/quantize/quantize_fp8.cu).
#pragma once

#include <cmath>
#include <cstdint>

#include "core/dtype.h"
#include "core/fp8.h"

namespace a2a {

// Decodes one 16- or 32-bit float element (is_float(kind)) to f32 (inline: it sits in every
// element loop; core/floats.h's load_elem takes fp8 too).
inline float load_as_f32(const void* base, int64_t index, ElemKind kind) {
  switch (kind) {
    case ElemKind::kF32:
      return static_cast<const float*>(base)[index];
    case ElemKind::kBF16: {
      uint32_t b = static_cast<uint32_t>(static_cast<const uint16_t*>(base)[index]) << 16;
      return bits_f32(b);
    }
    case ElemKind::kF16: {
      uint16_t h = static_cast<const uint16_t*>(base)[index];
      uint32_t sign = (h & 0x8000u) << 16;
      int e = (h >> 10) & 0x1F;
      uint32_t m = h & 0x3FFu;
      if (e == 0x1F) return bits_f32(sign | 0x7F800000u | (m << 13));
      if (e == 0) {
        float v = std::ldexp(static_cast<float>(m), -24);
        return sign ? -v : v;
      }
      return bits_f32(sign | (static_cast<uint32_t>(e - 15 + 127) << 23) | (m << 13));
    }
    case ElemKind::kF8E4M3: break;  // not a float kind
  }
  return 0.0f;
}

struct QuantizeParams {
  const void* x = nullptr;   // [rows, hidden] in `kind`
  ElemKind kind = ElemKind::kF32;  // is_float(kind)
  int64_t rows = 0;
  int64_t hidden = 0;
  int64_t scale_block = 128;  // any > 0: ceil(hidden / scale_block) blocks, the last one may be partial
  bool pow2_scale = false;
  uint8_t* q = nullptr;       // [rows, hidden] e4m3fn bits
  float* scale = nullptr;     // [rows, ceil(hidden / scale_block)] f32
};

// Quantises rows [row_begin, row_end) (the whole tensor by default).
void quantize_fp8_rows(const QuantizeParams& p, int64_t row_begin, int64_t row_end);
inline void quantize_fp8(const QuantizeParams& p) { quantize_fp8_rows(p, 0, p.rows); }

}  // namespace a2a
