// The steps both block-routed dispatch_send kernels of the cuda backend share around their
// staging (send_regs.cu: the token in registers; send_block.cu: in shared memory): the routing
// and its small outputs, the wait for the peers to free our previous rows, and the close (our
// count column into every peer; the last block raises the arrival flags). Every peer is
// node-local here (use_block_routing), so no proxy flag is involved.
#pragma once

#include "cuda/device.cuh"
#include "cuda/remote.cuh"
#include "gpu/block_route.cuh"
#include "gpu/failure.cuh"
#include "gpu/grid.cuh"
#include "gpu/params.h"

namespace a2a::cuda {

// Every thread of the block: routes tokens t < n in shared memory (block_route), writes its share
// of dest / pair_slot (and block 0 the drop count), then waits until every peer not in `skip`
// has finished reading the rows we last wrote it (its FREE flag up to due(r)), unless `free_now`
// (the caller read every free flag set at entry) held in every thread. False when the wait timed
// out: the outputs are abandoned and the caller returns.
__device__ inline bool block_route_and_wait(const DispatchSendParams& P, int n, const BlockRoute& rt, bool free_now,
                                            const GridIdx& ix, const FreeDue& due, uint64_t skip) {
  const Geometry& g = P.g;
  const int me = P.p.rank;
  const BlockRouteResult routed = block_route(P, n, rt, free_now);
  write_route_outputs(P, rt, ix);
  if (blockIdx.x == 0 && threadIdx.x == 0) *P.dropped = routed.dropped;
  if (routed.all ||
      wait_flags_due(P.p, g, 0, [&](int r) { return &flags_of(P.p, me)->d_free[r]; }, due, blockIdx.x == 0, skip))
    return true;
  abandon_dispatch_send(P, ix);
  return false;
}

// Every thread of the block, after its rows: block 0 writes our counts record into every peer
// (counts[me][l] = rows we send it for local expert l, counts[me][L] = rows we send ranks below
// it); the last block to finish records the FREE flags owed to the next dispatch (owe_free),
// raises each peer's arrival flag, advances the slot's epoch and writes the handle.
__device__ inline void close_block_send(const DispatchSendParams& P, const BlockRoute& rt, Epochs* ep, uint64_t epoch,
                                        const FreeDue& due, uint64_t out) {
  const Geometry& g = P.g;
  const int me = P.p.rank, cs = counts_stride(g);
  if (blockIdx.x == 0)
    for (int i = threadIdx.x; i < g.N * cs; i += blockDim.x) {
      const int d = i / cs, l = i % cs;
      if (left_out(out, d)) continue;  // elastic EP: masked
      reinterpret_cast<int32_t*>(P.p.peer_shared[d] + g.off_counts)[int64_t(me) * cs + l] =
          l < g.L ? rt.cnt[d * g.L + l] : rt.start[d * g.L];
    }
  if (last_block_done(&ep->done[0])) {
    owe_free(g, P.p, 0, due, out);
    remote::close_send(P.p, g, nullptr, [&](int r) { return &flags_of(P.p, r)->d_arrived[me]; }, &ep->d_send, epoch,
                       P.handle, out);
  }
}

}  // namespace a2a::cuda
