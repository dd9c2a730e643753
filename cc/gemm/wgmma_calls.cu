// The library's calls into our own fp8 kernel (gemm_fp8_wgmma.cu): an fp8 forward grouped GEMM
// with kernel = wgmma (run_fp8_wgmma, picked by grouped_gemm.cu), and the gate+up GEMM with the
// fused SwiGLU (run_fp8_wgmma_swiglu): the rows outside the groups, then the kernel.
#include <cuda_bf16.h>

#include "core/fp8.h"
#include "gemm/fp8_wgmma.h"
#include "gemm/grouped_gemm.h"
#include "gemm/kernels.h"
#include "gemm/zero_rows.cuh"

namespace a2a::gemm::detail {
namespace {

// h_scale [rows, nb] = value on the rows no group covers (row_covered), grid-stride over the entries.
__global__ void __launch_bounds__(256) fill_uncovered_scales(GroupedGemmParams p, float* h_scale, int64_t nb,
                                                             float value) {
  const int64_t covered = ragged_covered_rows(p);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < output_rows(p) * nb;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    if (!row_covered(p, i / nb, covered)) h_scale[i] = value;
}

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
  LaunchStatus st;  // no workspace
  const int64_t rows = output_rows(p);
  if (rows == 0) return st;
  const unsigned blocks = zeroing_blocks(rows, sm_count);
  if (p.out == OutType::kF32)
    zero_rows_kernel<float><<<blocks, 1024, 0, stream>>>(p);
  else
    zero_rows_kernel<__nv_bfloat16><<<blocks, 1024, 0, stream>>>(p);
  if ((st.error = cudaGetLastError()) != cudaSuccess) return st;
  wgmma::Fp8LaunchParams q = fp8_params_of(p, sm_count);
  q.y = p.y;
  q.y_f32 = p.out == OutType::kF32;
  q.swap_tokens = t.swap_tokens;
  st.error = launch_checked(q, stream);
  return st;
}

cudaError_t run_fp8_wgmma_swiglu(const GroupedGemmParams& p, void* h, float* h_scale, int sm_count,
                                 cudaStream_t stream) {
  const int64_t rows = output_rows(p);
  if (rows == 0) return cudaSuccess;
  const int64_t f = p.n / 2;
  // Rows outside the groups: h = 0 (16-byte rows: f % 128 == 0) and an all-zero block's scale.
  GroupedGemmParams z = p;
  z.y = h;
  z.n = f;
  const unsigned blocks = zeroing_blocks(rows, sm_count);
  zero_rows_kernel<uint8_t><<<blocks, 1024, 0, stream>>>(z);
  fill_uncovered_scales<<<blocks, 256, 0, stream>>>(p, h_scale, f / 128, fp8_block_scale(0.0f, false));
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  wgmma::Fp8LaunchParams q = fp8_params_of(p, sm_count);
  q.swiglu_fp8 = true;
  q.h = static_cast<uint8_t*>(h);
  q.h_scale = h_scale;
  return launch_checked(q, stream);
}

}  // namespace a2a::gemm::detail
