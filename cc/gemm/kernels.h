// The kernel translation units of cc/gemm: one entry point per family (internal to the layer), and
// the ONE place that chooses a grouped GEMM's kernel configuration from static shapes (choose()).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include <cuda_runtime_api.h>

#include "gemm/grouped_gemm.h"
#include "core/env.h"

namespace a2a::gemm::detail {

enum class Raster : int { kAlongM = 0, kAlongN = 1, kHeuristic = 2 };

// Which kernel configuration a call runs, and the persistent tile scheduler's order.
//   fp8 forward:  kTile128   128x128x128 cooperative (many rows per expert: prefill)
//                 kTile64    64x128x128 ping-pong (few rows: each weight byte costs half the
//                            tensor-core work of a 128-row tile)
//                 kSwap64 / kSwap32: swap-AB, 128 weight rows x 64 / 32 tokens x 128 cooperative
//                            (the weights on CUTLASS's M: a group of a few rows pads to 32)
//                 cluster 2: 128x128 tiles in 2x1x1 clusters (the weight tile multicast to the
//                            two CTAs of a cluster, which take neighbouring row tiles)
//   bf16 forward: kTile128 (128x256x64 cooperative) / kTile64 (64x128x64 ping-pong)
//   bf16 wgrad:   128x128x64 cooperative (dW tiles; K = the group's rows)
// raster / swizzle: CUTLASS's group scheduler (AlongM: the row tiles of one weight tile run
// together; swizzle 1 = none).
enum class Tile : int { kTile64 = 0, kTile128 = 1, kSwap64 = 2, kSwap32 = 3 };
struct Tuning {
  Tile tile = Tile::kTile128;
  int cluster_m = 1;
  Raster raster = Raster::kAlongM;
  int swizzle = 1;
};

// The choice, from static shapes only (the workspace size and the launch agree):
//   rows per group (mean) <= 128: decode, bound by the weights' bytes: 64-row tiles
//   (fp8 and bf16); else the 128-row tiles.
// JAX_MOE_A2A_GEMM_TILE_M (read at every call; for measurements) overrides it: a comma list of
// `64` | `128` | `swap64` | `swap32` (the tile; swap* fp8 only, else 64), `c2` (fp8 128-row tiles
// in 2x1x1 clusters), `rasterM` | `rasterN` | `rasterH`, `s1` | `s2` | `s4` | `s8` (max swizzle).
inline Tuning choose(const GroupedGemmParams& p) {
  Tuning t;
  const int64_t rows_total = p.layout == Layout::kRagged ? p.rows : p.rows * p.num_groups;
  const bool few = p.num_groups > 0 && rows_total <= 128 * p.num_groups;
  t.tile = few ? Tile::kTile64 : Tile::kTile128;
  if (const char* force = env::get("JAX_MOE_A2A_GEMM_TILE_M")) {
    const char* s = force;
    while (*s) {
      const char* e = std::strchr(s, ',');
      const size_t n = e ? static_cast<size_t>(e - s) : std::strlen(s);
      auto is = [&](const char* w) { return std::strlen(w) == n && std::strncmp(s, w, n) == 0; };
      if (is("64")) t.tile = Tile::kTile64;
      else if (is("128")) t.tile = Tile::kTile128;
      else if (is("swap64")) t.tile = Tile::kSwap64;
      else if (is("swap32")) t.tile = Tile::kSwap32;
      else if (is("c2")) t.cluster_m = 2;
      else if (is("rasterM")) t.raster = Raster::kAlongM;
      else if (is("rasterN")) t.raster = Raster::kAlongN;
      else if (is("rasterH")) t.raster = Raster::kHeuristic;
      else if (is("s1")) t.swizzle = 1;
      else if (is("s2")) t.swizzle = 2;
      else if (is("s4")) t.swizzle = 4;
      else if (is("s8")) t.swizzle = 8;
      s += n;
      if (*s == ',') ++s;
    }
  }
  if (p.in != InType::kFp8 && (t.tile == Tile::kSwap64 || t.tile == Tile::kSwap32)) t.tile = Tile::kTile64;
  if (p.in != InType::kFp8 || t.tile != Tile::kTile128) t.cluster_m = 1;
  return t;
}

size_t fp8_workspace_bytes(const GroupedGemmParams& p, int sm_count);
cudaError_t run_fp8(const GroupedGemmParams& p, int sm_count, cudaStream_t stream);
// The swap-AB fp8 family (kSwap64 / kSwap32), in its own translation unit (grouped_gemm.cu) so the
// build compiles it beside gemm_fp8.cu.
size_t fp8_swap_workspace_bytes(const GroupedGemmParams& p, int sm_count, const Tuning& t);
cudaError_t run_fp8_swap(const GroupedGemmParams& p, int sm_count, const Tuning& t, cudaStream_t stream);
size_t bf16_workspace_bytes(const GroupedGemmParams& p, int sm_count);
cudaError_t run_bf16(const GroupedGemmParams& p, int sm_count, cudaStream_t stream);

}  // namespace a2a::gemm::detail
