// The library's calls into our own fp8 kernel (gemm_fp8_wgmma.cu): an fp8 forward grouped GEMM
// with kernel = wgmma (run_fp8_wgmma, picked by grouped_gemm.cu), and the gate+up GEMM with the
// fused SwiGLU (run_fp8_wgmma_swiglu). The kernels write the rows outside the groups themselves.
#include <cuda_bf16.h>

#include "gemm/fp8_wgmma.h"
#include "gemm/grouped_gemm.h"
#include "gemm/kernels.h"

namespace a2a::gemm::detail {
namespace {

// The kernel's parameters for a forward fp8 call p (y and the epilogue's outputs left to the caller).
wgmma::Fp8LaunchParams fp8_params_of(const GroupedGemmParams& p, int sm_count) {
  wgmma::Fp8LaunchParams q;
  q.x = p.x;
  q.x_scale = p.x_scale;
  q.w = p.w;
  q.w_scale = p.w_scale;
  q.group_sizes = p.group_sizes;
  q.expert_major = p.layout == Layout::kExpertMajor;
  q.rows = output_rows(p);
  q.per_group_rows = q.expert_major ? p.rows : 0;
  q.num_groups = p.num_groups;
  q.n = p.n;
  q.k = p.k;
  q.sm_count = sm_count;
  return q;
}

cudaError_t launch_checked(const wgmma::Fp8LaunchParams& q, cudaStream_t stream) {
  if (wgmma::fp8_unsupported_reason(q) != nullptr) return cudaErrorNotSupported;
  return wgmma::launch_fp8_grouped(q, stream);
}

}  // namespace

LaunchStatus run_fp8_wgmma(const GroupedGemmParams& p, const Tuning& t, int sm_count, cudaStream_t stream) {
  LaunchStatus st;  // no workspace; the kernel zeroes the rows no group covers
  if (output_rows(p) == 0) return st;
  wgmma::Fp8LaunchParams q = fp8_params_of(p, sm_count);
  q.y = p.y;
  q.y_f32 = p.out == OutType::kF32;
  q.swap_tokens = t.swap_tokens;
  st.error = launch_checked(q, stream);
  return st;
}

cudaError_t run_fp8_wgmma_swiglu(const GroupedGemmParams& p, const Tuning& t, void* h, float* h_scale, int sm_count,
                                 cudaStream_t stream) {
  if (output_rows(p) == 0) return cudaSuccess;  // the kernel writes h = 0 on rows outside the groups
  wgmma::Fp8LaunchParams q = fp8_params_of(p, sm_count);
  q.swap_tokens = t.swap_tokens;  // decode: the swap-AB kernel's SwiGLU epilogue
  q.swiglu_fp8 = true;
  q.h = static_cast<uint8_t*>(h);
  q.h_scale = h_scale;
  return launch_checked(q, stream);
}

}  // namespace a2a::gemm::detail
