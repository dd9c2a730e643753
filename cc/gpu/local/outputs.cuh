// What both EP = 1 dispatch kernels (gpu/local/dispatch.cu, block-routed; dispatch_grid.cu,
// grid-routed) write besides the rows: where a pair lands, and the small outputs. At N = 1 a
// pair's slot j in the receive arrangement is its canonical position: ragged row j (dropped at
// j >= capacity), or expert_major [e][j - start[e]]. The routing tables are any type with
//   const int32_t* start;  // [E] exclusive prefix of the per-expert pair counts
//   const int32_t* cnt;    // [E] pairs per expert
// (BlockRoute in shared memory, or the grid-routed kernel's own).
#pragma once

#include <cstdint>

#include "gpu/block_route.cuh"
#include "gpu/elems.cuh"
#include "gpu/grid.cuh"
#include "gpu/params.h"
#include "gpu/token_chunks.cuh"
#include "gpu/warp.cuh"

namespace a2a::gpu {

// Routing tables by pointer, for local_small_outputs / local_pos / local_kept: start [E] and cnt [E]
// wherever a kernel keeps them (shared or global memory).
struct StartCnt {
  const int32_t* start;
  const int32_t* cnt;
};

// Where a token's chunks go (threads < K fill them for each token).
struct LocalTail {
  int32_t pos[kBlockRouteMaxK];  // output row of pair k, -1 when not routed or past the capacity
};

// Output row of the routed pair of expert e with slot j, or -1 past the capacity.
template <class Tables>
__device__ __forceinline__ int64_t local_pos(const Geometry& g, const Tables& rt, int e, int32_t j) {
  if (g.ragged()) return j < g.capacity ? int64_t(j) : -1;
  const int32_t within = j - rt.start[e];
  return within < g.capacity ? int64_t(e) * g.capacity + within : -1;
}

// Rows of local expert l the capacity rule keeps (its group size).
template <class Tables>
__device__ __forceinline__ int32_t local_kept(const Geometry& g, const Tables& rt, int l) {
  if (g.ragged()) return min(rt.start[l] + rt.cnt[l], g.capacity) - min(rt.start[l], g.capacity);
  return min(rt.cnt[l], g.capacity);
}

// The small outputs from the block's complete routing tables: block 0 writes group_sizes [L],
// recv_counts [1, L + 1] (the counts, then combine offset 0), overflow, dropped and the handle; the grid marks every output row no pair
// lands on (weight 0, src (-1, -1), recv_slot -1), as dispatch_recv does.
template <class Tables>
__device__ void local_small_outputs(const LocalDispatchParams& P, const Tables& rt, int dropped,
                                    const GridIdx& ix) {
  const DispatchRecvParams& R = P.r;
  const Geometry& g = R.g;
  if (blockIdx.x == 0) {
    __shared__ int over;
    if (threadIdx.x == 0) over = 0;
    __syncthreads();
    int mine = 0;
    for (int l = threadIdx.x; l < g.L; l += blockDim.x) {
      const int32_t kept = local_kept(g, rt, l);
      R.recv_counts[l] = rt.cnt[l];
      R.group_sizes[l] = kept;
      mine += rt.cnt[l] - kept;
    }
    mine = warp_sum(mine);
    if ((threadIdx.x & 31) == 0 && mine) atomicAdd(&over, mine);
    __syncthreads();
    if (threadIdx.x == 0) {
      R.recv_counts[g.L] = 0;  // our own combine offset: one rank, nothing below it
      *R.overflow = over;  // an integer sum: the same in any order
      *P.s.dropped = dropped;
      P.s.handle[0] = 0;
      P.s.handle[1] = P.s.p.slot;
    }
  }
  const int64_t total = int64_t(rt.start[g.E - 1]) + rt.cnt[g.E - 1];
  const int64_t rows_out = g.ragged() ? g.capacity : int64_t(g.L) * g.capacity;
  for (int64_t i = ix.gtid; i < rows_out; i += ix.gstride) {
    const bool used = g.ragged() ? i < min(total, int64_t(g.capacity))
                                    : i % g.capacity < local_kept(g, rt, static_cast<int>(i / g.capacity));
    if (used) continue;
    R.weights[i] = 0.f;
    R.src[2 * i] = -1;
    R.src[2 * i + 1] = -1;
    R.recv_slot[i] = -1;
  }
}

// Pair k of token t (q = t * K + k), routed to expert e (-1: not routed), has slot j and lands at
// output row pos (-1: none): its dest and pair_slot as dispatch_send writes them at N = 1, its row
// into the tail and, where it lands, its weight, source and slot outputs as dispatch_recv writes them.
__device__ __forceinline__ void local_place(const LocalDispatchParams& P, LocalTail* tail, int t, int k, int e,
                                            int32_t j, int64_t pos) {
  const DispatchRecvParams& R = P.r;
  const int64_t q = int64_t(t) * P.s.g.K + k;
  P.s.dest[q] = e >= 0 ? 0 : P.s.g.N;
  P.s.pair_slot[q] = j;
  tail->pos[k] = static_cast<int32_t>(pos);
  if (pos >= 0) {
    R.weights[pos] = P.s.weights[q];
    R.src[2 * pos] = 0;
    R.src[2 * pos + 1] = t;
    R.recv_slot[pos] = j;
  }
}

// Every thread, once the tail's rows are placed: converts its chunks of the token (gpu/token_chunks.cuh)
// and stores them at each row; with x in another kind than the wire's (fp8 dequantised on
// receive) the dequantised values instead. The loops over the rows are not unrolled: these kernels
// run one or a few tokens per block, so every instruction is fetched cold, and unrolled row loops
// made the decode kernel's code twice as long (2026-12-03 profile: 45 % of its stalls were
// instruction fetches). A row's position is read from the tail as its stores go out.
// kDequant: the kernel's instantiation for x dequantised on receive (a template parameter, so that
// the kernels without it keep their registers: the dequantised vectors cost the grid-routed
// kernel's two-blocks-per-SM variants spills).
// kDeal (with kDequant): the warp deal below; the grid-routed kernel goes without (the dealt
// vectors' registers made its variants spill, up to 344 bytes).
template <bool kDequant, class Chunks, bool kDeal = true>
__device__ __forceinline__ void local_store_rows(const LocalDispatchParams& P, const LocalTail* tail, Chunks& ch) {
  const DispatchSendParams& S = P.s;
  const DispatchRecvParams& R = P.r;
  const Geometry& g = S.g;
  ch.convert(S);
  __syncthreads();
  if constexpr (kDequant && Chunks::kQuantizes && !kDeal) {
    const int ob = elem_bytes(R.x_kind);  // each chunk converted once, then stored at every row
#pragma unroll
    for (int i = 0; i < Chunks::kChunks; ++i) {
      const int c = chunk_of(i);
      if (int64_t(c) * 16 >= g.H) continue;
      int4 dq[4];
      ch.dequantize(i, R.x_kind, dq);
#pragma unroll 1
      for (int k = 0; k < g.K; ++k) {
        const int32_t row = tail->pos[k];
        if (row < 0) continue;
        int4* dst = reinterpret_cast<int4*>(static_cast<uint8_t*>(R.x) + (int64_t(row) * g.H + int64_t(c) * 16) * ob);
#pragma unroll
        for (int j = 0; j < 4; ++j)
          if (j < ob) dst[j] = dq[j];  // 16 values of ob bytes: ob 16-byte vectors
      }
    }
  } else if constexpr (kDequant && Chunks::kQuantizes) {  // R.x_kind != wire_kind (Spec.recv_dtype)
    // Each chunk is dequantised once, into ob 16-byte vectors (16 values of ob bytes), and the
    // warp's vectors are dealt so that store j of lane l writes vector 32 j + l of the warp's run:
    // every store instruction then writes 512 contiguous bytes (lane by lane, a store wrote every
    // other 16 bytes of its run). The deal is once per token, the stores once per row.
    const int ob = elem_bytes(R.x_kind);
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int i = 0; i < Chunks::kChunks; ++i) {
      const int c0 = chunk_of(i) - lane;  // the warp's first chunk (a warp's chunks are consecutive)
      if (int64_t(c0) * 16 >= g.H) continue;  // warp-uniform: the shuffles below need every lane
      int4 dq[4];
      ch.dequantize(i, R.x_kind, dq);
      int4 out[4];
      bool ok[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        ok[j] = false;
        if (j >= ob) continue;
        const int vi = j * 32 + lane, src = vi / ob, idx = vi % ob;
        ok[j] = int64_t(c0 + src) * 16 < g.H;
#pragma unroll
        for (int s = 0; s < 4; ++s) {
          if (s >= ob) continue;
          const int4 got = make_int4(__shfl_sync(0xffffffffu, dq[s].x, src), __shfl_sync(0xffffffffu, dq[s].y, src),
                                     __shfl_sync(0xffffffffu, dq[s].z, src), __shfl_sync(0xffffffffu, dq[s].w, src));
          if (s == idx) out[j] = got;
        }
      }
#pragma unroll 1
      for (int k = 0; k < g.K; ++k) {
        const int32_t row = tail->pos[k];
        if (row < 0) continue;
        int4* dst = reinterpret_cast<int4*>(static_cast<uint8_t*>(R.x) + (int64_t(row) * g.H + int64_t(c0) * 16) * ob);
#pragma unroll
        for (int j = 0; j < 4; ++j)
          if (j < ob && ok[j]) dst[j * 32 + lane] = out[j];
      }
    }
  } else {
#pragma unroll 1
    for (int k = 0; k < g.K; ++k) {
      const int32_t row = tail->pos[k];
      if (row >= 0)
        ch.store(S, static_cast<uint8_t*>(R.x) + int64_t(row) * g.payload,
                 reinterpret_cast<uint8_t*>(R.scale + int64_t(row) * g.S));
    }
  }
}

}  // namespace a2a::gpu
