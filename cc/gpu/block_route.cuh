// Routing of a decode batch inside one block's shared memory, shared by the block-routed
// dispatch_send kernels (cuda/dispatch/send_block.cu: the token staged in shared memory;
// cuda/dispatch/send_regs.cu: staged in registers). Every block routes all T*K pairs itself, so
// no block waits for another and nothing goes through global scratch:
//   pe   [T*K] int32     expert of a routed pair, -1 otherwise (out of range, repeated in its token)
//   bits [E][words] u32  bit t of expert e's bitmap: token t routed to e (words = ceil(T / 32))
//   cnt  [E] int32       pairs per expert
//   start[E] int32       exclusive prefix of cnt over all experts (first_slot: within the dest)
// A pair's slot within its dest is first_slot(e) + the number of earlier tokens routed to e, its
// row in our combine region start[e] + that number (combine_of: tp is 1 here): the same in every
// block and in the grid-routed kernel (gpu/route.cuh), independent of timing; no atomic decides it.
// Also here: one token's ids in registers, deduplicated by the same rule (token_ids,
// dedup_token_ids), for the EP = 1 kernels (gpu/local/), which route without these tables.
#pragma once

#include <cstdint>

#include "gpu/grid.cuh"
#include "gpu/params.h"
#include "gpu/warp.cuh"

