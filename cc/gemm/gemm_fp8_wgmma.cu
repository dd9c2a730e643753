// Host side of our own fp8 block-scaled grouped GEMM: the TMA descriptors (cuTensorMapEncodeTiled,
// fetched from the driver at run time: the library never links libcuda) and the launch. Depends on
// nothing else of the library (benchmarks/gemm_probe.cu links it alone); the library's calls into
// it are in wgmma_calls.cu.
#include "gemm/fp8_wgmma.h"

#include <algorithm>
#include <atomic>

#include "gemm/fp8_wgmma.cuh"
#include "gemm/fp8_wgmma_swap.cuh"
#include "gemm/tma_host.h"

namespace a2a::gemm::wgmma {
namespace {

template <class OutT, bool kOverlap, Epi kEpi = Epi::kStore>
cudaError_t launch_typed(const CUtensorMap& tx, const CUtensorMap& tw, const Fp8Args& a, int grid, bool pdl,
                         cudaStream_t stream) {
  auto* kernel = fp8_grouped_kernel<OutT, kOverlap, kEpi>;
  // The shared-memory limit belongs to each device's context (one process may drive several GPUs):
  // set once per device and instance, not at every launch.
  static std::atomic<bool> set[kMaxDevices] = {};
  if (cudaError_t e = smem_limit_once(kernel, static_cast<int>(kSmemBytes), set); e != cudaSuccess) return e;
  cudaLaunchAttribute attr[2];
  const cudaLaunchConfig_t cfg = launch_config(grid, kSmemBytes, stream, pdl, 1, attr);
  return cudaLaunchKernelEx(&cfg, kernel, tx, tw, a);
}

template <class OutT, int kTok, int kCluster, Ablate kAblate = Ablate::kFull, Epi kEpi = Epi::kStore>
cudaError_t launch_swap(const CUtensorMap& tx, const CUtensorMap& tw, const Fp8Args& a, int sms, bool pdl,
                        cudaStream_t stream) {
  auto* kernel = fp8_swap_kernel<OutT, kTok, kCluster, kAblate, kEpi>;
  static std::atomic<bool> set[kMaxDevices] = {};
  static std::atomic<int> grid_of[kMaxDevices] = {};  // CTAs that run at once (pairs: 2 x the clusters)
  int dev = 0;
  if (cudaError_t e = cudaGetDevice(&dev); e != cudaSuccess) return e;
  constexpr int kBytes = static_cast<int>(swap_smem_bytes<kTok>());
  cudaLaunchAttribute attr[2];
  cudaLaunchConfig_t cfg = launch_config(sms, kBytes, stream, pdl, kCluster, attr);
  int grid = sms;
  if (dev >= kMaxDevices || !set[dev].load(std::memory_order_acquire)) {
    if (cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kBytes); e != cudaSuccess)
      return e;
    if (kCluster > 1) {
      // As many pairs as can run at once (a GPC with an odd number of free SMs leaves one out).
      cfg.gridDim = dim3(sms / kCluster * kCluster);
      int clusters = 0;
      if (cudaError_t e = cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg); e != cudaSuccess) return e;
      grid = clusters > 0 ? std::min(clusters * kCluster, sms / kCluster * kCluster) : sms / kCluster * kCluster;
    }
    if (dev < kMaxDevices) {
      grid_of[dev].store(grid, std::memory_order_relaxed);
      set[dev].store(true, std::memory_order_release);
    }
  } else {
    grid = grid_of[dev].load(std::memory_order_relaxed);
  }
  cfg.gridDim = dim3(grid);
  return cudaLaunchKernelEx(&cfg, kernel, tx, tw, a);
}

template <int kTok>
cudaError_t launch_swap_typed(const CUtensorMap& tx, const CUtensorMap& tw, const Fp8Args& a, bool y_f32, bool swiglu, int cluster,
                              int sms, int ablate, bool pdl, cudaStream_t stream) {
  if (swiglu)  // single CTAs (fp8_unsupported_reason); y unused
    return launch_swap<__nv_bfloat16, kTok, 1, Ablate::kFull, Epi::kSwigluFp8>(tx, tw, a, sms, pdl, stream);
#ifdef A2A_GEMM_ABLATIONS
  switch (ablate) {  // bf16 out, single CTAs
    case 1: return launch_swap<__nv_bfloat16, kTok, 1, Ablate::kNoMath>(tx, tw, a, sms, pdl, stream);
    case 2: return launch_swap<__nv_bfloat16, kTok, 1, Ablate::kNoX>(tx, tw, a, sms, pdl, stream);
    case 3: return launch_swap<__nv_bfloat16, kTok, 1, Ablate::kNoPromote>(tx, tw, a, sms, pdl, stream);
    default: break;
  }
#else
  (void)ablate;
#endif
  if (cluster == 2)
    return y_f32 ? launch_swap<float, kTok, 2>(tx, tw, a, sms, pdl, stream) : launch_swap<__nv_bfloat16, kTok, 2>(tx, tw, a, sms, pdl, stream);
  return y_f32 ? launch_swap<float, kTok, 1>(tx, tw, a, sms, pdl, stream) : launch_swap<__nv_bfloat16, kTok, 1>(tx, tw, a, sms, pdl, stream);
}

