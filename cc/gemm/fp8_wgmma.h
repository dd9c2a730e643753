// Launcher of our own fp8 block-scaled grouped GEMM (fp8_wgmma.cuh; sm_90a).
//
// Layer `gemm` (cc/LAYERS). Shapes as in fp8_wgmma.cuh: x [rows, K] e4m3, x_scale f32 [rows, K/128],
// w [L, N, K] e4m3, w_scale f32 [L, N/128, K/128], group_sizes int32 [L] (device), y [rows, N] bf16
// or f32. Rows of y outside every group get zeros (the kernel writes them).
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

namespace a2a::gemm::wgmma {

// The most groups (local experts) the kernel takes: its group table lives in shared memory.
inline constexpr int kMaxGroups = 1024;

// The token-tile heights the swap-AB kernel (fp8_wgmma_swap.cuh) is compiled for, ascending.
inline constexpr int kSwapTokens[] = {32, 64, 128, 160};

// Why the kernel cannot take these shapes (nullptr when it can): N and K positive multiples of its
// 128-wide tiles and scale blocks, 1 <= L <= kMaxGroups, and rows (R or L*C), L*N and K below 2^31
// (its TMA coordinates are int32). The shape part of fp8_unsupported_reason, which the library's
// kernel choice (gemm/kernels.h wgmma_takes) applies before any buffer exists.
inline const char* fp8_shape_reason(int64_t rows, int64_t num_groups, int64_t n, int64_t k) {
  constexpr int64_t kLimit = int64_t{1} << 31;
  if (n <= 0 || k <= 0 || n % 128 != 0 || k % 128 != 0) return "N and K must be positive multiples of 128";
  if (num_groups < 1 || num_groups > kMaxGroups) return "the number of groups must be 1..1024 (the kernel's group table)";
  if (rows >= kLimit || num_groups * n >= kLimit) return "rows or L*N reach 2^31";
  if (k >= kLimit) return "K reaches 2^31";
  return nullptr;
}

struct Fp8LaunchParams {
  const void* x = nullptr;
  const float* x_scale = nullptr;
  const void* w = nullptr;
  const float* w_scale = nullptr;
  const int32_t* group_sizes = nullptr;
  void* y = nullptr;
  bool y_f32 = false;
  bool expert_major = false;
  int64_t rows = 0;       // R (ragged) or L*C (expert_major)
  int64_t per_group_rows = 0;  // expert_major: C
  int64_t num_groups = 0;
  int64_t n = 0, k = 0;
  int sm_count = 0;       // 0: the current device's
  // Programmatic dependent launch: the kernel's prologue may overlap the stream's previous kernel
  // (it waits for that kernel before touching global memory). Off: plain stream order (measurements).
  bool pdl = true;
  bool serial_promotion = false;  // measurements: each k-block waited for before its promotion
  // The swap-AB kernel (fp8_wgmma_swap.cuh: tokens as the WGMMA's N, for decode) with token tiles
  // of this many rows (one of kSwapTokens: 32, 64, 128, 160; its promotion is always serial);
  // 0: the row-major kernel. With swiglu_fp8: single CTAs. swap_cluster 2: CTA pairs share the x
  // tile (TMA multicast; N / 128 even).
  int swap_tokens = 0;
  int swap_cluster = 1;
  // The swap-AB kernel spreads its tiles evenly (Fp8Args::balance): with T tiles and G clusters,
  // ceil(T / ceil(T / G)) clusters take ceil(T / G) tiles each, so none starts a last round alone.
  // Off (measurements): tile t goes to cluster t % G.
  bool balance_tiles = true;
  // The swap-AB kernel runs each tile's WGMMAs over its tokens rounded up to 8, not the whole token
  // tile (Fp8Args::trim). Off (measurements): N = the token tile always.
  bool trim_tokens = true;
  // The swap-AB kernel warms L2 with this many k-blocks of each CTA's first weight tile while the
  // stream's previous kernel finishes (Fp8Args::prefetch_kblocks; with pdl only). 0: none.
  int prefetch_kblocks = 8;
  // Measurements only: one of the swap-AB kernel's ablations (fp8_wgmma_swap.cuh, Ablate; single
  // CTAs; wrong outputs by design). Refused unless compiled with A2A_GEMM_ABLATIONS (the probe).
  int ablate = 0;
#ifdef A2A_GEMM_ABLATIONS
  unsigned long long* trace = nullptr;  // Fp8Args::trace (fp8_wgmma.cuh): per-tile timestamps
  int trace_per_cta = 0;
#endif
  // The gate+up GEMM with the SwiGLU epilogue (fp8_wgmma.cuh, Epi::kSwigluFp8): w [L, 2F, K] (n =
  // 2F, F % 128 == 0), writes h e4m3 [rows, F] and h_scale f32 [rows, F/128] instead of y. Rows
  // outside every group get h = 0 and the all-zero block's scale.
  bool swiglu_fp8 = false;
  uint8_t* h = nullptr;
  float* h_scale = nullptr;
};

// Why these parameters cannot run on this kernel (nullptr when they can): fp8_shape_reason, the
// SwiGLU epilogue's N (a multiple of 256) and outputs, and a driver with cuTensorMapEncodeTiled.
const char* fp8_unsupported_reason(const Fp8LaunchParams& p);

// Enqueues the kernel on `stream` (nothing when rows == 0). p must have passed fp8_unsupported_reason.
cudaError_t launch_fp8_grouped(const Fp8LaunchParams& p, cudaStream_t stream);

}  // namespace a2a::gemm::wgmma
