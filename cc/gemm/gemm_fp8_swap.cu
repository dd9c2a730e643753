// fp8 e4m3 grouped GEMMs with block scales in swap-AB tiles (Tile::kSwap160 / kSwap128, kernels.h):
// the weights on CUTLASS's M (128 rows a tile, 64 per consumer warpgroup), the tokens on its N
// (160 or 128 a tile), cooperative, so the two warpgroups share each tile and one's promotion of the
// block-scaled accumulators overlaps the other's WGMMAs. For decode with few local experts (~128
// rows each): one token tile covers an expert's rows, so each weight tile is read once.
// A translation unit of its own so the build compiles it beside gemm_fp8.cu.
//
// Why 160 and 128 tokens: WGMMA takes N = 160 for fp8 (a multiple of 8 up to 256); the
// cooperative epilogue's subtile is 128 x gcd(32, N) = 128 x 32; the block-scale copy of the token
// scales (1x128 per token) spreads N scales over one warp, so N must be a multiple of 32 (144 is
// not).
#include "gemm/cutlass_grouped.cuh"
#include "gemm/kernels.h"

namespace a2a::gemm::detail {
namespace {

template <class ElemD, class TokN>
using Fp8SwapCfg = SwapABConfig<cutlass::float_e4m3_t, ElemD, true, cute::Shape<cute::_128, TokN, cute::_128>,
                                cute::Shape<cute::_1, cute::_1, cute::_1>,
                                cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise,
                                cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>;

template <class ElemD, class Fn>
auto with_config(const Tuning& t, Fn&& fn) {
  if (t.tile == Tile::kSwap128) return fn(static_cast<Fp8SwapCfg<ElemD, cute::_128>*>(nullptr));
  return fn(static_cast<Fp8SwapCfg<ElemD, cute::_160>*>(nullptr));
}

template <class Fn>
auto with_out(const GroupedGemmParams& p, const Tuning& t, Fn&& fn) {
  return p.out == OutType::kF32 ? with_config<float>(t, fn) : with_config<cutlass::bfloat16_t>(t, fn);
}

}  // namespace

size_t fp8_swap_workspace_bytes(const GroupedGemmParams& p, const Tuning& t, int sm_count) {
  return with_out(p, t, WorkspaceOf{p, sm_count, t});
}

LaunchStatus run_fp8_swap(const GroupedGemmParams& p, const Tuning& t, int sm_count, cudaStream_t stream) {
  return with_out(p, t, LaunchOf{p, sm_count, t, stream});
}

}  // namespace a2a::gemm::detail