namespace a2a::gpu {

// A token's K ids are held in registers while it is routed: the block-routed kernels need K <= this.
constexpr int kBlockRouteMaxK = 16;

// The K ids of token u as given (u < T; -1 past K and for u >= T), for dedup_token_ids (K <= kN).
template <int kN>
__device__ __forceinline__ void token_ids(const DispatchSendParams& S, int u, int32_t (&pe)[kN]) {
  const int32_t* row = S.ids + int64_t(u) * S.g.K;
#pragma unroll
  for (int k = 0; k < kN; ++k) pe[k] = k < S.g.K && u < S.g.T ? __ldg(row + k) : -1;
}

// A token's ids deduplicated in place (the rule block_route applies inline): pe[k] = its expert where pair k is routed, else -1 (the
// token past num_tokens: `live` false; an id out of range; an id repeated within the token: the
// first stays). Returns the token's drops (ids out of range or repeated; -1 is no drop).
template <int kN>
__device__ __forceinline__ int dedup_token_ids(const Geometry& g, bool live, int32_t (&pe)[kN]) {
  int bad = 0;
#pragma unroll
  for (int k = 0; k < kN; ++k) {
    if (k >= g.K) break;
    bool routed = live && pe[k] >= 0 && pe[k] < g.E;
#pragma unroll
    for (int j = 0; j < k; ++j) routed = routed && pe[j] != pe[k];
    bad += !routed && live && pe[k] != -1;
    if (!routed) pe[k] = -1;
  }
  return bad;
}

// Shared-memory layout: the routing tables, then `tail_bytes` for the kernel's own use (16-byte
// aligned). Bytes from the dynamic shared-memory base.
struct BlockRouteSmem {
  int64_t words;  // ceil(T / 32): bitmap words per expert
  int64_t off_ids, off_bits, off_cnt, off_start, off_tail, bytes;
  __host__ __device__ BlockRouteSmem(const Geometry& g, int64_t tail_bytes) {
    words = (int64_t(g.T) + 31) / 32;
    off_ids = 0;                                            // [T*K] int32
    off_bits = off_ids + pad16(4 * int64_t(g.T) * g.K);   // [E][words] uint32
    off_cnt = off_bits + pad16(4 * int64_t(g.E) * words);  // [E] int32
    off_start = off_cnt + pad16(4 * int64_t(g.E));         // [E] int32
    off_tail = off_start + pad16(4 * int64_t(g.E));
    bytes = off_tail + pad16(tail_bytes);
  }
  __host__ __device__ static int64_t pad16(int64_t b) { return (b + 15) / 16 * 16; }
};

// Views of the tables in one block's shared memory.
struct BlockRoute {
  int32_t* pe;
  uint32_t* bits;
  int32_t* cnt;
  int32_t* start;  // [E] exclusive prefix of cnt over ALL experts (first_slot restarts it per dest)
  int64_t words;
  int L;
  __device__ BlockRoute(uint8_t* smem, const BlockRouteSmem& lay, int local_experts)
      : pe(reinterpret_cast<int32_t*>(smem + lay.off_ids)),
        bits(reinterpret_cast<uint32_t*>(smem + lay.off_bits)),
        cnt(reinterpret_cast<int32_t*>(smem + lay.off_cnt)),
        start(reinterpret_cast<int32_t*>(smem + lay.off_start)),
        words(lay.words),
        L(local_experts) {}
  // First slot of expert e within its destination (pairs of the dest's lower local experts).
  __device__ int32_t first_slot(int e) const { return start[e] - start[e / L * L]; }
  // Earlier tokens routed to e than t.
  __device__ int32_t rank_in(int t, int e) const {
    const uint32_t* b = bits + int64_t(e) * words;
    int before = __popc(b[t / 32] & ((1u << (t % 32)) - 1u));
    for (int w = 0; w < t / 32; ++w) before += __popc(b[w]);
    return before;
  }
  // Slot of routed pair (token t, expert e) within e's destination.
  __device__ int32_t slot_of(int t, int e) const { return first_slot(e) + rank_in(t, e); }
  // Its row in our combine region (pair_slot; our rows for lower ranks first: gpu/route.cuh combine_slot).
  __device__ int32_t combine_of(int t, int e) const { return start[e] + rank_in(t, e); }
};

struct BlockRouteResult {
  int dropped;  // pairs with an id out of range or repeated within its token (-1 is not a drop)
  bool all;     // `flag` was true in every thread of the block
};

// Every thread of the block: fills the tables for tokens t < n (of T rows of ids [T, K]). Each
// thread takes whole tokens and keeps their K ids in registers; its first token's ids are loaded
// before the first barrier and deduplicated in registers (no dependent loads). The counts and
// their prefix are one block-wide scan (each thread a contiguous run of experts, warp shuffles,
// then the warps' totals), not one warp per destination. Four block barriers in all. `flag` is
// AND-reduced over the block in the last, for a caller that prefetched a wait. The tables are
// complete for every thread on return. Needs K <= kBlockRouteMaxK.
__device__ inline BlockRouteResult block_route(const DispatchSendParams& P, int n, const BlockRoute& r, bool flag) {
  __shared__ int bad;
  __shared__ int warp_total[32];
  const Geometry& g = P.g;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int32_t id[kBlockRouteMaxK];
  const auto load_ids = [&](int t) {
    const int32_t* row = P.ids + int64_t(t) * g.K;
#pragma unroll
    for (int k = 0; k < kBlockRouteMaxK; ++k) id[k] = t < g.T && k < g.K ? __ldg(row + k) : -1;
  };
  load_ids(threadIdx.x);
  for (int64_t i = threadIdx.x; i < int64_t(g.E) * r.words; i += blockDim.x) r.bits[i] = 0u;
  if (threadIdx.x == 0) bad = 0;
  __syncthreads();
  int mine_bad = 0;
  for (int t = threadIdx.x; t < g.T; t += blockDim.x) {
    if (t != static_cast<int>(threadIdx.x)) load_ids(t);
#pragma unroll
    for (int k = 0; k < kBlockRouteMaxK; ++k) {
      if (k >= g.K) break;
      bool routed = t < n && id[k] >= 0 && id[k] < g.E;
#pragma unroll
      for (int j = 0; j < k; ++j) routed = routed && id[j] != id[k];
      r.pe[int64_t(t) * g.K + k] = routed ? id[k] : -1;
      if (routed) atomicOr(&r.bits[int64_t(id[k]) * r.words + t / 32], 1u << (t % 32));
      mine_bad += !routed && t < n && id[k] != -1;
    }
  }
  mine_bad = warp_sum(mine_bad);
  if (lane == 0 && mine_bad) atomicAdd(&bad, mine_bad);
  __syncthreads();
  // counts of this thread's experts [e0, e1), their sum, its exclusive prefix over the block
  const int per = (g.E + blockDim.x - 1) / blockDim.x;
  const int e0 = min(g.E, static_cast<int>(threadIdx.x) * per), e1 = min(g.E, e0 + per);
  int sum = 0;
  for (int e = e0; e < e1; ++e) {
    int c = 0;
    for (int64_t w = 0; w < r.words; ++w) c += __popc(r.bits[int64_t(e) * r.words + w]);
    r.cnt[e] = c;
    sum += c;
  }
  int inc = sum;
  for (int off = 1; off < 32; off <<= 1) {
    const int v = __shfl_up_sync(0xffffffffu, inc, off);
    if (lane >= off) inc += v;
  }
  if (lane == 31) warp_total[warp] = inc;
  __syncthreads();
  int run = inc - sum;
  for (int w = 0; w < warp; ++w) run += warp_total[w];
  for (int e = e0; e < e1; ++e) {
    r.start[e] = run;
    run += r.cnt[e];
  }
  const bool all = __syncthreads_and(flag) != 0;
  return {bad, all};
}

// Grid-wide: dest and pair_slot (the row in our combine region) of every pair (from any block's
// complete tables).
__device__ inline void write_route_outputs(const DispatchSendParams& P, const BlockRoute& r, const GridIdx& ix) {
  const Geometry& g = P.g;
  for (int64_t q = ix.gtid; q < int64_t(g.T) * g.K; q += ix.gstride) {
    const int e = r.pe[q];
    P.dest[q] = e >= 0 ? e / g.L : g.N;
    P.pair_slot[q] = e >= 0 ? r.combine_of(static_cast<int>(q / g.K), e) : 0;
  }
}

}  // namespace a2a::gpu
