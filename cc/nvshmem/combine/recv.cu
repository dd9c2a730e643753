// nvshmem combine recv: every block waits until each expert rank's c_rows counter reaches the
// rows it owes us (dispatch_send counted them: its dest_counts output, our routed pairs of the
// whole tp group, since every member gets every row; one load per rank at entry, beside the first
// load of c_rows and the token count; polling only when that first load fell short) and reduces
// its share of each token's pairs in f32 with the router weights (plus `out`); the last block to
// finish frees our combine region. No grid-wide barrier. The counts come with dest and pair_slot
// (the dispatch's placement), not from the slot, so a combine on another slot than its dispatch
// waits for the same rows. Elastic EP: masked expert ranks are not waited for (our pairs to them
// were stopped: none owe us rows), their `seen` counter stays, and they get no FREE; when we are
// masked ourselves we wait for nobody and the communicator replaces our output
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
  gpu::prefetch_reduce_meta(P, ix);  // the reduction's dest / slot / weight into L1 during the wait
  const int32_t num_tokens = *P.num_tokens;
  // Threads r < N: the rows expert rank r owes us in all (those consumed from it over earlier
  // epochs, plus this combine's from dest_counts), then c_rows[r] once (acquire), all issued beside
  // the token count: when the rows landed before the launch (every expert rank's combine_send
  // done) that load is the whole wait. Only a rank found short is polled again (wait_signals).
  // The plain loads come first: a load after the acquire would wait for it.
  Signals* mine = signals_at(P.p, me);
  uint64_t* consumed = seen(P.p, nv.lay, 1, g);  // advanced by the last block, after all waited
  __shared__ uint64_t due[kMaxRanks];              // consumed[r] + this combine's rows from rank r
  uint64_t first = 0;
  if (threadIdx.x < g.N) {
    const int r = threadIdx.x;
    const uint64_t before = consumed[r];
    const int32_t now = P.dest_counts[r];
    first = gpu::ptx::ld_acquire_sys(&mine->c_rows[r]);
    due[r] = before + static_cast<uint64_t>(now);
  }
  const int n = max(0, min(num_tokens, g.T));

  if (gpu::slot_failed(g, P.p)) {  // an earlier op of this slot failed: the host raises it
    gpu::poison_combine_recv(P, ix);
    return;
  }
  const uint64_t out = masked_ranks(g, P.p);  // elastic EP: owe us nothing
  const auto rows_due = [&](int r) { return due[r]; };
  // One barrier: due[] visible to the block, whether some rank's entry load fell short of its due,
  // and every thread's row loads ordered after the entry acquires that sufficed.
  const bool fell_short =
      __syncthreads_or(threadIdx.x < g.N && !left_out(out, threadIdx.x) && first < rows_due(threadIdx.x));
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
