// EP = 1 dispatch for batches whose routing tables do not fit one block's shared memory (prefill:
// T = 4096, K = 8 needs 256 KiB): the routing is spread over the cooperative grid instead of done
// by every block (gpu/local/dispatch.cu), in three phases with two grid barriers:
//   1. one warp per chunk of 32 tokens (one lane per token) checks and deduplicates the token's ids
//      in registers and builds the chunk's expert bitmaps in the warp's shared memory:
//      bits [E][C] u32 (C = ceil(T / 32) chunks), bit l of bits[e][c]: token 32c + l routed to e;
//      every block's drop count goes to drops [gridDim];
//   2. one warp per expert: off [E][C] i32, the exclusive prefix over chunks of the chunk's pairs
//      of e (popcounts of bits), and total [E] i32;
//   3. every block: start [E], the exclusive prefix of total (shared memory), the small outputs,
//      then tokens blockIdx.x, + gridDim.x, ...: each loaded, quantised or copied in registers
//      (gpu/token_chunks.cuh) and stored once per routed pair at its canonical row, with the
//      block's next token's loads in flight meanwhile (one chunk per thread where the row fits).
// A pair's slot is start[e] + off[e][c] + the earlier tokens of its chunk routed to e: the same
// number the block-routed kernel and the exchange kernels give it (no atomic decides a position).
// bits, off, total and drops live in the slot's private area (staging and scratch, unused by
// the local path).
#include <cooperative_groups.h>

#include "gpu/arrange.cuh"
#include "gpu/block_route.cuh"
#include "gpu/grid.cuh"
#include "gpu/local/local.h"
#include "gpu/local/outputs.cuh"
#include "gpu/token_chunks.cuh"

