// The kernel translation units of cc/gemm: one entry point per family (internal to the layer), and
// the ONE place that chooses a grouped GEMM's kernel configuration from static shapes (choose()).
#pragma once

#include <cstddef>
#include <cstdint>
#include <iterator>

#include <cuda_runtime_api.h>

#include "gemm/fp8_wgmma.h"
#include "gemm/grouped_gemm.h"

namespace a2a::gemm::detail {

// Which kernel configuration a call runs, and the persistent tile scheduler's order.
//   fp8 forward:  kTile128   128x128x128 cooperative (many rows per expert: prefill)
//                 kTile64    64x128x128 ping-pong (few rows: each weight byte costs half the
//                            tensor-core work of a 128-row tile)
//   bf16 forward: kTile128 (128x256x64 cooperative) / kTile64 (64x128x64 ping-pong)
//   bf16 wgrad:   128x128x64 cooperative (dW tiles; K = the group's rows)
// raster / swizzle (gemm::Raster, grouped_gemm.h): CUTLASS's group scheduler. Its default, AlongM,
// already runs the row tiles of one weight tile one after another (on neighbouring SMs at once);
// swizzle 1 = none.
// Measured and removed (notes/benchmarks.md, 2026-12-04): CUTLASS's swap-AB fp8 tiles (128 weight
// rows x 32, 64, 128 or 160 tokens, cooperative) and 2x1x1 clusters for its 128-row fp8 tiles; all
// slower (its 160-token tile: +2 % on gate+up, -14 % on down at L = 8). Our own swap-AB kernel
// (fp8_wgmma_swap.cuh, below), with the token tile matched to the shape, did win (2026-12-05).
enum class Tile : int { kTile64 = 0, kTile128 = 1 };
struct Tuning {
  Tile tile = Tile::kTile128;
  Raster raster = Raster::kAlongM;
  int swizzle = 1;
  bool wgmma = false;  // our own fp8 kernel (fp8_wgmma.cuh) instead of CUTLASS's; fp8 forward only
  // With wgmma: its swap-AB form (fp8_wgmma_swap.cuh) with token tiles of this many rows (0: the
  // row-major kernel), single CTAs (its CTA pairs run only in benchmarks/gemm_probe.cu).
  int swap_tokens = 0;
};

// The swap-AB form for our fp8 kernel at this call's mean rows per group (static shapes): decode
// (mean <= 128) takes the smallest token tile of wgmma::kSwapTokens holding 1.25x the mean (a
// group's rows spread around it: at L = 8 of 1,024 rows, 129-150 in half of them), so nearly every
// group is one tile and each weight tile is read once; prefill keeps the row-major kernel. Single
// CTAs. Measured on the H200 (benchmarks/gemm_probe.cu, notes/benchmarks.md 2026-12-05,
// twentieth session): L = 8 -> 160, L = 32 -> 64, L = 256 -> 32 were the fastest tiles.
inline void swap_of(int64_t rows_total, int64_t num_groups, Tuning& t, bool at_prefill_too = false) {
  t.swap_tokens = 0;
  if (num_groups <= 0) return;
  if (rows_total > 128 * num_groups) {  // prefill: the row-major kernel, or (kSwap) the largest token tile
    if (at_prefill_too) t.swap_tokens = std::end(wgmma::kSwapTokens)[-1];
    return;
  }
  const double want = 1.25 * static_cast<double>(rows_total) / static_cast<double>(num_groups);
  for (int tok : wgmma::kSwapTokens) {
    t.swap_tokens = tok;
    if (tok >= want) break;
  }
  // CTA pairs sharing the x tile (Fp8LaunchParams::swap_cluster 2) measured no faster (H100, same
  // run: L = 8 gate+up 116.8 against 114.2 us, down 81.6 against 78.6): L2 stayed at ~80 %.
}

// The swap-AB kernel's token tiles at which a call that does not say (JAX_MOE_A2A_GEMM_TILE_M
// without `fused` / `unfused`) runs the fp8 gate+up GEMM with its SwiGLU epilogue instead of the
// GEMM and the SwiGLU kernel. Measured (H100, 2026-12-06, benchmarks/gemm.py --variants
// "unfused;auto" and "fused;unfused", the fp8 MLP at decode, 1,024 rows, DeepSeek-V3 shapes): at 64
// tokens (L = 32) 496.7 us fused against 510.9 for the pair, at 32 (L = 256) 3,648.6 against
// 3,682.0; at 160 (L = 8) the fused one lost, 169.3 against 165.5 (its single tile per CTA leaves
// the epilogue exposed; gemm_probe fused: gate+up 101.4 us with the epilogue, 92.8 without).
inline constexpr int kFusedSwigluMaxTokens = 64;

inline bool fuses_swiglu_by_default(const Tuning& t) {
  return t.wgmma && t.swap_tokens > 0 && t.swap_tokens <= kFusedSwigluMaxTokens;
}

// Forward output rows: R (ragged) or L*C (expert_major).
__host__ __device__ inline int64_t output_rows(const GroupedGemmParams& p) {
  return p.layout == Layout::kRagged ? p.rows : p.rows * p.num_groups;
}

// True when our own fp8 kernel takes this call: fp8 forward within wgmma::fp8_shape_reason's
// limits. Shapes only, so the workspace size and the launch choose alike; a call this lets through
// fails the launch's check only on a driver without cuTensorMapEncodeTiled.
inline bool wgmma_takes(const GroupedGemmParams& p) {
  return p.in == InType::kFp8 && p.mode == Mode::kForward &&
         wgmma::fp8_shape_reason(output_rows(p), p.num_groups, p.n, p.k) == nullptr;
}

// The choice, from static shapes only (the workspace size and the launch agree), made once per
// call by workspace_bytes and launch_grouped_gemm and handed down:
//   rows per group (mean) <= 128: decode, bound by the weights' bytes: 64-row tiles
//   (fp8 and bf16); else the 128-row tiles.
// p.tuning (the call's request: JAX_MOE_A2A_GEMM_TILE_M, parsed by jax_moe_a2a/gemm_ffi.py when the
// call is traced; for measurements) forces the tile, the raster order and the maximum swizzle.
// The tile applies to the forward kernels; the transpose_w and wgrad kernels have one tile each
// (gemm_bf16.cu) and take the raster order and swizzle only.
inline Tuning choose(const GroupedGemmParams& p) {
  Tuning t;
  if (p.tuning.tile_m == TileM::kAuto) {
    const int64_t rows_total = p.layout == Layout::kRagged ? p.rows : p.rows * p.num_groups;
    const bool few = p.num_groups > 0 && rows_total <= 128 * p.num_groups;
    t.tile = few ? Tile::kTile64 : Tile::kTile128;
  } else {
    t.tile = p.tuning.tile_m == TileM::k64 ? Tile::kTile64 : Tile::kTile128;
  }
  t.raster = p.tuning.raster;
  t.swizzle = p.tuning.swizzle;
  // kAuto: decode shapes (mean rows per group <= 128) run our swap-AB kernel, prefill CUTLASS's:
  // measured in one run (benchmarks/gemm.py --variants "cutlass;wgmma", H100, 2026-12-05,
  // twentieth session) the fp8 MLP at L = 8 / 32 / 256 took 0.92 / 0.97 / 0.96x CUTLASS's time,
  // and at prefill our row-major kernel is slower (nineteenth session). An explicit tile (64 /
  // 128) asks for CUTLASS's tiles; a kWgmma request our kernel cannot take runs CUTLASS.
  const int64_t rows_total = output_rows(p);
  const bool decode = p.num_groups > 0 && rows_total <= 128 * p.num_groups;
  const bool auto_wgmma = p.tuning.kernel == KernelChoice::kAuto && p.tuning.tile_m == TileM::kAuto && decode;
  const bool swap = p.tuning.kernel == KernelChoice::kSwap;
  t.wgmma = (p.tuning.kernel == KernelChoice::kWgmma || swap || auto_wgmma) && wgmma_takes(p);
  if (t.wgmma) swap_of(rows_total, p.num_groups, t, swap);
  return t;
}

// One family's workspace size and launch, in the configuration `t` (choose(p), made by the caller).
size_t fp8_workspace_bytes(const GroupedGemmParams& p, const Tuning& t, int sm_count);
LaunchStatus run_fp8(const GroupedGemmParams& p, const Tuning& t, int sm_count, cudaStream_t stream);
size_t bf16_workspace_bytes(const GroupedGemmParams& p, const Tuning& t, int sm_count);
LaunchStatus run_bf16(const GroupedGemmParams& p, const Tuning& t, int sm_count, cudaStream_t stream);
// Our own fp8 kernel (gemm_fp8_wgmma.cu): no workspace; the kernel also zeroes the uncovered rows.
LaunchStatus run_fp8_wgmma(const GroupedGemmParams& p, const Tuning& t, int sm_count, cudaStream_t stream);
// The same kernel with the SwiGLU epilogue (launch_grouped_gemm_swiglu, grouped_gemm.h): at decode
// (t.swap_tokens) the swap-AB kernel's.
cudaError_t run_fp8_wgmma_swiglu(const GroupedGemmParams& p, const Tuning& t, void* h, float* h_scale, int sm_count,
                                 cudaStream_t stream);

}  // namespace a2a::gemm::detail
