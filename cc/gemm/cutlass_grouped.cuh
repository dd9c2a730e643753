// One CUTLASS 3.x Hopper pointer-array grouped GEMM configuration and its device-side setup.
//
// Included only by the kernel translation units of cc/gemm (each instantiates the few
// configurations it launches, so the build compiles only what is used). The CUTLASS headers come
// from the nvidia-cutlass wheel (CMakeLists.txt finds them through Python).
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/detail/blockwise_scale_layout.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"

#include "gemm/grouped_gemm.h"
#include "gemm/kernels.h"
#include "gemm/zero_rows.cuh"

namespace a2a::gemm::detail {

using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;  // <M, N, K> per group

// How a configuration maps the grouped problem onto CUTLASS's (M, N, K) per group (l):
//   kFwd:    M = the group's rows, N = n, K = k. A = x rows [m, K] (K-major), B = w[l] [N, K]
//            (ColumnMajor: K-major) or [K, N] (Mode::kTransposeW: RowMajor), D = y rows [m, N] row-major.
//   kWgrad:  dW[l] = dY_l^T X_l: M = n (dY's columns), N = k (X's columns), K = the group's rows.
//            A = dY rows viewed [n, m] (ColumnMajor: M contiguous), B = X rows viewed [k, m]
//            (RowMajor in CUTLASS's [K, N] sense: N contiguous), D = dW[l] [n, k] row-major.
// (A swap-AB fp8 forward, weights on M and 32 or 64 tokens on N, was measured slower than the
// 64-row ping-pong tiles at decode and removed: notes/benchmarks.md, 2026-12-04, commit 4ca7ec4.)
enum class Op : int { kFwd = 0, kWgrad = 2 };

// The configuration: element types, layouts of A, B and D, blockwise fp8 scaling (1x128 on the
// rows, 128x128 on the weights, both K-major), tile, cluster and schedules.
template <class ElemAB_, class ElemD_, class LayoutA_, class LayoutB_, class LayoutD_, Op kOp_, bool kBlockwise_,
          class Tile_, class Cluster_, class KernelSchedule_, class EpilogueSchedule_>
struct GroupedConfig {
  using ElemAB = ElemAB_;
  using ElemD = ElemD_;
  using LayoutA = LayoutA_;
  using LayoutB = LayoutB_;
  using LayoutD = LayoutD_;
  using Tile = Tile_;
  static constexpr Op kOp = kOp_;
  static constexpr bool kBlockwise = kBlockwise_;
  static constexpr int kAlignAB = 128 / cutlass::sizeof_bits<ElemAB>::value;
  static constexpr int kAlignD = 128 / cutlass::sizeof_bits<ElemD>::value;

  using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, 128, 128, cute::GMMA::Major::K,
                                                                cute::GMMA::Major::K>;
  using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
  using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());

  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile_, Cluster_,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, LayoutD*, kAlignD, ElemD,
      LayoutD*, kAlignD, EpilogueSchedule_,
      cutlass::epilogue::fusion::LinearCombination<ElemD, float, void, float>>::CollectiveOp;

  using LayoutATag = std::conditional_t<kBlockwise, cute::tuple<LayoutA*, LayoutSFA*>, LayoutA*>;
  using LayoutBTag = std::conditional_t<kBlockwise, cute::tuple<LayoutB*, LayoutSFB*>, LayoutB*>;

  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElemAB, LayoutATag, kAlignAB, ElemAB,
      LayoutBTag, kAlignAB, float, Tile_, Cluster_,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename Epilogue::SharedStorage))>,
      KernelSchedule_>::CollectiveOp;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideD = typename Kernel::InternalStrideD;
  using Shape3 = typename ProblemShape::UnderlyingProblemShape;
};

// The common families (the kernel translation units pick tiles and schedules).
using RowMajor = cutlass::layout::RowMajor;
using ColumnMajor = cutlass::layout::ColumnMajor;
template <class ElemAB, class ElemD, class LayoutB, bool kBlockwise, class Tile, class Cluster, class KS, class ES>
using FwdConfig = GroupedConfig<ElemAB, ElemD, RowMajor, LayoutB, RowMajor, Op::kFwd, kBlockwise, Tile, Cluster, KS, ES>;
template <class ElemD, class Tile, class Cluster, class KS, class ES>
using WgradConfig = GroupedConfig<cutlass::bfloat16_t, ElemD, ColumnMajor, RowMajor, RowMajor, Op::kWgrad, false,
                                  Tile, Cluster, KS, ES>;

