// Byte copies of the kernels: 32-bit fields at unaligned addresses (a row's trailer), and the
// warp-wide row copy and zero fill with 16-byte accesses where both ends allow them.
#pragma once

#include <cstdint>

#include "gpu/ptx.cuh"

namespace a2a::gpu {

// 32 bits at a byte address that need not be 4-byte aligned (an fp8 row's scales and its token
// and weight follow its H payload bytes, so they are misaligned when H % 4 != 0). The unaligned
// path is four byte accesses written out: a memcpy there was merged with the aligned branch into
// one 4-byte load (compute-sanitizer: misaligned read in dispatch_recv, H = 30).
__device__ __forceinline__ void store_u32(uint8_t* p, uint32_t v) {
  if ((reinterpret_cast<uintptr_t>(p) & 3) == 0) {
    *reinterpret_cast<uint32_t*>(p) = v;
    return;
  }
  volatile uint8_t* b = p;
  b[0] = uint8_t(v);
  b[1] = uint8_t(v >> 8);
  b[2] = uint8_t(v >> 16);
  b[3] = uint8_t(v >> 24);
}
__device__ __forceinline__ uint32_t load_u32(const uint8_t* p) {
  if ((reinterpret_cast<uintptr_t>(p) & 3) == 0) return *reinterpret_cast<const uint32_t*>(p);
  const volatile uint8_t* b = p;
  return uint32_t(b[0]) | uint32_t(b[1]) << 8 | uint32_t(b[2]) << 16 | uint32_t(b[3]) << 24;
}
__device__ __forceinline__ void store_f32(uint8_t* p, float v) { store_u32(p, __float_as_uint(v)); }
__device__ __forceinline__ float load_f32(const uint8_t* p) { return __uint_as_float(load_u32(p)); }

__device__ __forceinline__ bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

// The calling warp copies `bytes` bytes: 16-byte volatile loads when both ends are 16-byte aligned
// (rows of XLA arrays are not when H * element size % 16 != 0), bytes otherwise. A lane issues
// kCopyBatch 16-byte loads (predicated past the end) before any of their stores, so that a lane's
// whole share of a decode row segment is in flight at once: with a batch of 4 and a serial tail,
// a 3.5 KB segment (7 vectors a lane) took four load latencies, the profile's top stall in
// dispatch_recv and combine_send (2026-12-01, third session).
constexpr int kCopyBatch = 8;
__device__ __forceinline__ void warp_copy(uint8_t* dst, const uint8_t* src, int64_t bytes, int lane) {
  if (!aligned16(dst) || !aligned16(src)) {
    for (int64_t i = lane; i < bytes; i += 32) dst[i] = src[i];
    return;
  }
  const int64_t nv = bytes / 16;
  const int4* s4 = reinterpret_cast<const int4*>(src);
  int4* d4 = reinterpret_cast<int4*>(dst);
  for (int64_t i0 = lane; i0 < nv; i0 += 32 * kCopyBatch) {
    int4 v[kCopyBatch];
#pragma unroll
    for (int u = 0; u < kCopyBatch; ++u)
      if (i0 + 32 * u < nv) v[u] = ptx::ld_volatile_v4(s4 + i0 + 32 * u);
#pragma unroll
    for (int u = 0; u < kCopyBatch; ++u)
      if (i0 + 32 * u < nv) d4[i0 + 32 * u] = v[u];
  }
  for (int64_t i = nv * 16 + lane; i < bytes; i += 32) dst[i] = src[i];
}

// The calling warp zeroes `bytes` bytes: 16-byte stores when dst is 16-byte aligned (combine rows
// of H * element size % 16 != 0 bytes are not), bytes otherwise.
__device__ __forceinline__ void warp_zero(uint8_t* dst, int64_t bytes, int lane) {
  if (!aligned16(dst)) {
    for (int64_t i = lane; i < bytes; i += 32) dst[i] = 0;
    return;
  }
  const int64_t nv = bytes / 16;
  int4* d4 = reinterpret_cast<int4*>(dst);
  for (int64_t i = lane; i < nv; i += 32) d4[i] = make_int4(0, 0, 0, 0);
  for (int64_t i = nv * 16 + lane; i < bytes; i += 32) dst[i] = 0;
}

}  // namespace a2a::gpu
