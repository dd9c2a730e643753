// dispatch send, block-routed variant (every peer node-local, tp_size 1, and the routing tables fit
// in shared memory: decode batches). No grid-wide barrier: every block routes all T*K pairs
// itself in shared memory (ids [T*K], a token bitmap per expert [E][ceil(T/32)], counts and first
// slots [E]), then quantises / converts its tokens one at a time into a shared-memory wire row and
// writes that row straight to every destination of the token (no global staging). A pair's slot
// is the same as in the grid-routed kernel (gpu/route.cuh): its expert's first slot within the
// destination plus the number of earlier tokens routed to that expert, so positions never depend
// on timing. The last block to finish raises the arrival flags.
#include "cuda/device.cuh"
#include "cuda/kernels.h"
#include "cuda/remote.cuh"
#include "gpu/arrange.cuh"
#include "gpu/copy.cuh"
#include "gpu/failure.cuh"
#include "gpu/grid.cuh"
#include "gpu/kernel.cuh"
#include "gpu/route.cuh"

namespace a2a::cuda {
namespace {

// Shared-memory layout of the block-routed kernel (bytes from the dynamic shared-memory base).
struct BlockRouteSmem {
  int64_t words;  // ceil(T / 32): bitmap words per expert
  int64_t off_ids, off_bits, off_cnt, off_start, off_row, bytes;
  __host__ __device__ explicit BlockRouteSmem(const Geometry& g) {
    words = (int64_t(g.T) + 31) / 32;
    off_ids = 0;                                              // [T*K] int32: expert of a routed pair, else -1
    off_bits = off_ids + pad16(4 * int64_t(g.T) * g.K);     // [E][words] uint32: tokens routed to e
    off_cnt = off_bits + pad16(4 * int64_t(g.E) * words);   // [E] int32: pairs per expert
    off_start = off_cnt + pad16(4 * int64_t(g.E));          // [E] int32: first slot of e within its dest
    off_row = off_start + pad16(4 * int64_t(g.E));          // [row] one token's wire row
    bytes = off_row + pad16(g.row);
  }
  __host__ __device__ static int64_t pad16(int64_t b) { return (b + 15) / 16 * 16; }
};

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
  const BlockRouteSmem lay(g);
  int32_t* pe = reinterpret_cast<int32_t*>(smem + lay.off_ids);
  uint32_t* bits = reinterpret_cast<uint32_t*>(smem + lay.off_bits);
  int32_t* cnt = reinterpret_cast<int32_t*>(smem + lay.off_cnt);
  int32_t* start = reinterpret_cast<int32_t*>(smem + lay.off_start);
  uint8_t* row = smem + lay.off_row;
  __shared__ int bad;
  if (slot_failed(g, P.p)) {  // an earlier op of this slot failed: the host raises it
    abandon_dispatch_send(P, ix);
    return;
  }

  // 1. Routing in shared memory: validity and dedup, token bitmaps per expert, counts, first slots.
  const int64_t tk = int64_t(g.T) * g.K;
  for (int64_t i = threadIdx.x; i < int64_t(g.E) * lay.words; i += blockDim.x) bits[i] = 0u;
  if (threadIdx.x == 0) bad = 0;
  __syncthreads();
  int mine_bad = 0;
  for (int64_t q = threadIdx.x; q < tk; q += blockDim.x) {
    const int t = static_cast<int>(q / g.K), k = static_cast<int>(q % g.K);
    const int32_t id = P.ids[q];
    bool routed = t < n && id >= 0 && id < g.E;
    for (int j = 0; routed && j < k; ++j) routed = P.ids[int64_t(t) * g.K + j] != id;
    pe[q] = routed ? id : -1;
    if (routed) atomicOr(&bits[int64_t(id) * lay.words + t / 32], 1u << (t % 32));
    mine_bad += !routed && t < n && id != -1;
  }
  for (int off = 16; off > 0; off >>= 1) mine_bad += __shfl_xor_sync(0xffffffffu, mine_bad, off);
  if (lane == 0 && mine_bad) atomicAdd(&bad, mine_bad);
  __syncthreads();
  for (int e = threadIdx.x; e < g.E; e += blockDim.x) {
    int c = 0;
    for (int64_t w = 0; w < lay.words; ++w) c += __popc(bits[int64_t(e) * lay.words + w]);
    cnt[e] = c;
    start[e] = c;
  }
  __syncthreads();
  for (int d = warp; d < g.N; d += nwarps) warp_exclusive_scan(start + int64_t(d) * g.L, g.L, lane);
  __syncthreads();
  // slot of routed pair (t, e): e's first slot in its dest + earlier tokens routed to e
  const auto slot_of = [&](int t, int e) {
    const uint32_t* b = bits + int64_t(e) * lay.words;
    int before = __popc(b[t / 32] & ((1u << (t % 32)) - 1u));
    for (int w = 0; w < t / 32; ++w) before += __popc(b[w]);
    return start[e] + before;
  };

  // 2. Small outputs, grid-wide: dest and pair_slot of every pair; the drop count (block 0).
  for (int64_t q = ix.gtid; q < tk; q += ix.gstride) {
    const int e = pe[q];
    P.dest[q] = e >= 0 ? e / g.L : g.N;
    P.pair_slot[q] = e >= 0 ? slot_of(static_cast<int>(q / g.K), e) : 0;
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) *P.dropped = bad;

  // 3. Peers must have finished reading our previous rows before we overwrite them.
  if (!wait_flags(P.p, g, 0, [&](int r) { return &flags_of(P.p, me)->d_free[r]; }, epoch, blockIdx.x == 0)) {
    abandon_dispatch_send(P, ix);
    return;
  }

  // 4. Our tokens, one at a time: wire row in shared memory, then to each destination.
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
      const int e = pe[q];
      if (e < 0) continue;
      const int d = e / g.L;
      uint8_t* dst = P.p.peer_shared[d] + g.off_rows + (int64_t(me) * g.P + slot_of(t, e)) * g.row;
      const int64_t lo = (w % nseg) * seg;
      if (lo < body16) warp_copy_from_shared(dst + lo, row + lo, min(seg, body16 - lo), lane);
      if (lo != 0) continue;
      write_row_tail(dst, row, body, body16, t, P.weights[q], lane);
    }
    __syncthreads();  // the row is rewritten for the next token
  }

  // 5. Our counts column into every peer (block 0): counts[me][l] = rows we send it for expert l.
  if (blockIdx.x == 0)
    for (int i = threadIdx.x; i < g.N * g.L; i += blockDim.x)
      reinterpret_cast<int32_t*>(P.p.peer_shared[i / g.L] + g.off_counts)[int64_t(me) * g.L + i % g.L] = cnt[i];
  if (last_block_done(&ep->done[0]))  // every peer is node-local here: no proxy flag
    remote::close_send(P.p, g, nullptr, [&](int r) { return &flags_of(P.p, r)->d_arrived[me]; }, &ep->d_send, epoch,
                       P.handle);
}

}  // namespace

int64_t block_routing_smem_bytes(const Geometry& g) { return BlockRouteSmem(g).bytes; }

cudaError_t launch_dispatch_send_block(const DispatchSendParams& p, int blocks, cudaStream_t stream) {
  return launch_plain(dispatch_send_block_kernel, blocks, static_cast<size_t>(block_routing_smem_bytes(p.g)), stream, p);
}

}  // namespace a2a::cuda
