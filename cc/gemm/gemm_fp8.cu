// fp8 e4m3 x fp8 e4m3 grouped GEMMs with block scales (1x128 on the rows, 128x128 on the weights),
// f32 accumulation, bf16 or f32 out.
#include "gemm/cutlass_grouped.cuh"
#include "gemm/kernels.h"

namespace a2a::gemm::detail {
namespace {

using Cluster = cute::Shape<cute::_1, cute::_1, cute::_1>;
// Many rows per group (prefill): 128x128 tiles, two consumer warpgroups on one tile.
template <class ElemD>
using Fp8Cfg = GroupedConfig<cutlass::float_e4m3_t, ElemD, cutlass::layout::ColumnMajor, true,
                             cute::Shape<cute::_128, cute::_128, cute::_128>, Cluster,
                             cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise,
                             cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>;
// Few rows per group (decode): 64x128 tiles, the two consumer warpgroups on alternate tiles.
template <class ElemD>
using Fp8SmallCfg = GroupedConfig<cutlass::float_e4m3_t, ElemD, cutlass::layout::ColumnMajor, true,
                                  cute::Shape<cute::_64, cute::_128, cute::_128>, Cluster,
                                  cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpongFP8Blockwise,
                                  cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong>;

}  // namespace

size_t fp8_workspace_bytes(const GroupedGemmParams& p, int sm_count) {
  if (few_rows_per_group(p))
    return p.out == OutType::kF32 ? config_workspace_bytes<Fp8SmallCfg<float>>(p, sm_count)
                                  : config_workspace_bytes<Fp8SmallCfg<cutlass::bfloat16_t>>(p, sm_count);
  return p.out == OutType::kF32 ? config_workspace_bytes<Fp8Cfg<float>>(p, sm_count)
                                : config_workspace_bytes<Fp8Cfg<cutlass::bfloat16_t>>(p, sm_count);
}

cudaError_t run_fp8(const GroupedGemmParams& p, int sm_count, cudaStream_t stream) {
  if (few_rows_per_group(p))
    return p.out == OutType::kF32 ? run_config<Fp8SmallCfg<float>>(p, sm_count, stream)
                                  : run_config<Fp8SmallCfg<cutlass::bfloat16_t>>(p, sm_count, stream);
  return p.out == OutType::kF32 ? run_config<Fp8Cfg<float>>(p, sm_count, stream)
                                : run_config<Fp8Cfg<cutlass::bfloat16_t>>(p, sm_count, stream);
}

}  // namespace a2a::gemm::detail
