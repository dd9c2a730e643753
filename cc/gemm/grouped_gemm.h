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

// The kernel configuration a call asks for, for measurements: the custom call's attributes
// tile_m, raster, swizzle and kernel, which jax_moe_a2a/gemm_ffi.py sets from JAX_MOE_A2A_GEMM_TILE_M
// once when it traces the call (the one parser of its words; the same values size the workspace
// through _C.gemm.workspace_bytes, so the size and the launch agree). The defaults are what
// unset means; kernels.h's choose() turns kAuto into a tile from the static shapes.
enum class TileM : int32_t { kAuto = 0, k64 = 64, k128 = 128 };
enum class Raster : int32_t { kAlongM = 0, kAlongN = 1, kHeuristic = 2 };  // CUTLASS's group scheduler order
// Which implementation runs an fp8 forward call: kAuto (the measured default: our own swap-AB
// kernel at decode shapes, CUTLASS's blockwise kernels at prefill; kernels.h choose()), kCutlass,
// or kWgmma (our own kernel everywhere: fp8_wgmma_swap.cuh at decode, fp8_wgmma.cuh's row-major
// one with two temporary accumulators otherwise; L <= 1024 groups, else CUTLASS), or kSwap (our
// swap-AB kernel at every shape: at prefill its largest token tile, kernels.h swap_of; for
// measurements). The other modes and bf16 always run CUTLASS.
enum class KernelChoice : int32_t { kAuto = 0, kCutlass = 1, kWgmma = 2, kSwap = 3 };
struct TuningRequest {
  TileM tile_m = TileM::kAuto;
  Raster raster = Raster::kAlongM;
  int32_t swizzle = 1;  // the scheduler's maximum swizzle: 1 (none), 2, 4 or 8
  KernelChoice kernel = KernelChoice::kAuto;
};

// The request of the attributes' values, or false when one is out of its set (what the message of
// kTuningValues says).
inline bool tuning_from_ints(int64_t tile_m, int64_t raster, int64_t swizzle, int64_t kernel, TuningRequest& t) {
  if (tile_m != 0 && tile_m != 64 && tile_m != 128) return false;
  if (raster < 0 || raster > 2) return false;
  if (swizzle != 1 && swizzle != 2 && swizzle != 4 && swizzle != 8) return false;
  if (kernel < 0 || kernel > 3) return false;
  t.tile_m = static_cast<TileM>(tile_m);
  t.raster = static_cast<Raster>(raster);
  t.swizzle = static_cast<int32_t>(swizzle);
  t.kernel = static_cast<KernelChoice>(kernel);
  return true;
}
inline constexpr const char kTuningValues[] =
    "tile_m must be 0 (auto), 64 or 128; raster 0 (along M), 1 (along N) or 2 (heuristic); swizzle 1, 2, 4 or 8; "
    "kernel 0 (auto), 1 (cutlass), 2 (wgmma) or 3 (swap)";

struct GroupedGemmParams {
  Layout layout = Layout::kRagged;
  InType in = InType::kBF16;
  OutType out = OutType::kBF16;
  Mode mode = Mode::kForward;
  TuningRequest tuning;           // measurements only; the defaults otherwise
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

// Device workspace the launch needs for these parameters (L groups, this device's SM count; 0: the
// current device's). p must have passed unsupported_reason.
size_t workspace_bytes(const GroupedGemmParams& p, int device_sm_count);

// What launch_grouped_gemm did: error == cudaSuccess when it enqueued the work. workspace_needed is
// the workspace the launch's configuration needs (workspace_bytes(p)); when p.workspace_size is
// below it, nothing was launched and error is cudaErrorInvalidValue.
struct LaunchStatus {
  cudaError_t error = cudaSuccess;
  size_t workspace_needed = 0;
  bool workspace_short(const GroupedGemmParams& p) const { return p.workspace_size < workspace_needed; }
};

// Launches y = x @ w^T per group on `stream` (setup kernel, grouped GEMM, zero rows past the
// groups), choosing the configuration once. p must have passed unsupported_reason (the caller's
// check, not repeated here); the workspace is checked here, where its size is computed for the
// launch itself.
LaunchStatus launch_grouped_gemm(const GroupedGemmParams& p, cudaStream_t stream);

// SwiGLU epilogue over the gate+up GEMM's output: gu [rows, 2F] f32, or bf16 (gu_bf16; what the
// fp8 MLP writes: half the bytes, and h's e4m3 rounding dwarfs bf16's) (gate columns 0..F-1, up
// F..2F-1) -> h = silu(gate) * up in f32, written as bf16 [rows, F] (h_scale == nullptr), or as
// e4m3fn [rows, F] with h_scale f32 [rows, F/block] by the library's block quantiser rule.
struct SwigluParams {
  const void* gu = nullptr;
  bool gu_bf16 = false;
  int64_t rows = 0;
  int64_t f = 0;
  int64_t block = 128;
  void* h = nullptr;
  float* h_scale = nullptr;
};
cudaError_t launch_swiglu(const SwigluParams& p, cudaStream_t stream);

// The fp8 gate+up GEMM with the SwiGLU epilogue in one kernel (our own: wherever choose(p) takes
// our kernel, i.e. kernel == kWgmma, or kAuto at decode shapes; at decode the swap-AB kernel's
// epilogue, fp8_wgmma_swap.cuh, else the row-major kernel's): p as a kForward fp8 call with w [L, 2F, K] (gate rows 0..F-1, up
// F..2F-1), F % 128 == 0; writes h e4m3 [rows, F] and h_scale f32 [rows, F/128] (rows = R or L*C)
// by the library's quantiser, gate and up rounded to bf16 first: the values of launch_grouped_gemm
// with bf16 out followed by launch_swiglu (block 128). Rows outside the groups: h = 0 and the
// scale of an all-zero block. swiglu_gemm_unsupported_reason: why p cannot (nullptr: it can).
const char* swiglu_gemm_unsupported_reason(const GroupedGemmParams& p);
// True when a call that does not say whether to fuse (the Python wrapper decides) runs the fused
// kernel: it can (swiglu_gemm_unsupported_reason) and choose(p) takes the swap-AB kernel at a token
// tile where the fused epilogue measured faster than the pair (detail::fuses_swiglu_by_default).
bool swiglu_gemm_fused_by_default(const GroupedGemmParams& p);
cudaError_t launch_grouped_gemm_swiglu(const GroupedGemmParams& p, void* h, float* h_scale, cudaStream_t stream);

// True when the grouped-GEMM kernels were compiled (CUTLASS headers found at build time).
bool kernels_built();

}  // namespace a2a::gemm
