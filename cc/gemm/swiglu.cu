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

// The common case, vectorised (block == 128, f % 128 == 0, 16-byte aligned gu and h): every lane
// reads 16 bytes of gate and 16 of up per item (4 f32 or 8 bf16 columns), so a 128-column block
// takes 32 lanes of f32 or 16 of bf16 (two blocks per warp instruction); each warp takes kVecSteps
// such steps, every load issued before any math. At prefill (bf16 gu [32,768, 4,096] -> e4m3 h) it
// runs at a device copy of its bytes (benchmarks/gemm.py's floor line: 122.7 us, 1.05x, on an
// H100); its form with 8-byte bf16 loads and 4 blocks a warp took 166 us on another H100. The same
// arithmetic per value as swiglu_kernel (the block's maximum does not depend on the order), so both
// give identical bits.
constexpr int kVecSteps = 4;

template <class G>
struct VecShape {
  static constexpr int kCols = 16 / static_cast<int>(sizeof(G));  // columns of one lane's 16-byte load
  static constexpr int kLanesPerBlock = 128 / kCols;              // lanes of one 128-column block
  static constexpr int kBlocksPerStep = 32 / kLanesPerBlock;      // blocks one warp instruction covers
  static constexpr int kItems = kBlocksPerStep * kVecSteps;       // (row, block) items of one warp
};

// 16 bytes of gu from `at` (16-byte aligned), read once (streaming load); kept raw until the math,
// so the loads in flight cost 4 registers each.
__device__ inline uint4 load16(const void* at) { return __ldcs(reinterpret_cast<const uint4*>(at)); }

// The kCols values of a load16 as f32.
__device__ inline void as_f32(const uint4& q, float (&v)[4]) {
  v[0] = __uint_as_float(q.x), v[1] = __uint_as_float(q.y), v[2] = __uint_as_float(q.z), v[3] = __uint_as_float(q.w);
}
__device__ inline void as_f32(const uint4& q, float (&v)[8]) {
  const uint32_t words[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&words[i]));
    v[2 * i] = f.x, v[2 * i + 1] = f.y;
  }
}

// kCols values of h (4 or 8) as bf16 at `at` (8 or 16 bytes, aligned).
template <int kCols>
__device__ inline void store_bf16(__nv_bfloat16* at, const float (&v)[kCols]) {
  uint32_t words[kCols / 2];
#pragma unroll
  for (int i = 0; i < kCols / 2; ++i) {
    __nv_bfloat162 pair = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
    words[i] = *reinterpret_cast<uint32_t*>(&pair);
  }
  if constexpr (kCols == 4) *reinterpret_cast<uint2*>(at) = make_uint2(words[0], words[1]);
  else *reinterpret_cast<uint4*>(at) = make_uint4(words[0], words[1], words[2], words[3]);
}

// kCols values of h (4 or 8) as e4m3 codes at `at` (4 or 8 bytes, aligned), scaled by inv.
template <int kCols>
__device__ inline void store_fp8(uint8_t* at, const float (&v)[kCols], float inv) {
  uint32_t words[kCols / 4] = {};
#pragma unroll
  for (int i = 0; i < kCols; ++i)
    words[i / 4] |= static_cast<uint32_t>(a2a::gpu::fp8_quantize_value(v[i], inv)) << (8 * (i % 4));  // NaN, Inf -> 0x7F
  if constexpr (kCols == 4) *reinterpret_cast<uint32_t*>(at) = words[0];
  else *reinterpret_cast<uint2*>(at) = make_uint2(words[0], words[1]);
}

template <bool kQuant, class G>
__global__ void __launch_bounds__(kSwigluThreads) swiglu_vec_kernel(SwigluParams p, int64_t total) {
  using S = VecShape<G>;
  wait_previous_allow_next();
  const int lane = threadIdx.x & 31;
  const int sub = lane / S::kLanesPerBlock;                 // which block of a step this lane reads
  const int col = (lane % S::kLanesPerBlock) * S::kCols;   // its first column within the block
  const int64_t w0 =
      (static_cast<int64_t>(blockIdx.x) * (kSwigluThreads / 32) + (threadIdx.x >> 5)) * S::kItems;
  if (w0 >= total) return;  // warp-uniform
  const int64_t nb = p.f / 128;
  uint4 g[kVecSteps], u[kVecSteps];
#pragma unroll
  for (int j = 0; j < kVecSteps; ++j) {
    int64_t w = w0 + j * S::kBlocksPerStep + sub;
    w = w < total ? w : total - 1;  // the tail's repeats are read, not stored
    const G* gate = static_cast<const G*>(p.gu) + (w / nb) * 2 * p.f + (w % nb) * 128 + col;
    g[j] = load16(gate);
    u[j] = load16(gate + p.f);
  }
#pragma unroll
  for (int j = 0; j < kVecSteps; ++j) {
    const int64_t w = w0 + j * S::kBlocksPerStep + sub;
    if (w0 + j * S::kBlocksPerStep >= total) break;  // warp-uniform: no block of this step is real
    const bool real = w < total;                     // this lane's block (not the last step's repeat)
    const int64_t row = w / nb, b = w % nb;
    float gv[S::kCols], v[S::kCols];
    as_f32(g[j], gv);
    as_f32(u[j], v);
#pragma unroll
    for (int i = 0; i < S::kCols; ++i) v[i] = silu(gv[i]) * v[i];
    const int64_t out = row * p.f + b * 128 + col;
    if constexpr (!kQuant) {
      if (real) store_bf16<S::kCols>(static_cast<__nv_bfloat16*>(p.h) + out, v);
    } else {
      float amax = 0.0f;
#pragma unroll
      for (int i = 0; i < S::kCols; ++i) amax = fmaxf(amax, fp8_amax_term(v[i]));  // NaN, Inf count as 0
      amax = gpu::group_max<S::kLanesPerBlock>(amax);  // every lane takes part in the shuffles
      const float s = fp8_block_scale(amax, false);
      if (!real) continue;
      if (col == 0) p.h_scale[row * nb + b] = s;
      store_fp8<S::kCols>(static_cast<uint8_t*>(p.h) + out, v, __frcp_rn(s));
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
  const int64_t items_per_block = (kSwigluThreads / 32) * (vec ? VecShape<G>::kItems : 1);
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