// The per-group argument arrays, carved from the workspace after CUTLASS's own part.
template <class Cfg>
struct GroupArrays {
  typename Cfg::Shape3* shapes;
  const typename Cfg::ElemAB** a;
  typename Cfg::StrideA* stride_a;
  const typename Cfg::ElemAB** b;
  typename Cfg::StrideB* stride_b;
  typename Cfg::ElemD** d;
  typename Cfg::StrideD* stride_d;
  const float** sfa;
  typename Cfg::LayoutSFA* layout_sfa;
  const float** sfb;
  typename Cfg::LayoutSFB* layout_sfb;

  static constexpr size_t round(size_t n) { return (n + 127) / 128 * 128; }

  // Bytes for L groups; carve(base, L) lays them out in this order.
  static size_t bytes(int64_t L) {
    return round(L * sizeof(typename Cfg::Shape3)) + 3 * round(L * sizeof(void*)) +
           round(L * sizeof(typename Cfg::StrideA)) + round(L * sizeof(typename Cfg::StrideB)) +
           round(L * sizeof(typename Cfg::StrideD)) + 2 * round(L * sizeof(void*)) +
           round(L * sizeof(typename Cfg::LayoutSFA)) + round(L * sizeof(typename Cfg::LayoutSFB));
  }
  static GroupArrays carve(char* p, int64_t L) {
    GroupArrays g;
    auto take = [&](size_t n) { char* q = p; p += round(n); return q; };
    g.shapes = reinterpret_cast<typename Cfg::Shape3*>(take(L * sizeof(typename Cfg::Shape3)));
    g.a = reinterpret_cast<const typename Cfg::ElemAB**>(take(L * sizeof(void*)));
    g.b = reinterpret_cast<const typename Cfg::ElemAB**>(take(L * sizeof(void*)));
    g.d = reinterpret_cast<typename Cfg::ElemD**>(take(L * sizeof(void*)));
    g.stride_a = reinterpret_cast<typename Cfg::StrideA*>(take(L * sizeof(typename Cfg::StrideA)));
    g.stride_b = reinterpret_cast<typename Cfg::StrideB*>(take(L * sizeof(typename Cfg::StrideB)));
    g.stride_d = reinterpret_cast<typename Cfg::StrideD*>(take(L * sizeof(typename Cfg::StrideD)));
    g.sfa = reinterpret_cast<const float**>(take(L * sizeof(void*)));
    g.sfb = reinterpret_cast<const float**>(take(L * sizeof(void*)));
    g.layout_sfa = reinterpret_cast<typename Cfg::LayoutSFA*>(take(L * sizeof(typename Cfg::LayoutSFA)));
    g.layout_sfb = reinterpret_cast<typename Cfg::LayoutSFB*>(take(L * sizeof(typename Cfg::LayoutSFB)));
    return g;
  }
};

constexpr int kSetupThreads = 1024;

