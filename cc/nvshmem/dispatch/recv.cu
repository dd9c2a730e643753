// nvshmem dispatch recv: every block waits for every source's meta block (d_meta), lays out the
// arrangement from its counts in shared memory (gpu/arrange.cuh), waits until every source's rows
// have landed (d_rows reaches what we consumed before plus the rows it announced) and copies its
// share of the rows out canonically (local expert, source, token; capacity rule); the last block
// to finish tells every source its region is free (d_free). No grid-wide barrier. Elastic EP: a
// masked source is not waited for, its stale meta block reads as zeros (no rows, combine offset
// 0), its `seen` counter stays (it put nothing) and it gets no FREE (nvshmem/device.cuh).
#include "gpu/failure.cuh"
#include "gpu/grid.cuh"
#include "gpu/kernel.cuh"
#include "gpu/recv_rows.cuh"
#include "nvshmem/device.cuh"
#include "nvshmem/kernels.h"

namespace a2a::nvshmem {
namespace {

__global__ void __launch_bounds__(gpu::kThreads) dispatch_recv_kernel(gpu::DispatchRecvParams P, NvSlot nv) {
  extern __shared__ int32_t smem[];
  A2A_KERNEL_START(P);
  const bool report = blockIdx.x == 0;
  Signals* mine = signals_at(P.p, me);
  uint64_t* consumed = seen(P.p, nv.lay, 0, g);  // advanced by the last block, after every block waited
  const uint64_t out = masked_ranks(g, P.p);  // elastic EP: sent us nothing; their meta blocks are stale
  const auto head = [&](int s, int i) {       // word i of source s's meta header; 0 for a masked source
    return left_out(out, s) ? 0 : reinterpret_cast<const volatile int32_t*>(meta_at(P.p, nv.lay, me, s))[i];
  };

  if (gpu::slot_failed(g, P.p) ||
      !wait_signals(P.p, g, Half::kDispatchRecv, [&](int r) { return &mine->d_meta[r]; },
                    [&](int r) { return left_out(out, r) ? 0 : epoch + 1; }, report)) {
    gpu::abandon_dispatch_recv(P, ix);  // an op of this slot failed: the host raises it
    return;
  }
  const gpu::BlockArrangement a = gpu::block_arrange(g, head, smem);
  // seen plus the rows source r announced (0 from a masked one): what d_rows[r] reaches
  const auto rows_due = [&](int r) { return consumed[r] + static_cast<uint64_t>(a.row_base[r + 1] - a.row_base[r]); };
  if (!wait_signals(P.p, g, Half::kDispatchRecv, [&](int r) { return &mine->d_rows[r]; },
                    [&](int r) { return left_out(out, r) ? 0 : rows_due(r); }, report)) {
    gpu::abandon_dispatch_recv(P, ix);
    return;
  }
  gpu::write_recv_outputs(P, a, ix, [&](int s) { return head(s, g.L); });
  gpu::copy_received_rows(
      P, a, ix, [&](int s, int32_t j) { return P.p.peer_shared[me] + nv.lay.off_rows + (int64_t(s) * g.P + j) * g.row; },
      [&](int s, int32_t j, const uint8_t*, int32_t* tok, float* wt) {
        const int32_t* m = meta_at(P.p, nv.lay, me, s) + meta_head_words(g) + 2 * int64_t(j);
        *tok = m[0];
        *wt = __int_as_float(m[1]);
      });
  if (!gpu::last_block_done(ep->done_of(Half::kDispatchRecv))) return;
  if (!counters_in_step(P.p, g, Half::kDispatchRecv, out, [&](int r) { return &mine->d_rows[r]; }, rows_due)) {
    gpu::abandon_dispatch_recv(P, whole_grid_in_block());  // every block's outputs: they are done
    return;
  }
  if (threadIdx.x < g.N && !left_out(out, threadIdx.x)) {
    const int r = threadIdx.x;  // sources may overwrite their rows and meta now
    consumed[r] = rows_due(r);
    nvshmemx_signal_op(&signals_at(P.p, r)->d_free[me], epoch + 1, NVSHMEM_SIGNAL_SET, nv.pe[r]);
  }
}

}  // namespace

cudaError_t launch_dispatch_recv(const gpu::DispatchRecvParams& p, const NvSlot& nv, int blocks, cudaStream_t stream) {
  return gpu::launch_plain(dispatch_recv_kernel, blocks, gpu::arrangement_smem_bytes(p.g.N, p.g.L), stream, p, nv);
}

}  // namespace a2a::nvshmem
