// combine send: put each received row's expert output back at its source, at the row the source
// chose (its combine region part for the source's member, from the source's offset for us in
// recv_counts [N, L + 1], plus the row's slot), for every member of the source's tp group; zeros for rows the capacity rule
// dropped. Every block derives the arrangement in its own shared memory (gpu/arrange.cuh; from
// recv_counts, which needs no peer), then waits until the sources freed our previous rows and
// copies its share of (row, segment) items; the last block to finish raises each rank's combine
// arrival flag. No grid-wide barrier.
#include "cuda/device.cuh"
#include "cuda/kernels.h"
#include "cuda/remote.cuh"
#include "gpu/arrange.cuh"
#include "gpu/copy.cuh"
#include "gpu/elems.cuh"
#include "gpu/failure.cuh"
#include "gpu/grid.cuh"
#include "gpu/kernel.cuh"

namespace a2a::cuda {
using namespace ::a2a::gpu;  // the shared device library (cc/gpu)
namespace {

__global__ void __launch_bounds__(kThreads) combine_send_kernel(CombineSendParams P) {
  extern __shared__ int32_t smem[];
  A2A_KERNEL_START(P);
  const int lane = ix.lane;
  SyncFlags* mine = flags_of(P.p, me);

  if (slot_failed(g, P.p)) return;  // an op of this slot failed: the host raises it
  // The arrangement needs only recv_counts (ours, ready at entry), so it is built before the wait
  // for the sources to free our previous rows; their flags are read once first (threads < N,
  // acquire) and the full wait runs only when one was not yet set (and always with remote peers,
  // whose proxy flag it also waits for).
  const uint64_t out = masked_ranks(g, P.p);  // elastic EP: ranks we neither wait for nor write to
  const FreeDue due = free_due(g, P.p, Half::kCombineSend, epoch);  // ... and the FREE flag the others owe us
  const bool free_now = !remote::any(P.p) && free_set_now(g, [&](int r) { return &mine->c_free[r]; }, due, out);
  const int cs = counts_stride(g);
  const BlockArrangement a = block_arrange(g, [&](int s, int l) { return P.recv_counts[s * cs + l]; }, smem);
  if (!__syncthreads_and(free_now) &&
      !remote::wait_peers_due(P.p, g, Half::kCombineSend, [&](int r) { return &mine->c_free[r]; }, due, &P.p.remote.ctrl->c_send_ok,
                              epoch + 1, blockIdx.x == 0, out))
    return;
  const int ybytes = elem_bytes(P.y_kind);
  const int64_t stride = int64_t(g.H) * ybytes;
  if (blockIdx.x == 0 && remote::any(P.p)) {  // what the proxy needs to write our rows back
    for (int s = threadIdx.x; s < g.N; s += blockDim.x)
      P.p.remote.ctrl->rows_from[s] = a.row_base[s + 1] - a.row_base[s];
    if (threadIdx.x == 0) {
      P.p.remote.ctrl->c_stride = stride;
      P.p.remote.ctrl->c_from_slot = P.from_slot;  // the proxy writes our rows at that dispatch's offsets
    }
  }
  const int32_t total = a.row_base[g.N];
  const int64_t seg = row_segment_bytes(stride, total, ix.nwarps);
  const int64_t nseg = (stride + seg - 1) / seg;
  for (int64_t w = ix.gwarp; w < int64_t(total) * nseg; w += ix.nwarps) {  // (row, segment) items
    const RowLoc r = locate_row(g, a, static_cast<int32_t>(w / nseg));
    const int64_t lo = (w % nseg) * seg, bytes = min(seg, stride - lo);
    const int g0 = r.s / g.tp * g.tp;
    const bool to_proxy = remote::group_has_remote(P.p, g, r.s);  // once into c_send [s][P][stride]
    for (int m = g0; m < g0 + g.tp + (to_proxy ? 1 : 0); ++m) {  // every member of the source's group gets the row
      if (m < g0 + g.tp && (remote::is_remote(P.p, m) || left_out(out, m))) continue;
      uint8_t* dst = m == g0 + g.tp
                         ? P.p.remote.c_send + (int64_t(r.s) * g.P + r.j) * stride
                         : P.p.peer_shared[m] + g.off_c_rows +
                               (int64_t(r.s % g.tp) * g.Q + P.recv_counts[r.s * cs + g.L] + r.j) * stride;
      if (r.pos >= 0)
        warp_copy(dst + lo, static_cast<const uint8_t*>(P.y) + r.pos * stride + lo, bytes, lane);
      else
        warp_zero(dst + lo, bytes, lane);
    }
  }
  if (remote::any(P.p)) __threadfence_system();  // our rows in c_send, before the proxy's flag
  if (last_block_done(ep->done_of(Half::kCombineSend))) {
    owe_free(g, P.p, Half::kCombineSend, due, out);
    remote::close_send(P.p, g, &P.p.remote.ctrl->c_packed, [&](int r) { return &flags_of(P.p, r)->c_arrived[me]; },
                       &ep->c_send, epoch, P.handle, out);
  }
}

}  // namespace

cudaError_t launch_combine_send(const CombineSendParams& p, int blocks, cudaStream_t stream) {
  return launch_plain(combine_send_kernel, blocks, arrangement_smem_bytes(p.g.N, p.g.L), stream, p);
}

void combine_send_kernels(const Geometry& g, std::vector<KernelRef>* out) {
  out->push_back({"combine_send", reinterpret_cast<const void*>(&combine_send_kernel),
                  static_cast<size_t>(arrangement_smem_bytes(g.N, g.L)), kThreads, false});
}

}  // namespace a2a::cuda
