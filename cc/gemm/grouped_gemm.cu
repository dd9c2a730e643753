// Host side of the grouped GEMMs: the static checks, workspace sizes and the dispatch to the
// kernel translation units (the SwiGLU epilogue kernel: swiglu.cu).

#include "gemm/grouped_gemm.h"
#include "gemm/kernels.h"

namespace a2a::gemm {
namespace {

int sm_count_of_current_device() {
  static int cached[64] = {0};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0) return 132;
  if (dev < 64 && cached[dev] > 0) return cached[dev];
  int n = 0;
  if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || n <= 0) n = 132;
  if (dev < 64) cached[dev] = n;
  return n;
}

}  // namespace

bool kernels_built() { return true; }

const char* unsupported_reason(const GroupedGemmParams& p) {
  if (p.num_groups < 0 || p.rows < 0 || p.n <= 0 || p.k <= 0) return "empty or negative N or K";
  if (p.num_groups * p.rows > (int64_t{1} << 31) - 1) return "more than 2^31 rows";
  if (p.n > (int64_t{1} << 31) - 1 || p.k > (int64_t{1} << 31) - 1) return "N or K over 2^31";
  const bool transpose_w = p.mode == Mode::kTransposeW;
  if (p.mode == Mode::kWgrad) {
    if (p.in != InType::kBF16 || p.out != OutType::kF32) return "wgrad is built for bf16 in, f32 out";
    if (p.k % 8 != 0 || p.n % 8 != 0) return "wgrad needs K % 8 == 0 and N % 8 == 0 (16-byte rows)";
    return nullptr;
  }
  if (p.in == InType::kFp8) {
    if (transpose_w) return "fp8 with transpose_w is not implemented natively";
    if (p.k % 128 != 0 || p.n % 128 != 0) return "fp8 needs K % 128 == 0 and N % 128 == 0 (128x128 weight blocks)";
  } else {
    if (p.k % 8 != 0 || p.n % 8 != 0) return "bf16 needs K % 8 == 0 and N % 8 == 0 (16-byte rows)";
    if (transpose_w && p.out != OutType::kBF16) return "transpose_w is built for bf16 out only";
  }
  if (p.out == OutType::kF32 && p.n % 4 != 0) return "f32 out needs N % 4 == 0";
  return nullptr;
}

size_t workspace_bytes(const GroupedGemmParams& p, int device_sm_count) {
  const int sm = device_sm_count > 0 ? device_sm_count : sm_count_of_current_device();
  const detail::Tuning t = detail::choose(p);
  if (t.wgmma) return 0;
  return p.in == InType::kFp8 ? detail::fp8_workspace_bytes(p, t, sm) : detail::bf16_workspace_bytes(p, t, sm);
}

const char* swiglu_gemm_unsupported_reason(const GroupedGemmParams& p) {
  if (const char* why = unsupported_reason(p)) return why;
  if (p.in != InType::kFp8 || p.mode != Mode::kForward) return "the fused SwiGLU GEMM is fp8 forward only";
  if (const char* why = wgmma::fp8_shape_reason(detail::output_rows(p), p.num_groups, p.n, p.k)) return why;
  if (!detail::choose(p).wgmma)
    return "the fused SwiGLU GEMM runs our own fp8 kernel only (kernel = wgmma or swap, or auto at decode shapes: rows per "
           "expert <= 128)";
  if (p.n % 256 != 0) return "the fused SwiGLU GEMM needs w [L, 2F, K] with F % 128 == 0";
  return nullptr;
}

bool swiglu_gemm_fused_by_default(const GroupedGemmParams& p) {
  return swiglu_gemm_unsupported_reason(p) == nullptr && detail::fuses_swiglu_by_default(detail::choose(p));
}

cudaError_t launch_grouped_gemm_swiglu(const GroupedGemmParams& p, void* h, float* h_scale, cudaStream_t stream) {
  return detail::run_fp8_wgmma_swiglu(p, detail::choose(p), h, h_scale, sm_count_of_current_device(), stream);
}

LaunchStatus launch_grouped_gemm(const GroupedGemmParams& p, cudaStream_t stream) {
  const int sm = sm_count_of_current_device();
  const detail::Tuning t = detail::choose(p);
  if (t.wgmma) return detail::run_fp8_wgmma(p, t, sm, stream);
  return p.in == InType::kFp8 ? detail::run_fp8(p, t, sm, stream) : detail::run_bf16(p, t, sm, stream);
}

}  // namespace a2a::gemm
