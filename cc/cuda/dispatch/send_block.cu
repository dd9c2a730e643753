// dispatch send, block-routed, the token staged in shared memory: the general case of the
// block-routed kernels (tp_size 1, K <= 16, the routing tables and one wire
// row fit in shared memory: decode batches) for the dtypes, sizes and alignments that
// cuda/dispatch/send_regs.cu does not take. No grid-wide barrier: every block routes all T*K
// pairs itself (gpu/block_route.cuh), then quantises / converts its tokens one at a time into a
// shared-memory wire row and writes that row straight to every destination of the token (no
// global staging). The last block to finish raises the arrival flags.
#include "cuda/device.cuh"
#include "cuda/dispatch/block_send.cuh"
#include "cuda/kernels.h"
#include "gpu/arrange.cuh"
#include "gpu/block_route.cuh"
#include "gpu/copy.cuh"
#include "gpu/failure.cuh"
#include "gpu/grid.cuh"
#include "gpu/kernel.cuh"
#include "gpu/route.cuh"

namespace a2a::cuda {
using namespace ::a2a::gpu;  // the shared device library (cc/gpu)
namespace {

// The calling warp copies `bytes` bytes from shared memory (16-byte aligned) to global `dst`:
// 16-byte stores when dst is 16-byte aligned, bytes otherwise.
__device__ __forceinline__ void warp_copy_from_shared(uint8_t* dst, const uint8_t* src, int64_t bytes, int lane) {
  if (!aligned16(dst)) {
    for (int64_t i = lane; i < bytes; i += 32) dst[i] = src[i];
    return;
  }
  const int64_t nv = bytes / 16;
  const int4* s4 = reinterpret_cast<const int4*>(src);
  int4* d4 = reinterpret_cast<int4*>(dst);
  for (int64_t i = lane; i < nv; i += 32) d4[i] = s4[i];
  for (int64_t i = nv * 16 + lane; i < bytes; i += 32) dst[i] = src[i];
}

__global__ void __launch_bounds__(kThreads) dispatch_send_block_kernel(DispatchSendParams P) {
  extern __shared__ __align__(16) uint8_t smem[];
  A2A_KERNEL_START(P);
  const int lane = ix.lane, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const int n = max(0, min(*P.num_tokens, g.T));
  const BlockRouteSmem lay(g, g.row);
  const BlockRoute rt(smem, lay, g.L);
  uint8_t* row = smem + lay.off_tail;  // one token's wire row
  if (slot_failed(g, P.p)) {  // an earlier op of this slot failed: the host raises it
    abandon_dispatch_send(P, ix);
    return;
  }

  // 1. Routing in shared memory (gpu/block_route.cuh), dest, pair_slot, drops; 2. peers must
  // have finished reading our previous rows before we overwrite them (always the full wait).
  const uint64_t out = masked_ranks(g, P.p);  // elastic EP: ranks we neither wait for nor write to
  const FreeDue due = free_due(g, P.p, Half::kDispatchSend, epoch);  // ... and the FREE flag the others owe us
  if (!block_route_and_wait(P, n, rt, false, ix, due, out, epoch)) return;

  // 3. Our tokens, one at a time: wire row in shared memory, then to each destination.
  const int64_t body = g.payload + 4 * int64_t(g.S);  // payload then fp8 scales
  const int64_t body16 = body / 16 * 16;
  const int64_t seg = row_segment_bytes(body16, g.K, nwarps);
  const int64_t nseg = body16 > 0 ? (body16 + seg - 1) / seg : 1;
  const StageWorkers wk{lane, warp, nwarps, threadIdx.x, blockDim.x};
  for (int t = blockIdx.x; t < n; t += gridDim.x) {
    stage_rows(P, 1, [&](int64_t) { return t; }, [&](int) { return row; }, wk);
    __syncthreads();
    for (int64_t w = warp; w < int64_t(g.K) * nseg; w += nwarps) {  // (pair, segment) items
      const int64_t q = int64_t(t) * g.K + w / nseg;
      const int e = rt.pe[q];
      if (e < 0) continue;
      const int d = e / g.L;
      uint8_t* dst = block_dest_row(P, d, rt.slot_of(t, e));
      const int64_t lo = (w % nseg) * seg;
      if (lo < body16) warp_copy_from_shared(dst + lo, row + lo, min(seg, body16 - lo), lane);
      if (lo != 0) continue;
      write_row_tail(dst, row, body, body16, t, P.weights[q], lane);
    }
    __syncthreads();  // the row is rewritten for the next token
  }

  // 4. Our counts column into every peer; the last block raises the arrival flags.
  close_block_send(P, rt, ep, epoch, due, out);
}

}  // namespace

int64_t block_routing_smem_bytes(const Geometry& g) { return BlockRouteSmem(g, g.row).bytes; }

cudaError_t launch_dispatch_send_block(const DispatchSendParams& p, int blocks, cudaStream_t stream) {
  return launch_plain(dispatch_send_block_kernel, blocks, static_cast<size_t>(block_routing_smem_bytes(p.g)), stream, p);
}

void dispatch_send_block_kernels(const Geometry& g, std::vector<KernelRef>* out) {
  out->push_back({"dispatch_send (block-routed, shared-memory staging)",
                  reinterpret_cast<const void*>(&dispatch_send_block_kernel),
                  static_cast<size_t>(block_routing_smem_bytes(g)), kThreads, false});
}

}  // namespace a2a::cuda
