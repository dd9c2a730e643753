// Launcher of our own fp8 block-scaled grouped GEMM (fp8_wgmma.cuh; sm_90a).
//
// Layer `gemm` (cc/LAYERS). Shapes as in fp8_wgmma.cuh: x [rows, K] e4m3, x_scale f32 [rows, K/128],
// w [L, N, K] e4m3, w_scale f32 [L, N/128, K/128], group_sizes int32 [L] (device), y [rows, N] bf16
// or f32. Rows of y outside every group are left as they are (the caller zeroes them).
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

namespace a2a::gemm::wgmma {

// The most groups (local experts) the kernel takes: its group table lives in shared memory.
inline constexpr int kMaxGroups = 1024;

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
  bool serial_promotion = false;  // measurements: each k-block waited for before its promotion
  // The gate+up GEMM with the SwiGLU epilogue (fp8_wgmma.cuh, Epi::kSwigluFp8): w [L, 2F, K] (n =
  // 2F, F % 128 == 0), writes h e4m3 [rows, F] and h_scale f32 [rows, F/128] instead of y. Rows
  // outside every group are left as they are.
  bool swiglu_fp8 = false;
  uint8_t* h = nullptr;
  float* h_scale = nullptr;
};

// Why these parameters cannot run on this kernel (nullptr when they can): N and K multiples of 128
// (swiglu_fp8: N of 256),
// 1 <= L <= its group table, sizes within int32 where the TMA coordinates need them.
const char* fp8_unsupported_reason(const Fp8LaunchParams& p);

// Enqueues the kernel on `stream` (nothing when rows == 0). p must have passed fp8_unsupported_reason.
cudaError_t launch_fp8_grouped(const Fp8LaunchParams& p, cudaStream_t stream);

}  // namespace a2a::gemm::wgmma
