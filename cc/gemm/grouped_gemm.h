// Grouped expert GEMMs over one rank's local experts (issue 31): parameter structs and launchers.
//
// Layer `gemm` (cc/LAYERS): knows layouts and dtypes, never peers or transports. The kernels are
// CUTLASS 3.x Hopper pointer-array grouped GEMMs (sm_90a); a small setup kernel reads the group
// sizes on the device and writes each group's problem shape and pointers, so nothing syncs with
// the host and every launch is safe inside XLA command buffers.
//
// Shapes (L local experts, rows sorted by expert):
//   ragged:        x [R, K], group_sizes [L] int32 (rows past sum(group_sizes) give zero rows)
//   expert_major:  x [L, C, K], counts [L] int32 (rows c >= counts[l] give zero rows, cost nothing)
//   w [L, N, K] (K contiguous), or [L, K, N] in Mode::kTransposeW (N contiguous; bf16 only)
//   fp8: x_scale f32 [rows, K/128], w_scale f32 [L, N/128, K/128]
//   y [rows, N] bf16 or f32 (rows = R or L*C)
// Mode::kWgrad (bf16 in, f32 out): x = X [R, K] or [L, C, K], w = dY [R, N] or [L, C, N] (the rows of
//   the same groups), y = dW [L, N, K] with dW[l] = dY_l^T X_l over group l's rows (K of the GEMM
//   = the group's rows, any count; a group with no rows gives dW[l] = 0); no scales.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

namespace a2a::gemm {

enum class Layout : int { kRagged = 0, kExpertMajor = 1 };
enum class InType : int { kBF16 = 0, kFp8 = 1 };
enum class OutType : int { kBF16 = 0, kF32 = 1 };

// What one call computes: the custom call's `mode` attribute (cc/ffi/gemm_handlers.cc) and
// _C.gemm.workspace_bytes' `mode` (jax_moe_a2a/gemm_ffi.py's _MODE_*). int32: it travels to the
// device inside GroupedGemmParams (the setup kernel's argument).
//   kForward     y = x @ w[l]^T, w [L, N, K]
//   kTransposeW  y = x @ w[l], w [L, K, N] (the bf16 backward's dgrad; bf16 only)
//   kWgrad       dW[l] = dY_l^T X_l (bf16 in, f32 out; above)
enum class Mode : int32_t { kForward = 0, kTransposeW = 1, kWgrad = 2 };

// The Mode of an attribute's value, or false when it names none.
inline bool mode_from_int(int64_t v, Mode& m) {
  if (v < 0 || v > 2) return false;
  m = static_cast<Mode>(v);
  return true;
}

struct GroupedGemmParams {
  Layout layout = Layout::kRagged;
  InType in = InType::kBF16;
  OutType out = OutType::kBF16;
  Mode mode = Mode::kForward;
  int64_t num_groups = 0;         // L
  int64_t rows = 0;               // R (ragged) or C (expert_major: rows per expert)
  int64_t n = 0;
  int64_t k = 0;
  const void* x = nullptr;        // [R, K] or [L, C, K]
  const float* x_scale = nullptr; // fp8: [R or L*C, K/128]
  const void* w = nullptr;        // [L, N, K] ([L, K, N] in kTransposeW; dY in kWgrad)
  const float* w_scale = nullptr; // fp8: [L, N/128, K/128]
  const int32_t* group_sizes = nullptr;  // [L] on the device
  void* y = nullptr;              // [R or L*C, N]
  void* workspace = nullptr;      // workspace_bytes(...) bytes on the device, 256-byte aligned
  size_t workspace_size = 0;
};

// Why these parameters cannot run natively (nullptr when they can): a static check of dtypes,
// alignment and block sizes.
const char* unsupported_reason(const GroupedGemmParams& p);

// Device workspace the launch needs for these parameters (L groups, this device's SM count).
size_t workspace_bytes(const GroupedGemmParams& p, int device_sm_count);

// Launches y = x @ w^T per group on `stream` (setup kernel, grouped GEMM, zero rows past the groups).
cudaError_t launch_grouped_gemm(const GroupedGemmParams& p, cudaStream_t stream);

// SwiGLU epilogue over the gate+up accumulators: gu f32 [rows, 2F] (gate columns 0..F-1, up
// F..2F-1) -> h = silu(gate) * up in f32, written as bf16 [rows, F] (h_scale == nullptr), or as
// e4m3fn [rows, F] with h_scale f32 [rows, F/block] by the library's block quantiser rule.
struct SwigluParams {
  const float* gu = nullptr;
  int64_t rows = 0;
  int64_t f = 0;
  int64_t block = 128;
  void* h = nullptr;
  float* h_scale = nullptr;
};
cudaError_t launch_swiglu(const SwigluParams& p, cudaStream_t stream);

// True when the grouped-GEMM kernels were compiled (CUTLASS headers found at build time).
bool kernels_built();

}  // namespace a2a::gemm
