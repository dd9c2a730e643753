// EP = 1 combine (gpu/local/local.h): combine_recv's reduction (gpu/reduce.cuh) reading each
// pair's expert output straight from y, where combine_send would have copied it into the combine
// region first. A pair's row in y is its canonical position (gpu/local/dispatch.cu): ragged row
// j = pair_slot, expert_major [l][j - start[l]] with l the local expert whose slots hold j (start:
// the exclusive prefix of recv_counts, built in each block's shared memory); a pair past the
// capacity has no row (0, as the exchange path's zero-filled row).
// Two blocks per SM with 16-byte lanes (the reduction's narrow shape, gpu/reduce.cuh): twice the
// warps, each with half the chain of loads; 2026-12-03, 16 layers a step: the kernel 5.2 against
// 5.6 µs at one block per SM with 32-byte lanes (the exchange's combine_recv, whose blocks first
// wait on flags, measured the opposite: 14.3 against 11.9 µs at N = 2).
#include "gpu/arrange.cuh"
#include "gpu/elems.cuh"
#include "gpu/grid.cuh"
#include "gpu/local/local.h"
#include "gpu/reduce.cuh"

namespace a2a::gpu {
namespace {

constexpr int kBlocksPerSm = 2;

__global__ void __launch_bounds__(kThreads, kBlocksPerSm) local_combine_kernel(LocalCombineParams P) {
  extern __shared__ int32_t start[];  // expert_major: [L] first slot of each local expert
  const CombineRecvParams& C = P.c;
  const Geometry& g = C.g;
  const GridIdx ix;
  prefetch_reduce_meta<true>(C, ix);
  if (!g.ragged()) {
    for (int l = threadIdx.x; l < g.L; l += blockDim.x) start[l] = P.recv_counts[l];
    __syncthreads();
    if (threadIdx.x < 32) warp_exclusive_scan(start, g.L, ix.lane);
    __syncthreads();
  }
  const int n = max(0, min(*C.num_tokens, g.T));
  const int64_t stride = int64_t(g.H) * elem_bytes(C.y_kind);
  const uint8_t* y = static_cast<const uint8_t*>(P.y);
  reduce_combine<true>(
      C, n, ix,
      [&](int, int, int32_t j) -> const uint8_t* {
        int64_t pos;
        if (g.ragged()) {
          pos = j < g.capacity ? int64_t(j) : -1;
        } else {
          int lo = 0, hi = g.L - 1;
          while (lo < hi) {  // last local expert whose first slot is <= j
            const int mid = (lo + hi + 1) / 2;
            if (start[mid] <= j) lo = mid; else hi = mid - 1;
          }
          const int32_t within = j - start[lo];
          pos = within < g.capacity ? int64_t(lo) * g.capacity + within : -1;
        }
        return pos >= 0 ? y + pos * stride : nullptr;
      },
      aligned16(P.y) && stride % 16 == 0);
}

}  // namespace

cudaError_t launch_local_combine(const LocalCombineParams& p, int blocks, cudaStream_t stream) {
  const size_t smem = !p.c.g.ragged() ? size_t(4) * p.c.g.L : 0;
  return launch_plain(local_combine_kernel, kBlocksPerSm * blocks, smem, stream, p);
}

}  // namespace a2a::gpu
