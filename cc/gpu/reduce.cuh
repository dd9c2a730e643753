// The weighted sum of combine_recv over each token's pairs (cuda and nvshmem kernels).
#pragma once

#include <cstdint>

#include "gpu/copy.cuh"
#include "gpu/elems.cuh"
#include "gpu/grid.cuh"
#include "gpu/params.h"

namespace a2a::cuda {

// combine_recv's reduction, shared by the GPU backends: for every token t of [0, T),
//   out[t, h] = sum_k weights[t, k] * row(t, d, slot)[h] (+ out_in[t, h]), f32 accumulation in k order,
//   pairs[t, k, h] = row(t, d, slot)[h] (0 for pairs not routed and tokens t >= n),
// where q = t * K + k, d = dest[q], slot = pair_slot[q] and row(t, d, slot) is the start of that
// pair's y row (H elements of y_kind, 16-byte aligned). Work items are (token, 256-element segment), one warp each, so that
// a decode batch (T = 128) still spreads over every SM; a lane reduces 8 consecutive elements with
// 16-byte loads and stores. One thread per element when H % 8 != 0 or a buffer is fp8.
constexpr int kReduceVec = 8;
constexpr int kReduceSegment = 32 * kReduceVec;
constexpr int kReduceBatch = 8;

// The vector path of reduce_combine for y rows of kind YKind (H % 8 == 0, 16-byte aligned buffers).
template <int YKind, typename RowFn>
__device__ void reduce_combine_vec(const CombineRecvParams& P, int n, const GridIdx& ix, RowFn row) {
  const Geometry& g = P.g;
  const int64_t segs = (g.H + kReduceSegment - 1) / kReduceSegment;
  for (int64_t w = ix.gwarp; w < int64_t(g.T) * segs; w += ix.nwarps) {
    const int t = static_cast<int>(w / segs);
    const int64_t h = (w % segs) * kReduceSegment + int64_t(ix.lane) * kReduceVec;
    const bool on = h < g.H;  // lanes past H only take part in the shuffles below
    float acc[kReduceVec];
#pragma unroll
    for (int i = 0; i < kReduceVec; ++i) acc[i] = 0.f;
    float o[kReduceVec];  // out_in's values, loaded first so that their latency overlaps the rows'
    if (on && P.out_in) load_vec8(P.out_in, int64_t(t) * g.H + h, P.out_in_kind, o);
    // Pairs in chunks of 32: lane i loads pair i's dest, slot and weight (one round of loads
    // instead of a dependent chain per pair), then kReduceBatch pairs' 16-byte row loads are
    // issued back to back and accumulated in k order.
    for (int kc = 0; kc < g.K; kc += 32) {
      int my_d = -1, my_slot = 0;
      float my_w = 0.f;
      if (kc + ix.lane < g.K && t < n) {
        const int64_t q = int64_t(t) * g.K + kc + ix.lane;
        my_d = P.dest[q];  // the three loads are independent: one latency, not a chain
        my_slot = P.pair_slot[q];
        my_w = P.weights[q];
        if (my_d < 0 || my_d >= g.N) my_d = -1;
      }
      const int kn = min(32, g.K - kc);
      for (int k0 = 0; k0 < kn; k0 += kReduceBatch) {
        int4 raw[kReduceBatch][2];
        float wt[kReduceBatch];
        bool has[kReduceBatch];
        // Every load of the batch before any conversion: with each load beside its use (the
        // dtype a run-time branch), the batch ran one load latency at a time (2026-12-01 profile).
#pragma unroll
        for (int u = 0; u < kReduceBatch; ++u) {
          const int src = min(k0 + u, 31);
          const int d = __shfl_sync(0xffffffffu, my_d, src);
          const int slot = __shfl_sync(0xffffffffu, my_slot, src);
          wt[u] = __shfl_sync(0xffffffffu, my_w, src);
          has[u] = on && k0 + u < kn && d >= 0;
          raw[u][0] = raw[u][1] = make_int4(0, 0, 0, 0);
          if (has[u]) load_raw8<YKind>(row(t, d, slot), h, raw[u]);
        }
        float v[kReduceBatch][kReduceVec];
#pragma unroll
        for (int u = 0; u < kReduceBatch; ++u) {  // then the conversions
          raw8_to_f32<YKind>(raw[u], v[u]);
          if (!has[u]) wt[u] = 0.f;
        }
#pragma unroll
        for (int u = 0; u < kReduceBatch; ++u) {
          if (k0 + u >= kn) break;
#pragma unroll
          for (int i = 0; i < kReduceVec; ++i) acc[i] = fmaf(wt[u], v[u][i], acc[i]);
          if (on && P.pairs) store_vec8(P.pairs, (int64_t(t) * g.K + kc + k0 + u) * g.H + h, 0, v[u]);
        }
      }
    }
    if (!on) continue;
    if (P.out_in) {
#pragma unroll
      for (int i = 0; i < kReduceVec; ++i) acc[i] += o[i];
    }
    store_vec8(P.out, int64_t(t) * g.H + h, P.out_kind, acc);
  }
}

// The calling warp's first work item of reduce_combine_vec: lane k < K prefetches pair k's dest,
// slot and weight into L1 (combine_recv issues it before its wait on the expert ranks, so that the
// item's first round of loads finds them there).
__device__ inline void prefetch_reduce_meta(const CombineRecvParams& P, const GridIdx& ix) {
  const Geometry& g = P.g;
  const int64_t segs = (g.H + kReduceSegment - 1) / kReduceSegment;
  if (ix.gwarp >= int64_t(g.T) * segs || ix.lane >= g.K) return;
  const int64_t q = ix.gwarp / segs * g.K + ix.lane;
  ptx::prefetch_l1(P.dest + q);
  ptx::prefetch_l1(P.pair_slot + q);
  ptx::prefetch_l1(P.weights + q);
}

template <typename RowFn>
__device__ void reduce_combine(const CombineRecvParams& P, int n, const GridIdx& ix, RowFn row) {
  const Geometry& g = P.g;
  const bool vec = g.H % kReduceVec == 0 && P.y_kind != 3 && P.out_kind != 3 && (!P.out_in || P.out_in_kind != 3) &&
                   aligned16(P.out) && aligned16(P.out_in) && aligned16(P.pairs);  // XLA's buffers (ours are padded)
  if (vec) {
    switch (P.y_kind) {
      case 0: reduce_combine_vec<0>(P, n, ix, row); return;
      case 1: reduce_combine_vec<1>(P, n, ix, row); return;
      case 2: reduce_combine_vec<2>(P, n, ix, row); return;
    }
  }
  for (int64_t i = ix.gtid; i < int64_t(g.T) * g.H; i += ix.gstride) {
    const int t = static_cast<int>(i / g.H);
    const int64_t h = i % g.H;
    float acc = 0.f;
    for (int k = 0; k < g.K; ++k) {
      const int64_t q = int64_t(t) * g.K + k;
      const int d = t < n ? P.dest[q] : -1;
      float v = 0.f;
      if (d >= 0 && d < g.N) {
        v = load_elem(row(t, d, P.pair_slot[q]), h, P.y_kind);
        acc = fmaf(P.weights[q], v, acc);
      }
      if (P.pairs) P.pairs[q * g.H + h] = v;
    }
    if (P.out_in) acc += load_elem(P.out_in, int64_t(t) * g.H + h, P.out_in_kind);
    store_elem(P.out, int64_t(t) * g.H + h, P.out_kind, acc);
  }
}

}  // namespace a2a::cuda
