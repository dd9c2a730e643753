#include "core/quantize.h"

#include <cmath>
#include <cstring>

#include "core/cpu_clones.h"
#include "core/fp8.h"

namespace a2a {

namespace {

// One block: amax, scale, codes. The element kind is a template parameter so that the decode
// inlines into the loops (the per-element switch of load_as_f32 cost as much as the rounding).
template <ElemKind K>
inline __attribute__((always_inline)) void quantize_rows(const QuantizeParams& p, int64_t row_begin,
                                                         int64_t row_end) {
  const int64_t nblocks = fp8_num_blocks(p.hidden, p.scale_block);
  // locals, not p's fields: q is uint8_t, whose stores may alias anything, p included, so reading
  // p.x / p.q inside the loops would reload them per value and keep the loops scalar
  const void* const x = p.x;
  uint8_t* const q = p.q;
  for (int64_t r = row_begin; r < row_end; ++r) {
    for (int64_t b = 0; b < nblocks; ++b) {
      const int64_t base = r * p.hidden + b * p.scale_block;
      const int64_t len = fp8_block_len(p.hidden, p.scale_block, b);  // the last block may be partial
      // amax over the bits: the terms are finite and >= 0 (fp8_amax_term's rule: |v|, 0 for NaN and
      // Inf), whose bit patterns order as their values do, so an integer max in signed 32-bit lanes
      // gives the same value, and vectorises (a float max reduction does not without fast-math)
      int32_t amax_bits = 0;
      for (int64_t i = 0; i < len; ++i) {
        const int32_t m = static_cast<int32_t>(f32_bits(load_as_f32(x, base + i, K)) & 0x7FFFFFFFu);
        const int32_t a = m < 0x7F800000 ? m : 0;
        amax_bits = a > amax_bits ? a : amax_bits;
      }
      const float s = fp8_block_scale(bits_f32(static_cast<uint32_t>(amax_bits)), p.pow2_scale);
      const float inv = 1.0f / s;
      p.scale[r * nblocks + b] = s;
      // fp8_quantize_value's bits, the conversion done for every value and the NaN code selected
      // after; vectorised because this file compiles with -fno-trapping-math (CMakeLists.txt):
      // under the default the selects count as control flow and the loop stays scalar (2.2x slower
      // in the AVX2 clone)
      for (int64_t i = 0; i < len; ++i) {
        const float v = load_as_f32(x, base + i, K);
        const uint8_t code = f32_to_e4m3fn(v * inv);
        q[base + i] = fp8_finite(v) ? code : kFp8E4M3NaN;
      }
    }
  }
}

// Each kind's loops compiled for AVX2 and the baseline (core/cpu_clones.h; the same bits either way).
A2A_CPU_CLONES void quantize_f32(const QuantizeParams& p, int64_t b, int64_t e) {
  quantize_rows<ElemKind::kF32>(p, b, e);
}
A2A_CPU_CLONES void quantize_bf16(const QuantizeParams& p, int64_t b, int64_t e) {
  quantize_rows<ElemKind::kBF16>(p, b, e);
}
A2A_CPU_CLONES void quantize_f16(const QuantizeParams& p, int64_t b, int64_t e) {
  quantize_rows<ElemKind::kF16>(p, b, e);
}

}  // namespace

void quantize_fp8_rows(const QuantizeParams& p, int64_t row_begin, int64_t row_end) {
  switch (p.kind) {
    case ElemKind::kF32: return quantize_f32(p, row_begin, row_end);
    case ElemKind::kBF16: return quantize_bf16(p, row_begin, row_end);
    case ElemKind::kF16: return quantize_f16(p, row_begin, row_end);
    case ElemKind::kF8E4M3: return;  // not a float kind: decode_quantize refuses it
  }
}

}  // namespace a2a
