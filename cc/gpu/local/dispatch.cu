// EP = 1 dispatch for decode-sized batches (gpu/local/local.h): dispatch_send's routing and
// dispatch_recv's layout in one kernel, without communication memory. Block b takes tokens b,
// b + gridDim.x, ... At N = 1 a routed pair's slot is its canonical position,
//   j(t, e) = start[e] + rank(t, e),  rank(t, e) = #{tokens u < t routed to e}
// (ragged row j, recv_slot j; expert_major row [e][rank]), with start the exclusive prefix of
// the per-expert pair counts. One pass over the batch's ids gives a block both for its own token:
// each thread takes whole tokens u (ids loaded and deduplicated in registers) and adds them to
// two shared-memory histograms, cnt [E] (every routed pair) and before [E] (pairs of tokens u < t);
// one warp scans cnt into start. The histograms are integer sums, the same in any order: no
// atomic decides a position. A block's next token t' = t + gridDim.x adds only the tokens of
// [t, t') to before. No block waits for another and nothing goes through global memory but the
// outputs. The token's x is loaded before the routing, quantised or copied in registers
// (gpu/token_chunks.cuh) and stored once per routed pair. The results are those of the exchange
// kernels at N = 1, bit for bit.
// Until 2026-12-03 every block built the whole routing table (gpu/block_route.cuh: bitmaps, ranks
// by popcount, every pair's dest and slot): 10.5 µs at decode with f32 x, latency-bound. A first
// replacement that counted each token against its block's K experts pairwise was slower (14.7 µs):
// its unrolled K x K loops doubled the code, and with a token or two per block every instruction
// is fetched cold (45 % of the stalls). Hence histograms, row loops not unrolled (local_store_rows)
// and kMaxK = 8.
#include "gpu/arrange.cuh"
#include "gpu/block_route.cuh"
#include "gpu/copy.cuh"
#include "gpu/grid.cuh"
#include "gpu/local/local.h"
#include "gpu/local/outputs.cuh"
#include "gpu/token_chunks.cuh"

