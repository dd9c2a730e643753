// CPU fp8 block quantiser (the CPU twin of cc/cuda/quantize/quantize_fp8.cu).
#pragma once

#include <cstdint>

namespace a2a {

enum class FloatKind : int { kF32 = 0, kBF16 = 1, kF16 = 2 };

// Decodes one 16- or 32-bit float element to f32.
float load_as_f32(const void* base, int64_t index, FloatKind kind);

struct QuantizeParams {
  const void* x = nullptr;   // [rows, hidden] in `kind`
  FloatKind kind = FloatKind::kF32;
  int64_t rows = 0;
  int64_t hidden = 0;
  int64_t scale_block = 128;  // divides hidden
  bool pow2_scale = false;
  uint8_t* q = nullptr;       // [rows, hidden] e4m3fn bits
  float* scale = nullptr;     // [rows, hidden / scale_block] f32
};

// Quantises rows [row_begin, row_end) (the whole tensor by default).
void quantize_fp8_rows(const QuantizeParams& p, int64_t row_begin, int64_t row_end);
inline void quantize_fp8(const QuantizeParams& p) { quantize_fp8_rows(p, 0, p.rows); }

}  // namespace a2a
