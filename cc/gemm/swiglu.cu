// The SwiGLU epilogue kernel (launch_swiglu, grouped_gemm.h): h = silu(gate) * up over the gate+up
// GEMM's output, in bf16 or quantised to e4m3 with 1 x block scales. Its own translation unit:
// nothing of CUTLASS, so benchmarks/gemm_probe.cu links it beside our fp8 kernels.
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "core/fp8.h"
#include "gemm/grouped_gemm.h"
#include "gemm/silu.cuh"
#include "gpu/fp8_code.cuh"
#include "gpu/pdl.cuh"
#include "gpu/warp.cuh"

namespace a2a::gemm {
namespace {

constexpr int kSwigluThreads = 128;  // 4 warps, one (row, 128-column block) per warp

// Programmatic dependent launch (launch_swiglu_of sets the attribute, gpu/pdl.cuh): a SwiGLU kernel
// may start while the gate+up GEMM finishes, and waits for it before reading gu; the down GEMM may
// then start its own prologue at once. Every thread, first thing.
__device__ __forceinline__ void wait_previous_allow_next() {
  gpu::wait_for_previous_grid();
  gpu::allow_next_grid();
}

__device__ inline float to_f32(float v) { return v; }
__device__ inline float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }

// One warp per (row, block of `block` columns of h): h = silu(gate) * up in f32 (gu of type G: f32
// or bf16), then bf16, or e4m3 with the block's scale by the library's quantiser rule
// (core/fp8.h, gpu/fp8_code.cuh).
template <bool kQuant, class G>
__global__ void __launch_bounds__(kSwigluThreads) swiglu_kernel(SwigluParams p, int64_t total) {
  wait_previous_allow_next();
  const int lane = threadIdx.x & 31;
  const int64_t w = static_cast<int64_t>(blockIdx.x) * (kSwigluThreads / 32) + (threadIdx.x >> 5);
  if (w >= total) return;
  const int64_t nb = fp8_num_blocks(p.f, p.block);
  const int64_t row = w / nb, b = w % nb;
  const int64_t len = fp8_block_len(p.f, p.block, b);
  const G* gate = static_cast<const G*>(p.gu) + row * 2 * p.f + b * p.block;
  const G* up = gate + p.f;
  const int64_t out0 = row * p.f + b * p.block;
  if constexpr (!kQuant) {
    __nv_bfloat16* h = static_cast<__nv_bfloat16*>(p.h) + out0;
    for (int64_t i = lane; i < len; i += 32) {
      const float g = to_f32(gate[i]);
      h[i] = __float2bfloat16_rn(silu(g) * to_f32(up[i]));
    }
  } else {
    constexpr int kMaxPerLane = 8;  // block <= 256 (checked by the caller)
    float v[kMaxPerLane];
    float amax = 0.0f;
#pragma unroll
    for (int j = 0; j < kMaxPerLane; ++j) {
      const int64_t i = lane + 32 * j;
      v[j] = 0.0f;
      if (i < len) {
        const float g = to_f32(gate[i]);
        v[j] = silu(g) * to_f32(up[i]);
        amax = fmaxf(amax, fp8_amax_term(v[j]));  // the library's rule: NaN, Inf count as 0
      }
    }
    amax = gpu::warp_max(amax);
    const float s = fp8_block_scale(amax, false);
    const float inv = __frcp_rn(s);
    if (lane == 0) p.h_scale[row * nb + b] = s;
    __nv_fp8_storage_t* h = static_cast<__nv_fp8_storage_t*>(p.h) + out0;
#pragma unroll
    for (int j = 0; j < kMaxPerLane; ++j) {
      const int64_t i = lane + 32 * j;
      if (i < len) h[i] = a2a::gpu::fp8_quantize_value(v[j], inv);  // NaN, Inf -> 0x7F
    }
  }
}

// The common case, vectorised (block == 128, f % 128 == 0, 16-byte aligned gu and h: profiled at
// 28 % of DRAM bandwidth in the scalar kernel above at prefill, 448 us for 604 MB): one warp per
// kVecItems consecutive (row, block) items, every load issued before any math, lane i holding
// columns 4i..4i+3 of each block (two 16-byte f32 or 8-byte bf16 loads, one 4-byte fp8 or 8-byte
// bf16 store). The same arithmetic per value as swiglu_kernel, so both give identical bits.
constexpr int kVecItems = 4;

// Four consecutive values of gu from `at` (16-byte aligned for f32, 8-byte for bf16), read once
// (streaming loads).
__device__ inline float4 load4(const float* at) { return __ldcs(reinterpret_cast<const float4*>(at)); }
__device__ inline float4 load4(const __nv_bfloat16* at) {
  const uint2 bits = __ldcs(reinterpret_cast<const uint2*>(at));
  const float2 lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&bits.x));
  const float2 hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&bits.y));
  return make_float4(lo.x, lo.y, hi.x, hi.y);
}