namespace a2a::gpu {
namespace {

// The decode kernel takes K <= this (larger K: the grid-routed kernel).
constexpr int kMaxK = 8;

// Dynamic shared memory: cnt [E], before [E], start [E] int32, then the tail.
struct TokenSmem {
  int64_t off_before, off_start, off_tail, bytes;
  __host__ __device__ explicit TokenSmem(const Geometry& g) {
    off_before = 4 * int64_t(g.E);
    off_start = 2 * off_before;
    off_tail = (3 * off_before + 15) / 16 * 16;
    bytes = off_tail + int64_t(sizeof(LocalTail));
  }
};

template <class Chunks, bool kDequant>
__global__ void __launch_bounds__(kThreads) local_dispatch_kernel(LocalDispatchParams P) {
  extern __shared__ __align__(16) uint8_t smem[];
  __shared__ int bad_sum;
  const DispatchSendParams& S = P.s;
  const Geometry& g = S.g;
  const GridIdx ix;
  const TokenSmem lay(g);
  int32_t* cnt = reinterpret_cast<int32_t*>(smem);
  int32_t* before = reinterpret_cast<int32_t*>(smem + lay.off_before);
  int32_t* start = reinterpret_cast<int32_t*>(smem + lay.off_start);
  LocalTail* tail = reinterpret_cast<LocalTail*>(smem + lay.off_tail);
  const int warp = threadIdx.x >> 5;
  // The loads the routing waits for go out first: the token's x and this thread's token's ids.
  Chunks ch;
  int t = blockIdx.x;  // past T (a grid wider than the batch): no token, the histogram only
  if (t < g.T) ch.load(S, t);
  int32_t v[kMaxK];
  token_ids(S, threadIdx.x, v);
  const int n = max(0, min(*S.num_tokens, g.T));
  for (int e = threadIdx.x; e < g.E; e += blockDim.x) cnt[e] = before[e] = 0;
  if (threadIdx.x == 0) bad_sum = 0;
  __syncthreads();

  // Token t, after token t - gridDim.x (lo) or first (lo = 0: cnt and the drops over [0, n) too).
  int lo = 0;
  for (bool first = true;; first = false) {
    int bad = 0;
    for (int u = lo + threadIdx.x; u < (first ? n : min(t, n)); u += blockDim.x) {
      if (!first || u != static_cast<int>(threadIdx.x)) token_ids(S, u, v);
      bad += dedup_token_ids(g, true, v);
#pragma unroll
      for (int i = 0; i < kMaxK; ++i) {
        if (i >= g.K) break;
        if (v[i] < 0) continue;
        if (first) atomicAdd(&cnt[v[i]], 1);
        if (u < t) atomicAdd(&before[v[i]], 1);
      }
    }
    if (first) {
      bad = __reduce_add_sync(0xffffffffu, bad);
      if (ix.lane == 0 && bad) atomicAdd(&bad_sum, bad);
      __syncthreads();
      if (warp == 0) {  // start: the exclusive prefix of cnt
        for (int e = ix.lane; e < g.E; e += 32) start[e] = cnt[e];
        __syncwarp();
        warp_exclusive_scan(start, g.E, ix.lane);
      }
    }
    __syncthreads();
    // Warp 1, lane k < K: pair k of token t (its ids again, deduplicated alike).
    if (warp == 1 && ix.lane < g.K && t < g.T) {
      int32_t me[kMaxK];
      token_ids(S, t, me);
      dedup_token_ids(g, t < n, me);
      int e = -1;
#pragma unroll
      for (int i = 0; i < kMaxK; ++i)
        if (i == ix.lane) e = me[i];
      const int32_t j = e >= 0 ? start[e] + before[e] : 0;  // combine_of at N = 1: start[e] + rank
      local_place(P, tail, t, ix.lane, e, j, e >= 0 ? local_pos(g, StartCnt{start, cnt}, e, j) : -1);
    }
    if (first) local_small_outputs(P, StartCnt{start, cnt}, bad_sum, ix);
    if (t >= g.T) break;  // block-uniform
    // before[] and the tail are rewritten by the next token after local_store_rows' barrier,
    // which every read of this token's precedes
    local_store_rows<kDequant>(P, tail, ch);
    lo = t;
    t += gridDim.x;
    if (t >= g.T) break;
    ch.load(S, t);
  }
}

bool aligned16_host(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

// Whether the decode kernel takes the batch: every block passes over all T * K ids, so the
// grid-routed kernel takes larger batches (the bound is that of the block-routed tables this
// kernel replaced: the same choice for every shape as before) and K > kMaxK.
bool decode_sized(const Geometry& g) {
  return g.K <= kMaxK && BlockRouteSmem(g, sizeof(LocalTail)).bytes <= kBlockRoutingSmem &&
         TokenSmem(g).bytes <= kBlockRoutingSmem;
}

// Shared memory one block may opt in to on the current device (227 KiB on Hopper), cached.
int64_t max_block_smem() {
  static int cache[64] = {};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return 48 * 1024;
  if (dev >= 0 && dev < 64 && cache[dev] > 0) return cache[dev];
  int v = 0;
  if (cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess || v <= 0) v = 48 * 1024;
  if (dev >= 0 && dev < 64) cache[dev] = v;
  return v;
}

}  // namespace

ChunkKind local_dispatch_kind(const LocalDispatchParams& p) {
  const Geometry& g = p.s.g;
  const ChunkKind none;
  if (g.N != 1 || g.tp != 1 || g.K > kBlockRouteMaxK) return none;
  if (!aligned16_host(p.s.x) || !aligned16_host(p.r.x) || g.payload % 16 != 0) return none;
  const bool dequant = p.r.x_kind != g.wire_kind;  // fp8 rows dequantised on receive: no scale output
  if (g.wire_is_fp8() && !dequant && p.r.scale == nullptr) return none;
  ChunkKind kind = regs_chunk_kind(g, p.s.x_kind, p.s.x_scale != nullptr);
  // pre-quantised x: a chunk's scale is another thread's (CopyChunks)
  if (dequant && kind.how == ChunkKind::How::kCopy) return none;
  if (!kind.ok() || decode_sized(g)) return kind;
  if (!local_dispatch_grid_fits(p, max_block_smem())) return none;
  kind.grid_routed = true;
  return kind;
}

cudaError_t launch_local_dispatch(const LocalDispatchParams& p, ChunkKind kind, int blocks, cudaStream_t stream) {
  if (kind.grid_routed) return launch_local_dispatch_grid(p, kind, blocks, stream);
  const size_t smem = static_cast<size_t>(TokenSmem(p.s.g).bytes);
  const auto launch = [&](auto chunks) {
    using Chunks = decltype(chunks);
    if constexpr (Chunks::kQuantizes)
      if (p.r.x_kind != p.s.g.wire_kind) return launch_plain(local_dispatch_kernel<Chunks, true>, blocks, smem, stream, p);
    return launch_plain(local_dispatch_kernel<Chunks, false>, blocks, smem, stream, p);
  };
  // one chunk per thread where the row fits (DeepSeek-V3's H = 7168 quantised: half the code)
  return small_chunks_fit(p.s.g, kind) ? with_chunk_kind<true>(kind, launch) : with_chunk_kind(kind, launch);
}

}  // namespace a2a::gpu
