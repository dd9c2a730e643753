// bf16 x bf16 grouped GEMMs, f32 accumulation, bf16 or f32 out; w as [L, N, K] or (transpose_w,
// the backward's dgrad) [L, K, N].
#include "gemm/cutlass_grouped.cuh"
#include "gemm/kernels.h"

namespace a2a::gemm::detail {
namespace {

using Cluster = cute::Shape<cute::_1, cute::_1, cute::_1>;
// Many rows per group (prefill): 128x256 tiles, two consumer warpgroups on one tile.
template <class ElemD, class LayoutB>
using Bf16Cfg = GroupedConfig<cutlass::bfloat16_t, ElemD, LayoutB, false, cute::Shape<cute::_128, cute::_256, cute::_64>,
                              Cluster, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative,
                              cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>;
// Few rows per group (decode): 64x128 tiles, the two consumer warpgroups on alternate tiles.
template <class ElemD, class LayoutB>
using Bf16SmallCfg = GroupedConfig<cutlass::bfloat16_t, ElemD, LayoutB, false, cute::Shape<cute::_64, cute::_128, cute::_64>,
                                   Cluster, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong,
                                   cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong>;
using NK = cutlass::layout::ColumnMajor;  // w [N, K], K contiguous
using KN = cutlass::layout::RowMajor;     // w [K, N], N contiguous

}  // namespace

size_t bf16_workspace_bytes(const GroupedGemmParams& p, int sm_count) {
  if (few_rows_per_group(p) && !p.transpose_w)
    return p.out == OutType::kF32 ? config_workspace_bytes<Bf16SmallCfg<float, NK>>(p, sm_count)
                                  : config_workspace_bytes<Bf16SmallCfg<cutlass::bfloat16_t, NK>>(p, sm_count);
  if (p.transpose_w) return config_workspace_bytes<Bf16Cfg<cutlass::bfloat16_t, KN>>(p, sm_count);
  return p.out == OutType::kF32 ? config_workspace_bytes<Bf16Cfg<float, NK>>(p, sm_count)
                                : config_workspace_bytes<Bf16Cfg<cutlass::bfloat16_t, NK>>(p, sm_count);
}

cudaError_t run_bf16(const GroupedGemmParams& p, int sm_count, cudaStream_t stream) {
  if (few_rows_per_group(p) && !p.transpose_w)
    return p.out == OutType::kF32 ? run_config<Bf16SmallCfg<float, NK>>(p, sm_count, stream)
                                  : run_config<Bf16SmallCfg<cutlass::bfloat16_t, NK>>(p, sm_count, stream);
  if (p.transpose_w) return run_config<Bf16Cfg<cutlass::bfloat16_t, KN>>(p, sm_count, stream);
  return p.out == OutType::kF32 ? run_config<Bf16Cfg<float, NK>>(p, sm_count, stream)
                                : run_config<Bf16Cfg<cutlass::bfloat16_t, NK>>(p, sm_count, stream);
}

}  // namespace a2a::gemm::detail
