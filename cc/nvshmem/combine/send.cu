// nvshmem combine send: put each received row's expert output back at its source, at the row
// the source chose (its offset for us from the meta block, via recv_counts [N, L + 1], plus the slot), for every member of the source's tp group (put-with-signal, +1 on
// c_rows[me] there); zeros for rows the capacity rule dropped. Every block waits for c_free and
// derives the arrangement in its own shared memory (gpu/arrange.cuh). No closing signal:
// receivers count rows. Elastic EP: masked members get no row (a masked source sent us none: its
// recv_counts are 0) and their c_free is not awaited; a live rank's is awaited for the last
// combine it took part in (FreeDue, gpu/mask.cuh, as the cuda backend's).
// Remote peers (NvSlot::remote): y is XLA's buffer, not symmetric, so a row for a remote member
// is first copied into the warp's bounce row (private, symmetric) and put from there with the
// blocking put (the bounce row is free again when it returns); node-local members get it from y.
// A dropped row needs no bounce: the zero row is symmetric already. Once a bounce row's puts
// returned, its L2 lines are discarded (discard_bounce).
#include <algorithm>
#include <cstdint>

#include "gpu/arrange.cuh"
#include "gpu/copy.cuh"
#include "gpu/elems.cuh"
#include "gpu/failure.cuh"
#include "gpu/grid.cuh"
#include "gpu/kernel.cuh"
#include "gpu/ptx.cuh"
#include "nvshmem/device.cuh"
#include "nvshmem/kernels.h"

namespace a2a::nvshmem {
namespace {

// A bounce row's puts have returned (blocking puts: the row may be reused), so its L2 lines are
// dead: drop them without a write-back (only lines wholly inside the row; a neighbour's row may
// share the others). Up to kBounceWarps rows of c_row bytes per slot (14.7 MB at decode) would
// otherwise stay dirty in L2 next to the rows the peers put into our combine region, which our
// combine_recv reads next, and be written back to memory for nothing.
__device__ __forceinline__ void discard_bounce(uint8_t* row, int64_t bytes, int lane) {
  const uintptr_t lo = (reinterpret_cast<uintptr_t>(row) + 127) & ~uintptr_t(127);
  const uintptr_t hi = (reinterpret_cast<uintptr_t>(row) + static_cast<uintptr_t>(bytes)) & ~uintptr_t(127);
  for (uintptr_t a = lo + uintptr_t(lane) * 128; a < hi; a += 32 * 128)
    gpu::ptx::discard_l2_line(reinterpret_cast<const void*>(a));
}

__global__ void __launch_bounds__(gpu::kThreads) combine_send_kernel(gpu::CombineSendParams P, NvSlot nv) {
  extern __shared__ int32_t smem[];
  A2A_KERNEL_START(P);

  // Every source must have reduced the rows we last wrote it before we overwrite them; masked
  // ranks get nothing now (due(r): the epoch without a mask; owe_free rewrites it in the last
  // block, after every block waited).
  const uint64_t out = masked_ranks(g, P.p);
  const gpu::FreeDue due = gpu::free_due(g, P.p, Half::kCombineSend, epoch);
  if (gpu::slot_failed(g, P.p) ||
      !wait_signals(P.p, g, Half::kCombineSend, [&](int r) { return &signals_at(P.p, me)->c_free[r]; },
                    [&](int r) { return left_out(out, r) ? 0 : due(r); }, blockIdx.x == 0))
    return;  // an op of this slot failed: the host raises it
  const gpu::BlockArrangement a =
      gpu::block_arrange(g, [&](int s, int l) { return P.recv_counts[s * gpu::counts_stride(g) + l]; }, smem);
  const int64_t stride = int64_t(g.H) * elem_bytes(P.y_kind);
  const uint8_t* zero = P.p.priv + nv.lay.off_zero;  // [H * 4] zeros, never written
  for (int64_t w = ix.gwarp; w < a.row_base[g.N]; w += ix.nwarps) {  // warp per received row
    const gpu::RowLoc r = gpu::locate_row(g, a, static_cast<int32_t>(w));
    const uint8_t* src = r.pos >= 0 ? static_cast<const uint8_t*>(P.y) + r.pos * stride : zero;
    const int g0 = r.s / g.tp * g.tp;
    const uint64_t group = (g.tp == 64 ? ~0ull : ((1ull << g.tp) - 1)) << g0;
    // What remote members' puts read: src itself when it is symmetric (the zero row of a dropped
    // row), else the row copied into this warp's bounce row, when some remote member needs it.
    const uint8_t* remote_src = src;
    uint8_t* bounced = nullptr;  // our bounce row, when it holds this row: free it before the next
    if (r.pos >= 0 && (nv.remote & group & ~out)) {
      uint8_t* b = nv.bounce + P.p.slot * nv.lay.bounce_slot_bytes + int64_t(ix.gwarp) * stride;  // gwarp < kBounceWarps
      gpu::warp_copy(b, src, stride, ix.lane);
      __syncwarp();
      __threadfence();  // the row is in GPU memory before a transport (or its NIC) reads it
      remote_src = b;
      bounced = b;
    }
    for (int m = g0; m < g0 + g.tp; ++m) {
      if (left_out(out, m)) continue;  // elastic EP: a masked member of the source's group
      uint8_t* dst = P.p.peer_shared[m] + nv.lay.off_c_rows +
                     (int64_t(r.s % g.tp) * g.Q + P.recv_counts[r.s * gpu::counts_stride(g) + g.L] + r.j) * stride;
      if ((nv.remote >> m) & 1)
        nvshmemx_putmem_signal_warp(dst, remote_src, static_cast<size_t>(stride), &signals_at(P.p, m)->c_rows[me], 1,
                                    NVSHMEM_SIGNAL_ADD, nv.pe[m]);
      else
        put_row_signal(dst, src, stride, &signals_at(P.p, m)->c_rows[me], nv.pe[m]);
    }
    if (bounced) {
      __syncwarp();  // every lane's put returned before the next row overwrites it
      discard_bounce(bounced, stride, ix.lane);
    }
  }
  if (!gpu::last_block_done(ep->done_of(Half::kCombineSend))) return;
  gpu::owe_free(g, P.p, Half::kCombineSend, due, out);  // every live rank frees this epoch for us
  if (threadIdx.x == 0) {
    ep->c_send = epoch + 1;
    P.handle[0] = static_cast<int32_t>(epoch);
    P.handle[1] = P.p.slot;
  }
}

}  // namespace

cudaError_t launch_combine_send(const gpu::CombineSendParams& p, const NvSlot& nv, int blocks, cudaStream_t stream) {
  // With remote peers every warp owns one bounce row: at most kBounceWarps warps.
  if (nv.remote) blocks = std::min(blocks, kBounceWarps / (gpu::kThreads / 32));
  return gpu::launch_plain(combine_send_kernel, blocks, gpu::arrangement_smem_bytes(p.g.N, p.g.L), stream, p, nv);
}

}  // namespace a2a::nvshmem
