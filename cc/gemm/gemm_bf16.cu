// bf16 x bf16 grouped GEMMs, f32 accumulation: the forward (bf16 or f32 out; w as [L, N, K] or,
// Mode::kTransposeW, the backward's dgrad, [L, K, N]) and the backward's wgrad dW[l] = dY_l^T X_l (f32
// out). Which configuration runs: kernels.h, choose().
#include "gemm/cutlass_grouped.cuh"
#include "gemm/kernels.h"

namespace a2a::gemm::detail {
namespace {

using Cluster = cute::Shape<cute::_1, cute::_1, cute::_1>;
using Coop = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative;
using CoopEpi = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
using BF16 = cutlass::bfloat16_t;
// Many rows per group (prefill): 128x256 tiles, two consumer warpgroups on one tile.
template <class ElemD, class LayoutB>
using Bf16Cfg = FwdConfig<BF16, ElemD, LayoutB, false, cute::Shape<cute::_128, cute::_256, cute::_64>, Cluster, Coop,
                          CoopEpi>;
// Few rows per group (decode): 64x128 tiles, the two consumer warpgroups on alternate tiles.
template <class ElemD, class LayoutB>
using Bf16SmallCfg = FwdConfig<BF16, ElemD, LayoutB, false, cute::Shape<cute::_64, cute::_128, cute::_64>, Cluster,
                               cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong,
                               cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong>;
// wgrad: dW tiles of 128 x 128, K (the group's rows) in steps of 64.
using WgradCfg32 = WgradConfig<float, cute::Shape<cute::_128, cute::_128, cute::_64>, Cluster, Coop, CoopEpi>;
using NK = ColumnMajor;  // w [N, K], K contiguous
using KN = RowMajor;     // w [K, N], N contiguous

// The configuration of p's mode and, for the forward, t's tile (the caller's choose(p)).
template <class Fn>
auto with_config(const GroupedGemmParams& p, const Tuning& t, Fn&& fn) {
  if (p.mode == Mode::kWgrad) return fn(static_cast<WgradCfg32*>(nullptr));
  if (p.mode == Mode::kTransposeW) return fn(static_cast<Bf16Cfg<BF16, KN>*>(nullptr));
  if (t.tile == Tile::kTile64)
    return p.out == OutType::kF32 ? fn(static_cast<Bf16SmallCfg<float, NK>*>(nullptr))
                                  : fn(static_cast<Bf16SmallCfg<BF16, NK>*>(nullptr));
  return p.out == OutType::kF32 ? fn(static_cast<Bf16Cfg<float, NK>*>(nullptr))
                                : fn(static_cast<Bf16Cfg<BF16, NK>*>(nullptr));
}

}  // namespace

size_t bf16_workspace_bytes(const GroupedGemmParams& p, const Tuning& t, int sm_count) {
  return with_config(p, t, WorkspaceOf{p, sm_count, t});
}

LaunchStatus run_bf16(const GroupedGemmParams& p, const Tuning& t, int sm_count, cudaStream_t stream) {
  return with_config(p, t, LaunchOf{p, sm_count, t, stream});
}

}  // namespace a2a::gemm::detail
