#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "core/fp8.h"
#include "gpu/fp8_code.cuh"
#include "gpu/quantize/quantize_fp8.h"
#include "gpu/warp.cuh"

namespace a2a::gpu {
namespace {

template <typename T>
__device__ __forceinline__ float to_f32(T v);
template <>
__device__ __forceinline__ float to_f32<float>(float v) { return v; }
template <>
__device__ __forceinline__ float to_f32<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }
template <>
__device__ __forceinline__ float to_f32<__half>(__half v) { return __half2float(v); }

constexpr int kWarpsPerCta = 8;

// Grid: one warp per (row, scale block). x [rows, hidden], q [rows, hidden], scale [rows, nb],
// nb = ceil(hidden / block): the last block of a row is partial when block does not divide hidden.
template <typename T>
__global__ void __launch_bounds__(kWarpsPerCta * 32)
    quantize_fp8_kernel(const T* __restrict__ x, __nv_fp8_storage_t* __restrict__ q,
                        float* __restrict__ scale, int64_t total_blocks, int64_t hidden, int64_t nb,
                        int64_t block, bool pow2) {
  const int lane = threadIdx.x & 31;
  const int64_t blk = static_cast<int64_t>(blockIdx.x) * kWarpsPerCta + (threadIdx.x >> 5);
  if (blk >= total_blocks) return;
  const int64_t b = blk % nb;
  const int64_t off = (blk / nb) * hidden + b * block;  // first value of (row, block b)
  const int64_t len = fp8_block_len(hidden, block, b);
  const T* src = x + off;
  float amax = 0.0f;
  for (int64_t i = lane; i < len; i += 32) amax = fmaxf(amax, fp8_amax_term(to_f32(src[i])));  // NaN, Inf: 0
  amax = warp_max(amax);
  const float s = fp8_block_scale(amax, pow2);
  const float inv = __frcp_rn(s);
  if (lane == 0) scale[blk] = s;
  __nv_fp8_storage_t* dst = q + off;
  for (int64_t i = lane; i < len; i += 32) {
    dst[i] = fp8_quantize_value(to_f32(src[i]), inv);
  }
}

template <typename T>
cudaError_t launch_typed(const QuantizeParams& p, cudaStream_t stream) {
  const int64_t nb = fp8_num_blocks(p.hidden, p.scale_block);
  const int64_t total = p.rows * nb;
  if (total == 0) return cudaSuccess;
  const unsigned grid = static_cast<unsigned>((total + kWarpsPerCta - 1) / kWarpsPerCta);
  quantize_fp8_kernel<T><<<grid, kWarpsPerCta * 32, 0, stream>>>(
      static_cast<const T*>(p.x), reinterpret_cast<__nv_fp8_storage_t*>(p.q), p.scale, total, p.hidden, nb,
      p.scale_block, p.pow2_scale);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_quantize_fp8(const QuantizeParams& p, cudaStream_t stream) {
  switch (p.kind) {
    case ElemKind::kF32: return launch_typed<float>(p, stream);
    case ElemKind::kBF16: return launch_typed<__nv_bfloat16>(p, stream);
    case ElemKind::kF16: return launch_typed<__half>(p, stream);
    case ElemKind::kF8E4M3: break;  // not a float kind: decode_quantize refuses it
  }
  return cudaErrorInvalidValue;
}

}  // namespace a2a::gpu