bool swap_tokens_known(int t) {
  for (int v : kSwapTokens)
    if (v == t) return true;
  return false;
}

}  // namespace

const char* fp8_unsupported_reason(const Fp8LaunchParams& p) {
  static_assert(kBN == 128 && kBK == 128, "fp8_shape_reason's tile and scale-block width");
  if (const char* why = fp8_shape_reason(p.rows, p.num_groups, p.n, p.k)) return why;
  if (p.swiglu_fp8 && (p.n % (2 * kBN) != 0 || p.h == nullptr || p.h_scale == nullptr))
    return "the SwiGLU epilogue needs N = 2F with F % 128 == 0, h and h_scale";
  if (p.swap_tokens != 0) {
    if (!swap_tokens_known(p.swap_tokens)) return "swap_tokens must be 0 or one of 32, 64, 128, 160";
    if (p.swiglu_fp8 && (p.swap_cluster != 1 || p.ablate != 0)) return "the swap-AB kernel's SwiGLU epilogue runs in single CTAs, whole";
    if (p.swap_cluster != 1 && p.swap_cluster != 2) return "swap_cluster must be 1 or 2";
    if (p.swap_cluster == 2 && (p.n / kBN) % 2 != 0) return "CTA pairs (swap_cluster 2) need N / 128 even";
  }
#ifdef A2A_GEMM_ABLATIONS
  if (p.ablate != 0 && (p.swap_tokens == 0 || p.swap_cluster != 1 || p.ablate < 0 || p.ablate > 3))
    return "ablations: 1..3, on the swap-AB kernel's single CTAs";
  if (p.ablate != 0 && p.y_f32) return "ablations are compiled with bf16 out only";
#else
  if (p.ablate != 0) return "ablations are compiled into benchmarks/gemm_probe.cu only (A2A_GEMM_ABLATIONS)";
#endif
  if (encoder() == nullptr) return "the driver has no cuTensorMapEncodeTiled";
  return nullptr;
}

cudaError_t launch_fp8_grouped(const Fp8LaunchParams& p, cudaStream_t stream) {
  if (p.rows == 0) return cudaSuccess;
  CUtensorMap tx, tw;
  const int x_box = p.swap_tokens != 0 ? p.swap_tokens / p.swap_cluster : kBM;  // a pair's CTAs load half each
  if (!encode_rows(&tx, p.x, static_cast<uint64_t>(p.rows), static_cast<uint64_t>(p.k), x_box) ||
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
  a.balance = p.balance_tiles;
  a.trim = p.trim_tokens;
  a.prefetch_kblocks = p.pdl ? p.prefetch_kblocks : 0;
  a.h = p.h;
  a.h_scale = p.h_scale;
#ifdef A2A_GEMM_ABLATIONS
  a.trace = p.trace;
  a.trace_per_cta = p.trace_per_cta;
#endif
  int sms = p.sm_count;
  if (sms <= 0) {
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess ||
        sms <= 0)
      sms = 132;
  }
  switch (p.swap_tokens) {
    case 0: break;
    case 32: return launch_swap_typed<32>(tx, tw, a, p.y_f32, p.swiglu_fp8, p.swap_cluster, sms, p.ablate, p.pdl, stream);
    case 64: return launch_swap_typed<64>(tx, tw, a, p.y_f32, p.swiglu_fp8, p.swap_cluster, sms, p.ablate, p.pdl, stream);
    case 128: return launch_swap_typed<128>(tx, tw, a, p.y_f32, p.swiglu_fp8, p.swap_cluster, sms, p.ablate, p.pdl, stream);
    case 160: return launch_swap_typed<160>(tx, tw, a, p.y_f32, p.swiglu_fp8, p.swap_cluster, sms, p.ablate, p.pdl, stream);
    default: return cudaErrorInvalidValue;
  }
  if (p.swiglu_fp8)  // y unused: the bf16 instance's epilogue type is never reached
    return p.serial_promotion ? launch_typed<__nv_bfloat16, false, Epi::kSwigluFp8>(tx, tw, a, sms, p.pdl, stream)
                              : launch_typed<__nv_bfloat16, true, Epi::kSwigluFp8>(tx, tw, a, sms, p.pdl, stream);
  if (p.serial_promotion)
    return p.y_f32 ? launch_typed<float, false>(tx, tw, a, sms, p.pdl, stream)
                   : launch_typed<__nv_bfloat16, false>(tx, tw, a, sms, p.pdl, stream);
  return p.y_f32 ? launch_typed<float, true>(tx, tw, a, sms, p.pdl, stream) : launch_typed<__nv_bfloat16, true>(tx, tw, a, sms, p.pdl, stream);
}

}  // namespace a2a::gemm::wgmma
