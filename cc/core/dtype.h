// The library's one code for an element dtype on the wire and in buffers, shared by every backend
// and by Python (jax_moe_a2a.config.Dtype has the same values; _C.Dtype binds this enum). The GPU
// kernels' parameter structs carry it typed (int-sized: Geometry::wire_kind, the *_kind fields),
// and XLA dtypes map to it in one place (ffi/common.h, elem_kind_of).
#pragma once

#include <cstdint>

#include "core/hd.h"

namespace a2a {

// Wire/storage element kinds: three float kinds and fp8 e4m3fn (fp8 needs its block scales).
enum class ElemKind : int { kF32 = 0, kBF16 = 1, kF16 = 2, kF8E4M3 = 3 };

// The 16/32-bit float kinds (what the fp8 quantiser takes, what the f32 sums round to).
A2A_HD bool is_float(ElemKind k) { return k != ElemKind::kF8E4M3; }

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