template <bool kQuant, class G>
__global__ void __launch_bounds__(kSwigluThreads) swiglu_vec_kernel(SwigluParams p, int64_t total) {
  wait_previous_allow_next();
  const int lane = threadIdx.x & 31;
  const int64_t w0 =
      (static_cast<int64_t>(blockIdx.x) * (kSwigluThreads / 32) + (threadIdx.x >> 5)) * kVecItems;
  if (w0 >= total) return;
  const int64_t nb = p.f / 128;
  float4 g[kVecItems], u[kVecItems];
#pragma unroll
  for (int j = 0; j < kVecItems; ++j) {
    const int64_t w = w0 + j < total ? w0 + j : total - 1;  // warp-uniform; the tail's repeats are not stored
    const G* gate = static_cast<const G*>(p.gu) + (w / nb) * 2 * p.f + (w % nb) * 128 + lane * 4;
    g[j] = load4(gate);
    u[j] = load4(gate + p.f);
  }
#pragma unroll
  for (int j = 0; j < kVecItems; ++j) {
    const int64_t w = w0 + j;
    if (w >= total) break;  // warp-uniform
    const int64_t row = w / nb, b = w % nb;
    const float gv[4] = {g[j].x, g[j].y, g[j].z, g[j].w}, uv[4] = {u[j].x, u[j].y, u[j].z, u[j].w};
    float v[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) v[i] = silu(gv[i]) * uv[i];
    const int64_t out = row * p.f + b * 128 + lane * 4;
    if constexpr (!kQuant) {
      __nv_bfloat162 lo = __floats2bfloat162_rn(v[0], v[1]), hi = __floats2bfloat162_rn(v[2], v[3]);
      uint2 bits;
      bits.x = *reinterpret_cast<uint32_t*>(&lo);
      bits.y = *reinterpret_cast<uint32_t*>(&hi);
      *reinterpret_cast<uint2*>(static_cast<__nv_bfloat16*>(p.h) + out) = bits;
    } else {
      float amax = 0.0f;
#pragma unroll
      for (int i = 0; i < 4; ++i) amax = fmaxf(amax, fp8_amax_term(v[i]));  // NaN, Inf count as 0
      amax = gpu::warp_max(amax);
      const float s = fp8_block_scale(amax, false);
      const float inv = __frcp_rn(s);
      if (lane == 0) p.h_scale[row * nb + b] = s;
      uint32_t q = 0;
#pragma unroll
      for (int i = 0; i < 4; ++i) q |= static_cast<uint32_t>(a2a::gpu::fp8_quantize_value(v[i], inv)) << (8 * i);
      *reinterpret_cast<uint32_t*>(static_cast<uint8_t*>(p.h) + out) = q;
    }
  }
}

bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15u) == 0; }

// The SwiGLU kernel for gu of type G: the vectorised one where it applies, else the scalar one;
// its fp8-h instance when h_scale is set.
template <class G>
cudaError_t launch_swiglu_of(const SwigluParams& p, int64_t total, cudaStream_t stream) {
  const bool vec = p.block == 128 && p.f % 128 == 0 && aligned16(p.gu) && aligned16(p.h);
  const bool quant = p.h_scale != nullptr;
  void (*kernel)(SwigluParams, int64_t) = vec ? (quant ? swiglu_vec_kernel<true, G> : swiglu_vec_kernel<false, G>)
                                              : (quant ? swiglu_kernel<true, G> : swiglu_kernel<false, G>);
  const int64_t items_per_block = (kSwigluThreads / 32) * (vec ? kVecItems : 1);
  cudaLaunchAttribute pdl[1] = {gpu::pdl_attribute()};
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(static_cast<unsigned>((total + items_per_block - 1) / items_per_block));
  cfg.blockDim = dim3(kSwigluThreads);
  cfg.stream = stream;
  cfg.attrs = pdl;
  cfg.numAttrs = 1;
  return cudaLaunchKernelEx(&cfg, kernel, p, total);
}

}  // namespace

cudaError_t launch_swiglu(const SwigluParams& p, cudaStream_t stream) {
  if (p.block <= 0 || p.block > 256) return cudaErrorInvalidValue;
  const int64_t total = p.rows * fp8_num_blocks(p.f, p.block);
  if (total == 0) return cudaSuccess;
  return p.gu_bf16 ? launch_swiglu_of<__nv_bfloat16>(p, total, stream) : launch_swiglu_of<float>(p, total, stream);
}

}  // namespace a2a::gemm
