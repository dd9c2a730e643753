// The library's one code for an element dtype on the wire and in buffers, shared by every backend
// and by Python (jax_moe_a2a.config.Dtype has the same values; _C.Dtype binds this enum). The GPU
// kernels carry it as an int (Geometry::wire_kind, the x_kind / y_kind operands).
#pragma once

#include <cstdint>

#include "core/hd.h"

namespace a2a {

// Wire/storage element kinds: the three float kinds of core/quantize.h (same codes) plus fp8 e4m3fn.
enum class ElemKind : int { kF32 = 0, kBF16 = 1, kF16 = 2, kF8E4M3 = 3 };

A2A_HD int elem_bytes(ElemKind k) {
  return k == ElemKind::kF32 ? 4 : k == ElemKind::kF8E4M3 ? 1 : 2;
}

inline const char* elem_name(ElemKind k) {
  switch (k) {
    case ElemKind::kF32: return "float32";
    case ElemKind::kBF16: return "bfloat16";
    case ElemKind::kF16: return "float16";
    case ElemKind::kF8E4M3: return "float8_e4m3fn";
  }
  return "?";
}

}  // namespace a2a
