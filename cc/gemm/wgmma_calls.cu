// The library's calls into our own fp8 kernel (gemm_fp8_wgmma.cu): an fp8 forward grouped GEMM
// with kernel = wgmma (detail::run_fp8_wgmma, picked by grouped_gemm.cu), and the gate+up GEMM with
// the fused SwiGLU (launch_grouped_gemm_swiglu): the rows outside the groups, then the kernel.
#include <cuda_bf16.h>

#include "core/fp8.h"
#include "gemm/fp8_wgmma.h"
#include "gemm/grouped_gemm.h"
#include "gemm/kernels.h"
#include "gemm/zero_rows.cuh"
#include "gpu/warp.cuh"

namespace a2a::gemm::detail {
namespace {

// h_scale [rows, nb] = value on the rows no group covers (ragged: past min(sum of the sizes, R);
// expert_major: c >= min(max(counts[l], 0), C)), grid-stride over the entries.
__global__ void __launch_bounds__(256) fill_uncovered_scales(GroupedGemmParams p, float* h_scale, int64_t nb,
                                                             float value) {
  __shared__ unsigned long long valid_sum;
  int64_t valid = 0;
  if (p.layout == Layout::kRagged) {
    if (threadIdx.x == 0) valid_sum = 0;
    __syncthreads();
    unsigned long long t = 0;
    for (int64_t l = threadIdx.x; l < p.num_groups; l += blockDim.x)
      t += p.group_sizes[l] > 0 ? static_cast<unsigned long long>(p.group_sizes[l]) : 0ull;
    t = gpu::warp_sum(t);
    if ((threadIdx.x & 31) == 0 && t != 0) atomicAdd(&valid_sum, t);
    __syncthreads();
    valid = valid_sum < static_cast<unsigned long long>(p.rows) ? static_cast<int64_t>(valid_sum) : p.rows;
  }
  const int64_t total_rows = p.layout == Layout::kRagged ? p.rows : p.rows * p.num_groups;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total_rows * nb;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = i / nb;
    bool covered;
    if (p.layout == Layout::kRagged) {
      covered = row < valid;
    } else {
      const int64_t c = row % p.rows, cnt = p.group_sizes[row / p.rows];
      covered = c < (cnt < 0 ? 0 : cnt);
    }
    if (!covered) h_scale[i] = value;
  }
}

}  // namespace

LaunchStatus run_fp8_wgmma(const GroupedGemmParams& p, int sm_count, cudaStream_t stream) {
  LaunchStatus st;  // no workspace
  const int64_t total_rows = p.layout == Layout::kRagged ? p.rows : p.rows * p.num_groups;
  if (total_rows == 0) return st;
  // The rows past the groups: two zeroing blocks per SM at most (as the CUTLASS path's setup grid).
  const int64_t max_blocks = 2 * static_cast<int64_t>(sm_count > 0 ? sm_count : 132);
  const unsigned zero_blocks = static_cast<unsigned>(total_rows < max_blocks ? total_rows : max_blocks);
  if (p.out == OutType::kF32)
    zero_rows_kernel<float><<<zero_blocks, 1024, 0, stream>>>(p);
  else
    zero_rows_kernel<__nv_bfloat16><<<zero_blocks, 1024, 0, stream>>>(p);
  if ((st.error = cudaGetLastError()) != cudaSuccess) return st;
  wgmma::Fp8LaunchParams q;
  q.x = p.x;
  q.x_scale = p.x_scale;
  q.w = p.w;
  q.w_scale = p.w_scale;
  q.group_sizes = p.group_sizes;
  q.y = p.y;
  q.y_f32 = p.out == OutType::kF32;
  q.expert_major = p.layout == Layout::kExpertMajor;
  q.rows = total_rows;
  q.per_group_rows = q.expert_major ? p.rows : 0;
  q.num_groups = p.num_groups;
  q.n = p.n;
  q.k = p.k;
  q.sm_count = sm_count;
  if (wgmma::fp8_unsupported_reason(q) != nullptr) {
    st.error = cudaErrorNotSupported;
    return st;
  }
  st.error = wgmma::launch_fp8_grouped(q, stream);
  return st;
}

}  // namespace a2a::gemm::detail

namespace a2a::gemm {

const char* swiglu_gemm_unsupported_reason(const GroupedGemmParams& p) {
  if (const char* why = unsupported_reason(p)) return why;
  if (p.in != InType::kFp8 || p.mode != Mode::kForward) return "the fused SwiGLU GEMM is fp8 forward only";
  if (p.tuning.kernel != KernelChoice::kWgmma) return "the fused SwiGLU GEMM runs our own kernel only (kernel = wgmma)";
  if (!detail::wgmma_takes(p)) return "our own fp8 kernel takes 1 to 1,024 groups";
  if (p.n % 256 != 0) return "the fused SwiGLU GEMM needs w [L, 2F, K] with F % 128 == 0";
  return nullptr;
}

cudaError_t launch_grouped_gemm_swiglu(const GroupedGemmParams& p, void* h, float* h_scale, cudaStream_t stream) {
  const int64_t total_rows = p.layout == Layout::kRagged ? p.rows : p.rows * p.num_groups;
  if (total_rows == 0) return cudaSuccess;
  int dev = 0, sms = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess ||
      sms <= 0)
    sms = 132;
  const int64_t f = p.n / 2, nb = f / 128;
  // Rows outside the groups: h = 0 (16-byte rows: f % 128 == 0) and an all-zero block's scale.
  GroupedGemmParams z = p;
  z.y = h;
  z.n = f;
  const int64_t max_blocks = 2 * static_cast<int64_t>(sms);
  const unsigned blocks = static_cast<unsigned>(total_rows < max_blocks ? total_rows : max_blocks);
  detail::zero_rows_kernel<uint8_t><<<blocks, 1024, 0, stream>>>(z);
  detail::fill_uncovered_scales<<<blocks, 256, 0, stream>>>(p, h_scale, nb, fp8_block_scale(0.0f, false));
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  wgmma::Fp8LaunchParams q;
  q.x = p.x;
  q.x_scale = p.x_scale;
  q.w = p.w;
  q.w_scale = p.w_scale;
  q.group_sizes = p.group_sizes;
  q.expert_major = p.layout == Layout::kExpertMajor;
  q.rows = total_rows;
  q.per_group_rows = q.expert_major ? p.rows : 0;
  q.num_groups = p.num_groups;
  q.n = p.n;
  q.k = p.k;
  q.sm_count = sms;
  q.swiglu_fp8 = true;
  q.h = static_cast<uint8_t*>(h);
  q.h_scale = h_scale;
  if (wgmma::fp8_unsupported_reason(q) != nullptr) return cudaErrorNotSupported;
  return wgmma::launch_fp8_grouped(q, stream);
}

}  // namespace a2a::gemm
