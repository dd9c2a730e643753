// The kernels' element kinds (ElemKind, core/dtype.h: Geometry::wire_kind, the *_kind fields of
// the parameter structs) as f32: one element at a time, or eight with 16-byte accesses.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "core/dtype.h"
#include "gpu/ptx.cuh"

namespace a2a::gpu {

__device__ __forceinline__ float load_elem(const void* base, int64_t i, ElemKind kind) {
  switch (kind) {
    case ElemKind::kF32: return static_cast<const float*>(base)[i];
    case ElemKind::kBF16: return __bfloat162float(static_cast<const __nv_bfloat16*>(base)[i]);
    case ElemKind::kF16: return __half2float(static_cast<const __half*>(base)[i]);
    case ElemKind::kF8E4M3:
    default: {
      __nv_fp8_e4m3 v;
      v.__x = static_cast<const __nv_fp8_storage_t*>(base)[i];
      return float(v);
    }
  }
}

__device__ __forceinline__ void store_elem(void* base, int64_t i, ElemKind kind, float v) {
  switch (kind) {
    case ElemKind::kF32: static_cast<float*>(base)[i] = v; break;
    case ElemKind::kBF16: static_cast<__nv_bfloat16*>(base)[i] = __float2bfloat16_rn(v); break;
    case ElemKind::kF16: static_cast<__half*>(base)[i] = __float2half_rn(v); break;
    case ElemKind::kF8E4M3:
    default:
      static_cast<__nv_fp8_storage_t*>(base)[i] = __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3);
  }
}

// Eight consecutive elements of float kind Kind (f32, bf16, f16) at element h of `row`, as raw
// 16-byte volatile loads (two for f32; no stale L1 lines of a peer-written region; h a multiple
// of 8, row 16-byte aligned), and those raw vectors as f32. Apart so that a caller can issue a
// whole batch of loads before the first conversion waits on one (combine_recv: gpu/reduce.cuh).
template <ElemKind Kind>
__device__ __forceinline__ void load_raw8(const uint8_t* row, int64_t h, int4 r[2]) {
  if constexpr (Kind == ElemKind::kF32) {
    const int4* p = reinterpret_cast<const int4*>(row + h * 4);
    r[0] = ptx::ld_volatile_v4(p);
    r[1] = ptx::ld_volatile_v4(p + 1);
  } else {
    r[0] = ptx::ld_volatile_v4(reinterpret_cast<const int4*>(row + h * 2));
  }
}
// The same from a buffer no one writes while the kernel runs (dispatch's x): read-only loads
// that L1 keeps, so that a warp's two loads of one 32-byte lane share their lines.
template <ElemKind Kind>
__device__ __forceinline__ void load_raw8_ro(const uint8_t* row, int64_t h, int4 r[2]) {
  if constexpr (Kind == ElemKind::kF32) {
    const int4* p = reinterpret_cast<const int4*>(row + h * 4);
    r[0] = __ldg(p);
    r[1] = __ldg(p + 1);
  } else {
    r[0] = __ldg(reinterpret_cast<const int4*>(row + h * 2));
  }
}
template <ElemKind Kind>
__device__ __forceinline__ void raw8_to_f32(const int4 r[2], float v[8]) {
  if constexpr (Kind == ElemKind::kF32) {
    const int w[8] = {r[0].x, r[0].y, r[0].z, r[0].w, r[1].x, r[1].y, r[1].z, r[1].w};
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = __int_as_float(w[j]);
  } else {
    const uint32_t w[4] = {uint32_t(r[0].x), uint32_t(r[0].y), uint32_t(r[0].z), uint32_t(r[0].w)};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if constexpr (Kind == ElemKind::kBF16) {
        v[2 * j] = __uint_as_float(w[j] << 16);
        v[2 * j + 1] = __uint_as_float(w[j] & 0xffff0000u);
      } else {
        v[2 * j] = __half2float(__ushort_as_half(static_cast<unsigned short>(w[j] & 0xffffu)));
        v[2 * j + 1] = __half2float(__ushort_as_half(static_cast<unsigned short>(w[j] >> 16)));
      }
    }
  }
}

// Eight consecutive elements base[i .. i+8) of a float kind (f32, bf16 or f16) as f32, the kind
// chosen at run time (load_raw8 and raw8_to_f32 for one known at compile time).
__device__ __forceinline__ void load_vec8(const void* base, int64_t i, ElemKind kind, float v[8]) {
  const uint8_t* b = static_cast<const uint8_t*>(base);
  int4 r[2];
  if (kind == ElemKind::kF32) {
    load_raw8<ElemKind::kF32>(b, i, r);
    raw8_to_f32<ElemKind::kF32>(r, v);
  } else if (kind == ElemKind::kBF16) {
    load_raw8<ElemKind::kBF16>(b, i, r);
    raw8_to_f32<ElemKind::kBF16>(r, v);
  } else {
    load_raw8<ElemKind::kF16>(b, i, r);
    raw8_to_f32<ElemKind::kF16>(r, v);
  }
}

// Stores eight f32 values as a float kind at base[i .. i+8) with 16-byte stores (round to nearest even).
__device__ __forceinline__ void store_vec8(void* base, int64_t i, ElemKind kind, const float v[8]) {
  if (kind == ElemKind::kF32) {
    int4* p = reinterpret_cast<int4*>(static_cast<float*>(base) + i);
    p[0] = make_int4(__float_as_int(v[0]), __float_as_int(v[1]), __float_as_int(v[2]), __float_as_int(v[3]));
    p[1] = make_int4(__float_as_int(v[4]), __float_as_int(v[5]), __float_as_int(v[6]), __float_as_int(v[7]));
    return;
  }
  uint32_t w[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    uint32_t lo, hi;
    if (kind == ElemKind::kBF16) {
      lo = __bfloat16_as_ushort(__float2bfloat16_rn(v[2 * j]));
      hi = __bfloat16_as_ushort(__float2bfloat16_rn(v[2 * j + 1]));
    } else {
      lo = __half_as_ushort(__float2half_rn(v[2 * j]));
      hi = __half_as_ushort(__float2half_rn(v[2 * j + 1]));
    }
    w[j] = lo | (hi << 16);
  }
  *reinterpret_cast<int4*>(static_cast<uint8_t*>(base) + i * 2) = make_int4(int(w[0]), int(w[1]), int(w[2]), int(w[3]));
}

}  // namespace a2a::gpu
