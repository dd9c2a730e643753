#include "core/quantize.h"

#include <cmath>
#include <cstring>

#include "core/fp8.h"

namespace a2a {

namespace {

// One block: amax, scale, codes. The element kind is a template parameter so that the decode
// inlines into the loops (the per-element switch of load_as_f32 cost as much as the rounding).
template <ElemKind K>
void quantize_rows(const QuantizeParams& p, int64_t row_begin, int64_t row_end) {
  const int64_t nblocks = fp8_num_blocks(p.hidden, p.scale_block);
  for (int64_t r = row_begin; r < row_end; ++r) {
    for (int64_t b = 0; b < nblocks; ++b) {
      const int64_t base = r * p.hidden + b * p.scale_block;
      const int64_t len = fp8_block_len(p.hidden, p.scale_block, b);  // the last block may be partial
      float amax = 0.0f;
      for (int64_t i = 0; i < len; ++i) {
        const float a = fp8_amax_term(load_as_f32(p.x, base + i, K));  // 0 for NaN and Inf
        amax = a > amax ? a : amax;
      }
      const float s = fp8_block_scale(amax, p.pow2_scale);
      const float inv = 1.0f / s;
      p.scale[r * nblocks + b] = s;
      for (int64_t i = 0; i < len; ++i) p.q[base + i] = fp8_quantize_value(load_as_f32(p.x, base + i, K), inv);
    }
  }
}

}  // namespace

void quantize_fp8_rows(const QuantizeParams& p, int64_t row_begin, int64_t row_end) {
  switch (p.kind) {
    case ElemKind::kF32: return quantize_rows<ElemKind::kF32>(p, row_begin, row_end);
    case ElemKind::kBF16: return quantize_rows<ElemKind::kBF16>(p, row_begin, row_end);
    case ElemKind::kF16: return quantize_rows<ElemKind::kF16>(p, row_begin, row_end);
    case ElemKind::kF8E4M3: return;  // not a float kind: decode_quantize refuses it
  }
}

}  // namespace a2a
