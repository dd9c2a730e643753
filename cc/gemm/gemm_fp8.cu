// fp8 e4m3 x fp8 e4m3 grouped GEMMs with block scales (1x128 on the rows, 128x128 on the weights),
// f32 accumulation, bf16 or f32 out. Which configuration runs: kernels.h, choose().
#include "gemm/cutlass_grouped.cuh"
#include "gemm/kernels.h"

namespace a2a::gemm::detail {
namespace {

using Cluster1 = cute::Shape<cute::_1, cute::_1, cute::_1>;
using Coop = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise;
using CoopEpi = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
using E4M3 = cutlass::float_e4m3_t;

// Many rows per group (prefill): 128x128 tiles, two consumer warpgroups on one tile.
template <class ElemD>
using Fp8Cfg = FwdConfig<E4M3, ElemD, ColumnMajor, true, cute::Shape<cute::_128, cute::_128, cute::_128>, Cluster1,
                         Coop, CoopEpi>;
// Few rows per group (decode): 64x128 tiles, the two consumer warpgroups on alternate tiles.
template <class ElemD>
using Fp8SmallCfg = FwdConfig<E4M3, ElemD, ColumnMajor, true, cute::Shape<cute::_64, cute::_128, cute::_128>, Cluster1,
                              cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpongFP8Blockwise,
                              cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong>;

template <class ElemD, class Fn>
auto with_config(const Tuning& t, Fn&& fn) {
  if (t.tile == Tile::kTile64) return fn(static_cast<Fp8SmallCfg<ElemD>*>(nullptr));
  return fn(static_cast<Fp8Cfg<ElemD>*>(nullptr));
}

template <class Fn>
auto with_out(const GroupedGemmParams& p, const Tuning& t, Fn&& fn) {
  return p.out == OutType::kF32 ? with_config<float>(t, fn) : with_config<cutlass::bfloat16_t>(t, fn);
}

}  // namespace

size_t fp8_workspace_bytes(const GroupedGemmParams& p, const Tuning& t, int sm_count) {
  return with_out(p, t, WorkspaceOf{p, sm_count, t});
}

LaunchStatus run_fp8(const GroupedGemmParams& p, const Tuning& t, int sm_count, cudaStream_t stream) {
  return with_out(p, t, LaunchOf{p, sm_count, t, stream});
}

}  // namespace a2a::gemm::detail