namespace a2a::gpu {
namespace {

namespace cg = cooperative_groups;

// The grid-routed kernel's global tables (int32 words from the slot's private area).
struct GridTables {
  uint32_t* bits;  // [E][C]
  int32_t* off;    // [E][C]
  int32_t* cnt;    // [E] pairs per expert (total)
  int32_t* drops;  // [gridDim]
  int64_t C;
  __host__ __device__ GridTables(const Geometry& g, uint8_t* priv) {
    C = (int64_t(g.T) + 31) / 32;
    bits = reinterpret_cast<uint32_t*>(priv);
    off = reinterpret_cast<int32_t*>(bits + int64_t(g.E) * C);
    cnt = off + int64_t(g.E) * C;
    drops = cnt + g.E;
  }
  // Bytes of the tables for a grid of `blocks` blocks.
  __host__ __device__ static int64_t bytes(const Geometry& g, int blocks) {
    return 4 * (2 * int64_t(g.E) * ((int64_t(g.T) + 31) / 32) + g.E + blocks);
  }
};

// Shared memory: one bitmap slab [E] u32 per warp (phase 1), then start [E] i32 (phase 3; over
// the slabs) and the token tail.
__host__ __device__ inline int64_t grid_smem_bytes(const Geometry& g) {
  const int64_t slabs = int64_t(kThreads / 32) * g.E * 4;
  const int64_t late = int64_t(g.E) * 4 + int64_t(sizeof(LocalTail));
  return slabs > late ? slabs : late;
}

// Token t (< n) whose chunks are loaded: lanes < K of warp 0 place its pairs (the token's ids
// deduplicated again; dest, pair_slot and the receive outputs of each pair; its rows into the
// tail), then every thread converts and stores its chunks at each row. `more`: the block takes
// another token after this one (the tail is rewritten: wait for every thread's reads).
template <bool kDequant, class Chunks>
__device__ __forceinline__ void place_and_store(const LocalDispatchParams& P, const GridTables& tb,
                                                const StartCnt& rt, LocalTail* tail, Chunks& ch, int t, int n,
                                                bool more) {
  const DispatchSendParams& S = P.s;
  const Geometry& g = S.g;
  if (threadIdx.x < 32) {
    int32_t pe[kBlockRouteMaxK];
    token_ids(S, t, pe);
    dedup_token_ids(g, t < n, pe);
    const int k = threadIdx.x;
    int e = -1;
#pragma unroll
    for (int i = 0; i < kBlockRouteMaxK; ++i)
      if (i == k) e = pe[i];
    if (k < g.K) {
      int32_t j = 0;
      int64_t pos = -1;
      if (e >= 0) {
        const int64_t ec = int64_t(e) * tb.C + t / 32;
        j = rt.start[e] + tb.off[ec] + __popc(tb.bits[ec] & ((1u << (t % 32)) - 1u));
        pos = local_pos(g, rt, e, j);
      }
      local_place(P, tail, t, k, e, j, pos);
    }
  }
  local_store_rows<kDequant, Chunks, false>(P, tail, ch);
  if (more) __syncthreads();
}

template <class Chunks, bool kDequant>
__global__ void __launch_bounds__(kThreads, Chunks::kChunks == 1 ? 2 : 1)
    local_dispatch_grid_kernel(LocalDispatchParams P) {
  extern __shared__ __align__(16) uint8_t smem[];
  const DispatchSendParams& S = P.s;
  const Geometry& g = S.g;
  const GridIdx ix;
  cg::grid_group grid = cg::this_grid();
  const GridTables tb(g, S.p.priv);
  const int n = max(0, min(*S.num_tokens, g.T));
  const int warp = threadIdx.x >> 5;
  __shared__ int block_bad;
  // The block's first token's x goes out before the routing, which runs while it is in flight.
  Chunks ch;
  int t = blockIdx.x;
  if (t < n) ch.load(S, t);

  // Phase 1: chunk c's bitmaps, one warp per chunk.
  if (threadIdx.x == 0) block_bad = 0;
  uint32_t* slab = reinterpret_cast<uint32_t*>(smem) + int64_t(warp) * g.E;
  int bad = 0;
  for (int64_t c = ix.gwarp; c < tb.C; c += ix.nwarps) {
    for (int e = ix.lane; e < g.E; e += 32) slab[e] = 0u;
    __syncwarp();
    const int tok = static_cast<int>(c * 32) + ix.lane;
    int32_t pe[kBlockRouteMaxK];
    token_ids(S, tok, pe);
    bad += dedup_token_ids(g, tok < n, pe);
#pragma unroll
    for (int k = 0; k < kBlockRouteMaxK; ++k)
      if (k < g.K && pe[k] >= 0) atomicOr(&slab[pe[k]], 1u << ix.lane);
    __syncwarp();
    for (int e = ix.lane; e < g.E; e += 32) tb.bits[int64_t(e) * tb.C + c] = slab[e];
    __syncwarp();
  }
  for (int o = 16; o > 0; o >>= 1) bad += __shfl_xor_sync(0xffffffffu, bad, o);
  __syncthreads();
  if (ix.lane == 0 && bad) atomicAdd(&block_bad, bad);
  __syncthreads();
  if (threadIdx.x == 0) tb.drops[blockIdx.x] = block_bad;  // an integer sum: the same in any order
  grid.sync();

  // Phase 2: per expert, the exclusive prefix of its pairs over chunks, one warp per expert.
  for (int e = ix.gwarp; e < g.E; e += ix.nwarps) {
    int running = 0;
    for (int64_t c0 = 0; c0 < tb.C; c0 += 32) {
      const int64_t c = c0 + ix.lane;
      const int v = c < tb.C ? __popc(tb.bits[int64_t(e) * tb.C + c]) : 0;
      int inc = v;
      for (int o = 1; o < 32; o <<= 1) {
        const int u = __shfl_up_sync(0xffffffffu, inc, o);
        if (ix.lane >= o) inc += u;
      }
      if (c < tb.C) tb.off[int64_t(e) * tb.C + c] = running + inc - v;
      running += __shfl_sync(0xffffffffu, inc, 31);
    }
    if (ix.lane == 0) tb.cnt[e] = running;
  }
  grid.sync();

  // Phase 3: start in shared memory (over the slabs), the small outputs, then the tokens.
  int32_t* start = reinterpret_cast<int32_t*>(smem);
  LocalTail* tail = reinterpret_cast<LocalTail*>(smem + int64_t(g.E) * 4);
  for (int e = threadIdx.x; e < g.E; e += blockDim.x) start[e] = tb.cnt[e];
  __syncthreads();
  if (threadIdx.x < 32) warp_exclusive_scan(start, g.E, ix.lane);
  __syncthreads();
  const StartCnt rt{start, tb.cnt};
  int dropped = 0;
  if (blockIdx.x == 0)
    for (int b = 0; b < static_cast<int>(gridDim.x); ++b) dropped += tb.drops[b];
  local_small_outputs(P, rt, dropped, ix);
  for (int64_t q = int64_t(n) * g.K + ix.gtid; q < int64_t(g.T) * g.K; q += ix.gstride) {
    S.dest[q] = g.N;  // tokens past num_tokens: no pair
    S.pair_slot[q] = 0;
  }

  // Two tokens in flight per block: the next one's loads go out before this one's stores.
  Chunks other;
  const int G = gridDim.x;
  for (; t < n; t += 2 * G) {
    if (t + G < n) other.load(S, t + G);
    place_and_store<kDequant>(P, tb, rt, tail, ch, t, n, t + G < n);
    if (t + G >= n) break;
    if (t + 2 * G < n) ch.load(S, t + 2 * G);
    place_and_store<kDequant>(P, tb, rt, tail, other, t + G, n, t + 2 * G < n);
  }
}

template <class Chunks, bool kDequant>
cudaError_t launch_grid(const LocalDispatchParams& p, int sms, cudaStream_t stream) {
  const size_t smem = static_cast<size_t>(grid_smem_bytes(p.s.g));
  auto* kernel = local_dispatch_grid_kernel<Chunks, kDequant>;
  if (smem > 48 * 1024) {
    const cudaError_t rc =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    if (rc != cudaSuccess) return rc;
  }
  // Two blocks per SM where they fit (more tokens' loads in flight), every block co-resident.
  int per_sm = 0;
  cudaError_t rc = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, smem);
  if (rc != cudaSuccess) return rc;
  if (per_sm < 1) return cudaErrorCooperativeLaunchTooLarge;
  const int blocks = sms * (per_sm < 2 ? per_sm : 2);
  return launch_cooperative(kernel, blocks, smem, stream, p);
}

}  // namespace

bool local_dispatch_grid_fits(const LocalDispatchParams& p, int64_t max_smem) {
  const Geometry& g = p.s.g;
  // The tables in the private slot area (staging + scratch), for up to 2 blocks per SM of 1,024 SMs.
  return grid_smem_bytes(g) <= max_smem && GridTables::bytes(g, 2048) <= g.off_epochs;
}

cudaError_t launch_local_dispatch_grid(const LocalDispatchParams& p, ChunkKind kind, int sms, cudaStream_t stream) {
  const auto launch = [&](auto chunks) {
    using Chunks = decltype(chunks);
    if constexpr (Chunks::kQuantizes)
      if (p.r.x_kind != p.s.g.wire_kind) return launch_grid<Chunks, true>(p, sms, stream);
    return launch_grid<Chunks, false>(p, sms, stream);
  };
  return small_chunks_fit(p.s.g, kind) ? with_chunk_kind<true>(kind, launch) : with_chunk_kind(kind, launch);
}

}  // namespace a2a::gpu
