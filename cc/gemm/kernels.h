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
//   bf16 forward: kTile128 (128x256x64 cooperative) / kTile64 (64x128x64 ping-pong)
//   bf16 wgrad:   128x128x64 cooperative (dW tiles; K = the group's rows)
// raster / swizzle: CUTLASS's group scheduler. Its default, AlongM, already runs the row tiles of
// one weight tile one after another (on neighbouring SMs at once); swizzle 1 = none.
// Measured and removed (notes/benchmarks.md, 2026-12-04): swap-AB fp8 tiles (128 weight rows x 32
// or 64 tokens) and 2x1x1 clusters for the 128-row fp8 tiles; both slower.
enum class Tile : int { kTile64 = 0, kTile128 = 1 };
struct Tuning {
  Tile tile = Tile::kTile128;
  Raster raster = Raster::kAlongM;
  int swizzle = 1;
};

// The choice, from static shapes only (the workspace size and the launch agree):
//   rows per group (mean) <= 128: decode, bound by the weights' bytes: 64-row tiles
//   (fp8 and bf16); else the 128-row tiles.
// JAX_MOE_A2A_GEMM_TILE_M (read at every call; for measurements) overrides it: a comma list of
// `64` | `128` (the tile), `rasterM` | `rasterN` | `rasterH` (heuristic), `s1` | `s2` | `s4` | `s8`
// (max swizzle); other words are ignored.
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
  return t;
}

size_t fp8_workspace_bytes(const GroupedGemmParams& p, int sm_count);
cudaError_t run_fp8(const GroupedGemmParams& p, int sm_count, cudaStream_t stream);
size_t bf16_workspace_bytes(const GroupedGemmParams& p, int sm_count);
cudaError_t run_bf16(const GroupedGemmParams& p, int sm_count, cudaStream_t stream);

}  // namespace a2a::gemm::detail
