// The steps both block-routed dispatch_send kernels of the cuda backend share around their
// staging (send_regs.cu: the token in registers; send_block.cu: in shared memory): the routing
// and its small outputs, the wait for the peers to free our previous rows, and the close (our
// count column into every peer; the last block raises the arrival flags). With peers on other
// nodes (the proxy path, tp_size 1) the same kernels pack those peers' rows into d_send for the
// proxy: every block also waits for d_send_ok, block 0 publishes our count matrix, the last block
// raises d_packed (cuda/remote.cuh).
#pragma once

#include "cuda/device.cuh"
#include "cuda/remote.cuh"
#include "gpu/block_route.cuh"
#include "gpu/failure.cuh"
#include "gpu/grid.cuh"
#include "gpu/params.h"

namespace a2a::cuda {
using namespace ::a2a::gpu;  // the shared device library (cc/gpu)

// Every thread of the block: routes tokens t < n in shared memory (block_route), writes its share
// of dest / pair_slot (and block 0 the drop count), then waits until every peer not in `skip`
// has finished reading the rows we last wrote it (its FREE flag up to due(r)), unless `free_now`
// (the caller read every free flag set at entry) held in every thread. With remote peers every
// block also waits until d_send is ours again (the proxy's d_send_ok > epoch), and block 0 then
// writes our count matrix for the proxy (remote::publish_counts: counts_send is reused too). False
// when a wait timed out: the outputs are abandoned and the caller returns.
__device__ inline bool block_route_and_wait(const DispatchSendParams& P, int n, const BlockRoute& rt, bool free_now,
                                            const GridIdx& ix, const FreeDue& due, uint64_t skip, uint64_t epoch) {
  const Geometry& g = P.g;
  const int me = P.p.rank;
  const BlockRouteResult routed = block_route(P, n, rt, free_now);
  write_route_outputs(P, rt, ix);
  if (blockIdx.x == 0 && threadIdx.x == 0) *P.dropped = routed.dropped;
  const bool remote = remote::any(P.p);
  if ((routed.all && !remote) ||
      remote::wait_peers_due(P.p, g, Half::kDispatchSend, [&](int r) { return &flags_of(P.p, me)->d_free[r]; }, due,
                             &P.p.remote.ctrl->d_send_ok, epoch + 1, blockIdx.x == 0, skip)) {
    if (remote && blockIdx.x == 0) remote::publish_counts(P.p, g, rt.cnt, epoch);
    return true;
  }
  abandon_dispatch_send(P, ix);
  return false;
}

// Where pair (t, e) of ours goes: its row at destination d = e / L, slot j (node-local: the
// peer's rows region [N][P][row] at our source index; remote: d_send [d][P][row] for the proxy).
__device__ __forceinline__ uint8_t* block_dest_row(const DispatchSendParams& P, int d, int64_t j) {
  const Geometry& g = P.g;
  if (remote::is_remote(P.p, d)) return remote::send_row(P.p, g, d, j);
  return P.p.peer_shared[d] + g.off_rows + (int64_t(P.p.rank) * g.P + j) * g.row;
}

// Every thread of the block, after its rows: block 0 writes our counts record into every
// node-local peer (counts[me][l] = rows we send it for local expert l, counts[me][L] = rows we
// send ranks below it; remote peers get our count matrix from the proxy); the last block to
// finish records the FREE flags owed to the next dispatch (owe_free), raises d_packed for the
// proxy (remote peers) and each node-local peer's arrival flag, advances the slot's epoch and
// writes the handle.
__device__ inline void close_block_send(const DispatchSendParams& P, const BlockRoute& rt, Epochs* ep, uint64_t epoch,
                                        const FreeDue& due, uint64_t out) {
  const Geometry& g = P.g;
  const int me = P.p.rank, cs = counts_stride(g);
  if (blockIdx.x == 0)
    for (int i = threadIdx.x; i < g.N * cs; i += blockDim.x) {
      const int d = i / cs, l = i % cs;
      if (left_out(out, d) || remote::is_remote(P.p, d)) continue;  // elastic EP: masked; remote: the proxy
      reinterpret_cast<int32_t*>(P.p.peer_shared[d] + g.off_counts)[int64_t(me) * cs + l] =
          l < g.L ? rt.cnt[d * g.L + l] : rt.start[d * g.L];
    }
  if (remote::any(P.p)) __threadfence_system();  // our rows in d_send, before the proxy's flag
  if (last_block_done(ep->done_of(Half::kDispatchSend))) {
    owe_free(g, P.p, Half::kDispatchSend, due, out);
    remote::close_send(P.p, g, &P.p.remote.ctrl->d_packed, [&](int r) { return &flags_of(P.p, r)->d_arrived[me]; },
                       &ep->d_send, epoch, P.handle, out);
  }
}

}  // namespace a2a::cuda