// Block 0 (kSetupThreads threads): row offsets of the groups (a block scan over chunks of
// kSetupThreads groups), then each group's problem shape, pointers and strides (Op above). Ragged:
// group l covers rows [off_l, off_l + m_l) with m_l = clamp(group_sizes[l], 0, R - off_l).
// expert_major: rows [l*C, l*C + min(max(counts[l], 0), C)). Blocks 1..: zero_uncovered_rows.
template <class Cfg>
__global__ void __launch_bounds__(kSetupThreads) prepare_groups(GroupedGemmParams p, GroupArrays<Cfg> g) {
  using namespace cute;
  if (blockIdx.x > 0) {
    zero_uncovered_rows<typename Cfg::ElemD>(p, blockIdx.x - 1, gridDim.x - 1);
    return;
  }
  __shared__ int64_t scan[kSetupThreads];
  const int t = threadIdx.x;
  int64_t carry = 0;
  const int N = static_cast<int>(p.n), K = static_cast<int>(p.k);
  for (int64_t base = 0; base < p.num_groups; base += kSetupThreads) {
    const int64_t l = base + t;
    int64_t size = 0;
    if (l < p.num_groups) {
      size = p.group_sizes[l];
      size = size < 0 ? 0 : size;
      if (p.layout == Layout::kExpertMajor && size > p.rows) size = p.rows;
    }
    scan[t] = size;
    __syncthreads();
    for (int s = 1; s < kSetupThreads; s <<= 1) {
      int64_t v = t >= s ? scan[t - s] : 0;
      __syncthreads();
      scan[t] += v;
      __syncthreads();
    }
    const int64_t incl = carry + scan[t];
    const int64_t excl = incl - size;
    carry += scan[kSetupThreads - 1];
    __syncthreads();
    if (l >= p.num_groups) continue;
    int64_t row0, m;
    if (p.layout == Layout::kRagged) {
      row0 = excl < p.rows ? excl : p.rows;
      m = incl < p.rows ? size : p.rows - row0;
    } else {
      row0 = l * p.rows;
      m = size;
    }
    const int M = static_cast<int>(m);
    const auto* x = static_cast<const typename Cfg::ElemAB*>(p.x);
    const auto* w = static_cast<const typename Cfg::ElemAB*>(p.w);
    auto* y = static_cast<typename Cfg::ElemD*>(p.y);
    if constexpr (Cfg::kOp == Op::kFwd) {
      g.shapes[l] = make_shape(M, N, K);
      g.a[l] = x + row0 * p.k;
      g.b[l] = w + l * p.n * p.k;
      g.d[l] = y + row0 * p.n;
      g.stride_a[l] = cutlass::make_cute_packed_stride(typename Cfg::StrideA{}, make_shape(M, K, 1));
      g.stride_b[l] = cutlass::make_cute_packed_stride(typename Cfg::StrideB{}, make_shape(N, K, 1));
      g.stride_d[l] = cutlass::make_cute_packed_stride(typename Cfg::StrideD{}, make_shape(M, N, 1));
    } else {  // kWgrad: x = X rows [.., K], w = dY rows [.., N], y = dW [L, N, K]
      g.shapes[l] = make_shape(M == 0 ? 0 : N, K, M);  // no tiles for an empty group (zeroed above)
      g.a[l] = w + row0 * p.n;
      g.b[l] = x + row0 * p.k;
      g.d[l] = y + l * p.n * p.k;
      g.stride_a[l] = cutlass::make_cute_packed_stride(typename Cfg::StrideA{}, make_shape(N, M, 1));
      g.stride_b[l] = cutlass::make_cute_packed_stride(typename Cfg::StrideB{}, make_shape(K, M, 1));
      g.stride_d[l] = cutlass::make_cute_packed_stride(typename Cfg::StrideD{}, make_shape(N, K, 1));
    }
    if constexpr (Cfg::kBlockwise) {  // kFwd only (wgrad is bf16)
      const int64_t kb = p.k / 128;
      g.sfa[l] = p.x_scale + row0 * kb;
      g.sfb[l] = p.w_scale + l * (p.n / 128) * kb;
      g.layout_sfa[l] = Cfg::ScaleConfig::tile_atom_to_shape_SFA(make_shape(M, N, K, 1));
      g.layout_sfb[l] = Cfg::ScaleConfig::tile_atom_to_shape_SFB(make_shape(M, N, K, 1));
    }
  }
}

template <class Cfg>
typename Cfg::Gemm::Arguments make_arguments(const GroupedGemmParams& p, const GroupArrays<Cfg>& g, int sm_count,
                                             const Tuning& tune) {
  typename Cfg::Gemm::Arguments args;
  args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
  args.problem_shape = {static_cast<int>(p.num_groups), g.shapes, nullptr};
  if constexpr (Cfg::kBlockwise) {
    args.mainloop = {g.a, g.stride_a, g.b, g.stride_b, g.sfa, g.layout_sfa, g.sfb, g.layout_sfb};
  } else {
    args.mainloop = {g.a, g.stride_a, g.b, g.stride_b};
  }
  args.epilogue.ptr_C = nullptr;
  args.epilogue.dC = g.stride_d;
  args.epilogue.ptr_D = g.d;
  args.epilogue.dD = g.stride_d;
  args.epilogue.thread.alpha = 1.0f;
  args.epilogue.thread.beta = 0.0f;
  args.hw_info.device_id = 0;
  args.hw_info.sm_count = sm_count;
  using RO = decltype(args.scheduler.raster_order);
  args.scheduler.raster_order = tune.raster == Raster::kAlongN ? RO::AlongN
                                : tune.raster == Raster::kHeuristic ? RO::Heuristic : RO::AlongM;
  args.scheduler.max_swizzle_size = tune.swizzle;
  return args;
}

