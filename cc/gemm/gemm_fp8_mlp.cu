// Host side of the one-launch decode expert MLP (fp8_wgmma_mlp.cuh): its four TMA descriptors, the
// two GEMMs' arguments and the launch. Its own translation unit, so that its kernels compile
// beside gemm_fp8_wgmma.cu's. Depends on nothing else of the library (benchmarks/gemm_probe.cu
// links it alone).
#include <atomic>

#include "gemm/fp8_wgmma.h"
#include "gemm/fp8_wgmma_mlp.cuh"
#include "gemm/tma_host.h"

namespace a2a::gemm::wgmma {
namespace {

template <int kTok>
cudaError_t launch_mlp_typed(const CUtensorMap (&maps)[4], const Fp8Args& a1, const Fp8Args& a2, int32_t* sync, int sms, bool pdl,
                             cudaStream_t stream) {
  auto* kernel = fp8_swap_mlp_kernel<kTok>;
  constexpr int kBytes = static_cast<int>(swap_smem_bytes<kTok>());
  static std::atomic<bool> set[kMaxDevices] = {};
  if (cudaError_t e = smem_limit_once(kernel, kBytes, set); e != cudaSuccess) return e;
  cudaLaunchAttribute attr[2];
  const cudaLaunchConfig_t cfg = launch_config(sms, kBytes, stream, pdl, 1, attr);
  return cudaLaunchKernelEx(&cfg, kernel, maps[0], maps[1], maps[2], maps[3], a1, a2, static_cast<int*>(sync));
}

// The arguments shared by both GEMMs: the groups and the rows.
Fp8Args group_args(const Fp8MlpLaunchParams& p) {
  Fp8Args a;
  a.group_sizes = p.group_sizes;
  a.rows = p.rows;
  a.num_groups = static_cast<int32_t>(p.num_groups);
  a.per_group_rows = static_cast<int32_t>(p.per_group_rows);
  a.expert_major = p.expert_major;
  return a;
}

}  // namespace

const char* fp8_mlp_unsupported_reason(const Fp8MlpLaunchParams& p) {
  if (const char* why = fp8_shape_reason(p.rows, p.num_groups, 2 * p.ffn, p.hidden)) return why;
  if (const char* why = fp8_shape_reason(p.rows, p.num_groups, p.hidden, p.ffn)) return why;
  bool known = false;
  for (int t : kSwapTokens) known = known || t == p.swap_tokens;
  if (!known) return "swap_tokens must be one of 32, 64, 128, 160";
  if (p.expert_major && p.per_group_rows * p.num_groups != p.rows) return "expert_major: rows must be L * C";
  if (p.x == nullptr || p.x_scale == nullptr || p.w1 == nullptr || p.w1_scale == nullptr || p.w2 == nullptr ||
      p.w2_scale == nullptr || p.group_sizes == nullptr || p.y == nullptr || p.h == nullptr || p.h_scale == nullptr ||
      p.sync == nullptr)
    return "every buffer (x, scales, w1, w2, group_sizes, y, h, h_scale, sync) is needed";
  if (encoder() == nullptr) return "the driver has no cuTensorMapEncodeTiled";
  return nullptr;
}

cudaError_t launch_fp8_mlp(const Fp8MlpLaunchParams& p, cudaStream_t stream) {
  if (p.rows == 0) return cudaSuccess;
  const auto rows = static_cast<uint64_t>(p.rows), h = static_cast<uint64_t>(p.hidden), f = static_cast<uint64_t>(p.ffn);
  const auto l = static_cast<uint64_t>(p.num_groups);
  CUtensorMap maps[4];  // x, w1, h, w2
  if (!encode_rows(&maps[0], p.x, rows, h, p.swap_tokens) || !encode_rows(&maps[1], p.w1, l * 2 * f, h) ||
      !encode_rows(&maps[2], p.h, rows, f, p.swap_tokens) || !encode_rows(&maps[3], p.w2, l * h, f))
    return cudaErrorInvalidValue;
  Fp8Args a1 = group_args(p), a2 = group_args(p);
  a1.x_scale = p.x_scale;
  a1.w_scale = p.w1_scale;
  a1.n = static_cast<int32_t>(2 * p.ffn);
  a1.k = static_cast<int32_t>(p.hidden);
  a1.h = p.h;
  a1.h_scale = p.h_scale;
  a1.prefetch_kblocks = p.pdl ? p.prefetch_kblocks : 0;
  a1.lookahead_kblocks = a2.lookahead_kblocks = p.lookahead_kblocks;
  a1.stagger = a2.stagger = p.stagger;
#ifdef A2A_GEMM_ABLATIONS
  a1.trace = p.trace;
  a1.trace_per_cta = p.trace_per_cta;
#endif
  a2.x_scale = p.h_scale;
  a2.w_scale = p.w2_scale;
  a2.y = p.y;
  a2.n = static_cast<int32_t>(p.hidden);
  a2.k = static_cast<int32_t>(p.ffn);
  int sms = p.sm_count;
  if (sms <= 0) {
    int dev = 0;
    if (cudaError_t e = cudaGetDevice(&dev); e != cudaSuccess) return e;
    if (cudaError_t e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev); e != cudaSuccess) return e;
  }
  switch (p.swap_tokens) {
    case 32: return launch_mlp_typed<32>(maps, a1, a2, p.sync, sms, p.pdl, stream);
    case 64: return launch_mlp_typed<64>(maps, a1, a2, p.sync, sms, p.pdl, stream);
    case 128: return launch_mlp_typed<128>(maps, a1, a2, p.sync, sms, p.pdl, stream);
    case 160: return launch_mlp_typed<160>(maps, a1, a2, p.sync, sms, p.pdl, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace a2a::gemm::wgmma
