// nvshmem combine recv: every block counts the rows each expert rank owes us (our routed pairs;
// the whole tp group's, since every member gets every row), waits until c_rows reaches them (a
// first load at entry; polling only when it fell short) and reduces its share of each token's
// pairs in f32 with the router weights (plus `out`); the last block to finish frees our combine
// region. No grid-wide barrier. Elastic EP: masked expert ranks are not waited for (our pairs to
// them were stopped: none owe us rows), their `seen` counter stays, and they get no FREE; when we
// are masked ourselves we wait for nobody and the communicator replaces our output
// (nvshmem/device.cuh).
#include "gpu/elems.cuh"
#include "gpu/failure.cuh"
#include "gpu/grid.cuh"
#include "gpu/kernel.cuh"
#include "gpu/reduce.cuh"
#include "nvshmem/device.cuh"
#include "nvshmem/kernels.h"

namespace a2a::nvshmem {
namespace {

__global__ void __launch_bounds__(gpu::kThreads) combine_recv_kernel(gpu::CombineRecvParams P, NvSlot nv) {
  A2A_KERNEL_START(P);
  // Our pairs' dest (the count below) and the reduction's dest / slot / weight into L1 while the
  // token count and the failure word load, so that the count's loads do not add a third latency.
  for (int64_t q = threadIdx.x, i = 0; i < 4 && q < int64_t(g.T) * g.K; ++i, q += blockDim.x)
    gpu::ptx::prefetch_l1(P.dest + q);
  gpu::prefetch_reduce_meta(P, ix);
  const int32_t num_tokens = *P.num_tokens;
  // Threads r < N read c_rows[r] once at entry (acquire, issued beside the token count): when the
  // rows landed before the launch (every expert rank's combine_send done) that load is the whole
  // wait, and its latency overlaps the count instead of following it. Only a rank found short is
  // polled again (wait_signals). The threads that hold these loads do not count (their later
  // loads stay behind the acquire).
  Signals* mine = signals_at(P.p, me);
  uint64_t first = 0;
  if (threadIdx.x < g.N) first = gpu::ptx::ld_acquire_sys(&mine->c_rows[threadIdx.x]);
  const int n = max(0, min(num_tokens, g.T));

  if (gpu::slot_failed(g, P.p)) {  // an earlier op of this slot failed: the host raises it
    gpu::poison_combine_recv(P, ix);
    return;
  }
  // Every block counts the rows each expert rank owes us (warps past those of threads < N; one
  // shared atomic per rank and 32 pairs, not per pair) and waits for them.
  __shared__ int expect[kMaxRanks];
  __shared__ int fell_short;  // some rank's entry load of c_rows was below its due
  if (threadIdx.x < g.N) expect[threadIdx.x] = 0;
  if (threadIdx.x == 0) fell_short = 0;
  __syncthreads();
  const int counters = (g.N + 31) / 32 * 32;  // first counting thread (warp-aligned; blockDim > 2 * 32)
  if (static_cast<int>(threadIdx.x) >= counters) {
    const int64_t pairs = int64_t(n) * g.K;
    for (int64_t q0 = threadIdx.x - ix.lane - counters; q0 < pairs; q0 += blockDim.x - counters) {  // warp-uniform
      const int64_t q = q0 + ix.lane;
      const int d = q < pairs ? P.dest[q] : -1;
      const bool ok = d >= 0 && d < g.N;
      const unsigned same = __match_any_sync(0xffffffffu, ok ? d : -1);
      if (ok && ix.lane == __ffs(same) - 1) atomicAdd(&expect[d], __popc(same));
    }
  }
  __syncthreads();
  uint64_t* consumed = seen(P.p, nv.lay, 1, g);  // advanced by the last block, after every block waited
  const uint64_t out = masked_ranks(g, P.p);  // elastic EP: owe us nothing
  const auto rows_due = [&](int r) { return consumed[r] + static_cast<uint64_t>(expect[r]); };
  if (threadIdx.x < g.N && !left_out(out, threadIdx.x) && first < rows_due(threadIdx.x)) fell_short = 1;
  __syncthreads();  // also orders every thread's row loads after the entry acquires that sufficed
  if (fell_short && !wait_signals(P.p, g, Half::kCombineRecv, [&](int r) { return &mine->c_rows[r]; },
                                  [&](int r) { return left_out(out, r) ? 0 : rows_due(r); }, blockIdx.x == 0)) {
    gpu::poison_combine_recv(P, ix);
    return;
  }
  const int64_t stride = int64_t(g.H) * elem_bytes(P.y_kind);
  const uint8_t* region = P.p.peer_shared[me] + nv.lay.off_c_rows;  // [tp][Q][stride]
  gpu::reduce_combine(P, n, ix, [&](int t, int, int32_t slot) {
    return region + (int64_t(t % g.tp) * g.Q + slot) * stride;  // slot: the pair's row in its member's part
  });
  if (!gpu::last_block_done(ep->done_of(Half::kCombineRecv))) return;
  if (!counters_in_step(P.p, g, Half::kCombineRecv, out, [&](int r) { return &mine->c_rows[r]; }, rows_due)) {
    gpu::poison_combine_recv(P, whole_grid_in_block());  // every block's outputs: they are done
    return;
  }
  if (threadIdx.x < g.N && !left_out(out, threadIdx.x)) {
    const int r = threadIdx.x;  // expert ranks may overwrite our combine region now
    consumed[r] = rows_due(r);
    nvshmemx_signal_op(&signals_at(P.p, r)->c_free[me], epoch + 1, NVSHMEM_SIGNAL_SET, nv.pe[r]);
  }
}

}  // namespace

cudaError_t launch_combine_recv(const gpu::CombineRecvParams& p, const NvSlot& nv, int blocks, cudaStream_t stream) {
  return gpu::launch_plain(combine_recv_kernel, blocks, 0, stream, p, nv);
}

}  // namespace a2a::nvshmem
