// nvshmem combine recv: every block counts the rows each expert rank owes us (our routed pairs;
// the whole tp group's, since every member gets every row), waits until c_rows reaches them and
// reduces its share of each token's pairs in f32 with the router weights (plus `out`); the last
// block to finish frees our combine region. No grid-wide barrier. Elastic EP: masked expert
// ranks are not waited for (our pairs to them were stopped: none owe us rows), their `seen`
// counter stays, and they get no FREE; when we are masked ourselves we wait for nobody and the
// communicator replaces our output (nvshmem/device.cuh).
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
  const int n = max(0, min(*P.num_tokens, g.T));

  if (gpu::slot_failed(g, P.p)) {  // an earlier op of this slot failed: the host raises it
    gpu::poison_combine_recv(P, ix);
    return;
  }
  // Every block counts the rows each expert rank owes us and waits for them.
  __shared__ int expect[kMaxRanks];
  if (threadIdx.x < g.N) expect[threadIdx.x] = 0;
  __syncthreads();
  for (int64_t q = threadIdx.x; q < int64_t(n) * g.K; q += blockDim.x) {
    const int d = P.dest[q];
    if (d >= 0 && d < g.N) atomicAdd(&expect[d], 1);
  }
  __syncthreads();
  uint64_t* consumed = seen(P.p, nv.lay, 1, g);  // advanced by the last block, after every block waited
  Signals* mine = signals_at(P.p, me);
  const uint64_t out = masked_ranks(g, P.p);  // elastic EP: owe us nothing
  const auto rows_due = [&](int r) { return consumed[r] + static_cast<uint64_t>(expect[r]); };
  if (!wait_signals(P.p, g, Half::kCombineRecv, [&](int r) { return &mine->c_rows[r]; },
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
