#include "core/quantize.h"

#include <cmath>
#include <cstring>

#include "core/fp8.h"

namespace a2a {

float load_as_f32(const void* base, int64_t index, FloatKind kind) {
  switch (kind) {
    case FloatKind::kF32:
      return static_cast<const float*>(base)[index];
    case FloatKind::kBF16: {
      uint32_t b = static_cast<uint32_t>(static_cast<const uint16_t*>(base)[index]) << 16;
      return bits_f32(b);
    }
    case FloatKind::kF16: {
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
  }
  return 0.0f;
}

void quantize_fp8_rows(const QuantizeParams& p, int64_t row_begin, int64_t row_end) {
  const int64_t nblocks = p.hidden / p.scale_block;
  for (int64_t r = row_begin; r < row_end; ++r) {
    for (int64_t b = 0; b < nblocks; ++b) {
      const int64_t base = r * p.hidden + b * p.scale_block;
      float amax = 0.0f;
      for (int64_t i = 0; i < p.scale_block; ++i) {
        amax = std::fmax(amax, std::fabs(load_as_f32(p.x, base + i, p.kind)));
      }
      const float s = fp8_block_scale(amax, p.pow2_scale);
      const float inv = 1.0f / s;
      p.scale[r * nblocks + b] = s;
      for (int64_t i = 0; i < p.scale_block; ++i) {
        p.q[base + i] = f32_to_e4m3fn(load_as_f32(p.x, base + i, p.kind) * inv);
      }
    }
  }
}

}  // namespace a2a