// CUTLASS's part of the workspace (first, rounded to 256 bytes); the group arrays follow it.
template <class Cfg>
size_t cutlass_part_bytes(const GroupedGemmParams& p, int sm_count, const Tuning& tune) {
  GroupArrays<Cfg> g{};
  auto args = make_arguments<Cfg>(p, g, sm_count, tune);
  return (Cfg::Gemm::get_workspace_size(args) + 255) / 256 * 256;
}

template <class Cfg>
size_t config_workspace_bytes(const GroupedGemmParams& p, int sm_count, const Tuning& tune) {
  return cutlass_part_bytes<Cfg>(p, sm_count, tune) + GroupArrays<Cfg>::bytes(p.num_groups);
}

// The setup kernel and the grouped GEMM on `stream`, the workspace checked by run_config below
// (cutlass_bytes: CUTLASS's part of it, rounded to 256; the group arrays follow).
template <class Cfg>
cudaError_t enqueue_config(const GroupedGemmParams& p, int sm_count, const Tuning& tune, size_t cutlass_bytes,
                           cudaStream_t stream) {
  char* ws = static_cast<char*>(p.workspace);
  auto g = GroupArrays<Cfg>::carve(ws + cutlass_bytes, p.num_groups);
  const int64_t total_rows = p.mode == Mode::kWgrad ? p.num_groups * p.n : output_rows(p);
  // Zeroing blocks (1,024 rows at decode, most with nothing to do, cost ~6 us).
  const unsigned zero_blocks = zeroing_blocks(total_rows, sm_count);
  prepare_groups<Cfg><<<1 + zero_blocks, kSetupThreads, 0, stream>>>(p, g);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  if (p.num_groups == 0 || p.n == 0) return cudaSuccess;
  auto args = make_arguments<Cfg>(p, g, sm_count, tune);
  typename Cfg::Gemm gemm;
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) return cudaErrorNotSupported;
  if (gemm.initialize(args, ws, stream) != cutlass::Status::kSuccess) return cudaErrorLaunchFailure;
  if (gemm.run(stream) != cutlass::Status::kSuccess) return cudaErrorLaunchFailure;
  return cudaGetLastError();
}

// The launch: the workspace's size is computed once, here (config_workspace_bytes' sum), and checked.
template <class Cfg>
LaunchStatus run_config(const GroupedGemmParams& p, int sm_count, const Tuning& tune, cudaStream_t stream) {
  const size_t cutlass_bytes = cutlass_part_bytes<Cfg>(p, sm_count, tune);
  LaunchStatus st;
  st.workspace_needed = cutlass_bytes + GroupArrays<Cfg>::bytes(p.num_groups);
  if (st.workspace_short(p)) {
    st.error = cudaErrorInvalidValue;
    return st;
  }
  st.error = enqueue_config<Cfg>(p, sm_count, tune, cutlass_bytes, stream);
  return st;
}

// What a dtype file's with_config hands the configuration it picks (as a null Cfg*): its workspace
// size, or its launch.
struct WorkspaceOf {
  const GroupedGemmParams& p;
  int sm_count;
  const Tuning& tune;
  template <class Cfg>
  size_t operator()(Cfg*) const { return config_workspace_bytes<Cfg>(p, sm_count, tune); }
};

struct LaunchOf {
  const GroupedGemmParams& p;
  int sm_count;
  const Tuning& tune;
  cudaStream_t stream;
  template <class Cfg>
  LaunchStatus operator()(Cfg*) const { return run_config<Cfg>(p, sm_count, tune, stream); }
};

}  // namespace a2a::gemm::detail
