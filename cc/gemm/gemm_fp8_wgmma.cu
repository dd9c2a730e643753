// Host side of our own fp8 block-scaled grouped GEMM: the TMA descriptors (cuTensorMapEncodeTiled,
// fetched from the driver at run time: the library never links libcuda) and the launch.
#include "gemm/fp8_wgmma.h"

#include <cudaTypedefs.h>

#include "gemm/fp8_wgmma.cuh"
#include "gemm/kernels.h"
#include "gemm/zero_rows.cuh"
#include "core/fp8.h"
#include "gpu/warp.cuh"

namespace a2a::gemm::wgmma {
namespace {

PFN_cuTensorMapEncodeTiled_v12000 encoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess)
      f = nullptr;
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  }();
  return fn;
}

// A [rows, k] e4m3 row-major tensor read as [128 rows, 128 k] boxes, 128-byte swizzled (the WGMMA
// operand layout of fp8_wgmma.cuh); rows past the tensor read as zeros.
bool encode_rows(CUtensorMap* map, const void* base, uint64_t rows, uint64_t k) {
  auto fn = encoder();
  if (fn == nullptr) return false;
  const cuuint64_t dims[2] = {k, rows};
  const cuuint64_t strides[1] = {k};  // bytes between rows
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(kBK), static_cast<cuuint32_t>(kBM)};
  const cuuint32_t elem[2] = {1, 1};
  return fn(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, const_cast<void*>(base), dims, strides, box, elem,
            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

template <class OutT, bool kOverlap, Epi kEpi = Epi::kStore>
cudaError_t launch_typed(const CUtensorMap& tx, const CUtensorMap& tw, const Fp8Args& a, int grid, cudaStream_t stream) {
  // Set at every launch (as CUTLASS's adapter does): the attribute belongs to the current device's
  // context, and one process may drive several GPUs.
  if (cudaError_t e = cudaFuncSetAttribute(fp8_grouped_kernel<OutT, kOverlap, kEpi>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(kSmemBytes));
      e != cudaSuccess)
    return e;
  fp8_grouped_kernel<OutT, kOverlap, kEpi><<<grid, kThreads, kSmemBytes, stream>>>(tx, tw, a);
  return cudaGetLastError();
}

}  // namespace

const char* fp8_unsupported_reason(const Fp8LaunchParams& p) {
  if (p.n <= 0 || p.k <= 0 || p.n % kBN != 0 || p.k % kBK != 0) return "N and K must be positive multiples of 128";
  if (p.swiglu_fp8 && (p.n % (2 * kBN) != 0 || p.h == nullptr || p.h_scale == nullptr))
    return "the SwiGLU epilogue needs N = 2F with F % 128 == 0, h and h_scale";
  if (p.num_groups < 1 || p.num_groups > kMaxGroups) return "the number of groups must be 1..1024";
  if (p.rows >= (int64_t{1} << 31) || p.num_groups * p.n >= (int64_t{1} << 31)) return "rows or L*N reach 2^31";
  if (p.k >= (int64_t{1} << 31)) return "K reaches 2^31";
  if (encoder() == nullptr) return "the driver has no cuTensorMapEncodeTiled";
  return nullptr;
}

cudaError_t launch_fp8_grouped(const Fp8LaunchParams& p, cudaStream_t stream) {
  if (p.rows == 0) return cudaSuccess;
  CUtensorMap tx, tw;
  if (!encode_rows(&tx, p.x, static_cast<uint64_t>(p.rows), static_cast<uint64_t>(p.k)) ||
      !encode_rows(&tw, p.w, static_cast<uint64_t>(p.num_groups * p.n), static_cast<uint64_t>(p.k)))
    return cudaErrorInvalidValue;
  Fp8Args a;
  a.x_scale = p.x_scale;
  a.w_scale = p.w_scale;
  a.group_sizes = p.group_sizes;
  a.y = p.y;
  a.rows = p.rows;
  a.num_groups = static_cast<int32_t>(p.num_groups);
  a.n = static_cast<int32_t>(p.n);
  a.k = static_cast<int32_t>(p.k);
  a.per_group_rows = static_cast<int32_t>(p.per_group_rows);
  a.expert_major = p.expert_major;
  a.h = p.h;
  a.h_scale = p.h_scale;
  int sms = p.sm_count;
  if (sms <= 0) {
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess ||
        sms <= 0)
      sms = 132;
  }
  if (p.swiglu_fp8)  // y unused: the bf16 instance's epilogue type is never reached
    return p.serial_promotion ? launch_typed<__nv_bfloat16, false, Epi::kSwigluFp8>(tx, tw, a, sms, stream)
                              : launch_typed<__nv_bfloat16, true, Epi::kSwigluFp8>(tx, tw, a, sms, stream);
  if (p.serial_promotion)
    return p.y_f32 ? launch_typed<float, false>(tx, tw, a, sms, stream)
                   : launch_typed<__nv_bfloat16, false>(tx, tw, a, sms, stream);
  return p.y_f32 ? launch_typed<float, true>(tx, tw, a, sms, stream) : launch_typed<__nv_bfloat16, true>(tx, tw, a, sms, stream);
}

}  // namespace a2a::gemm::wgmma

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
