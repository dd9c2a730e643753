// Warp-wide reductions over all 32 lanes (full mask, every lane taking part): an xor butterfly, so
// every lane returns the result. For integers and max the result does not depend on the order.
#pragma once

namespace a2a::gpu {

// The sum of v over the warp (int, unsigned, unsigned long long, ...).
template <class T>
__device__ __forceinline__ T warp_sum(T v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

// The largest v over each aligned group of kWidth lanes (kWidth a power of two <= 32; every lane of
// the warp takes part, each group gets its own result; fmaxf: a NaN loses to a number).
template <int kWidth>
__device__ __forceinline__ float group_max(float v) {
  static_assert(kWidth > 0 && kWidth <= 32 && (kWidth & (kWidth - 1)) == 0, "kWidth: a power of two <= 32");
#pragma unroll
  for (int off = kWidth / 2; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
  return v;
}

// The largest v over the warp.
__device__ __forceinline__ float warp_max(float v) { return group_max<32>(v); }

}  // namespace a2a::gpu
