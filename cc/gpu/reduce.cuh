// The weighted sum of combine_recv over each token's pairs (cuda and nvshmem kernels).
#pragma once

#include <cstdint>

#include "gpu/copy.cuh"
#include "gpu/elems.cuh"
#include "gpu/grid.cuh"
#include "gpu/params.h"

namespace a2a::gpu {

// combine_recv's reduction, shared by the GPU backends: for every token t of [0, T),
//   out[t, h] = sum_k weights[t, k] * row(t, d, slot)[h] (+ out_in[t, h]), f32 accumulation in k order,
//   pairs[t, k, h] = row(t, d, slot)[h] (0 for pairs not routed and tokens t >= n),
// where q = t * K + k, d = dest[q], slot = pair_slot[q] and row(t, d, slot) is the start of that
// pair's y row (H elements of y_kind, 16-byte aligned). Work items are (token, segment), one warp
// each, so that a decode batch (T = 128) still spreads over every SM; a lane reduces 32 bytes of
// each pair's row (16 bf16/f16 or 8 f32 elements: two 16-byte loads per pair) with 16-byte loads
// and stores. With 16-bit y the lane's two vectors lie 512 bytes apart (ReduceShape::h_of), so
// that each load instruction of the warp reads 512 contiguous bytes: with the two side by side
// every instruction touched twice the sectors it used (2026-12-03 profile: 50 % excessive
// sectors). One thread per element when H % 8 != 0 or a buffer is fp8.
constexpr int kReduceVec = 8;  // elements of one load_raw8 / store_vec8
constexpr int kReduceBatch = 8;
// Elements per lane and per warp item for y of kind YKind: 32 bytes of y per pair and lane. At
// decode (T = 128, H = 7168, bf16) that is 1,792 items, one round over a 132-SM grid of 16-warp
// blocks; with 16 bytes per lane (before 2026-12-03) it was 3,584 items, two rounds, each paying
// the dependent metadata and row loads again.
// kNarrow: 16 bytes of 16-bit y per pair and lane, twice the items and a batch that fits the 64
// registers of two 512-thread blocks per SM (the EP = 1 combine, gpu/local/combine.cu).
template <ElemKind YKind, bool kNarrow = false>
struct ReduceShape {
  static constexpr int kParts = YKind == ElemKind::kF32 || kNarrow ? 1 : 2;  // load_raw8 calls per pair and lane
  static constexpr int kLane = kParts * kReduceVec;  // elements per lane
  static constexpr int kSegment = 32 * kLane;        // elements per warp item
  // pairs whose row loads are in flight at once: 8 x 16 bytes, or 4 x 32 bytes (8 x 32 spilled
  // past the 128 registers a 512-thread block allows); narrow, 4 x 16 bytes (f32: 2 x 32)
  static constexpr int kBatch = kNarrow ? (YKind == ElemKind::kF32 ? 2 : 4) : (kParts == 1 ? kReduceBatch : kReduceBatch / 2);
  // First element of part c of `lane` in segment `seg`: 16-bit y, part c of every lane is one run of
  // 32 * 8 elements (512 bytes); f32, the lane's 8 elements are contiguous (load_raw8<ElemKind::kF32>).
  __device__ static int64_t h_of(int64_t seg, int lane, int c) {
    return kParts == 1 ? seg * kSegment + int64_t(lane) * kLane
                       : seg * kSegment + int64_t(c) * (32 * kReduceVec) + int64_t(lane) * kReduceVec;
  }
};

// The calling warp's index in the order work items are dealt: warp w of every block before warp
// w + 1 of any, so that a grid with more warps than items (decode: 1,792 items, 2,112 warps)
// leaves a few warps of every SM idle rather than whole SMs (with the global warp index, the last
// 20 of 132 SMs loaded nothing).
__device__ __forceinline__ int64_t reduce_warp(const GridIdx&) {
  return int64_t(threadIdx.x >> 5) * gridDim.x + blockIdx.x;
}

// The vector path of reduce_combine for y rows of kind YKind (H % 8 == 0, 16-byte aligned buffers).
template <ElemKind YKind, bool kNarrow, typename RowFn>
__device__ void reduce_combine_vec(const CombineRecvParams& P, int n, const GridIdx& ix, RowFn row) {
  using RS = ReduceShape<YKind, kNarrow>;
  constexpr int kParts = RS::kParts;
  constexpr int kBatch = RS::kBatch;
  const Geometry& g = P.g;
  const int64_t segs = (g.H + RS::kSegment - 1) / RS::kSegment;
  for (int64_t w = reduce_warp(ix); w < int64_t(g.T) * segs; w += ix.nwarps) {
    const int t = static_cast<int>(w / segs);
    int64_t h[kParts];  // first element of each part
    bool on[kParts];  // lanes past H only take part in the shuffles below (H % 8 == 0: parts are whole)
#pragma unroll
    for (int c = 0; c < kParts; ++c) {
      h[c] = RS::h_of(w % segs, ix.lane, c);
      on[c] = h[c] < g.H;
    }
    float acc[kParts][kReduceVec];
#pragma unroll
    for (int c = 0; c < kParts; ++c)
#pragma unroll
      for (int i = 0; i < kReduceVec; ++i) acc[c][i] = 0.f;
    // out_in's values are added at the end: prefetched into L1 now, so that their latency overlaps
    // the rows' (loading them into registers here spilled: the batch's row vectors take 64)
    if (P.out_in) {
      const int ob = elem_bytes(P.out_in_kind);
#pragma unroll
      for (int c = 0; c < kParts; ++c) {
        if (!on[c]) continue;
        // a part is 8 elements: at most 32 bytes, within one 128-byte line (8-element aligned)
        ptx::prefetch_l1(static_cast<const uint8_t*>(P.out_in) + (int64_t(t) * g.H + h[c]) * ob);
      }
    }
    // Pairs in chunks of 32: lane i loads pair i's dest, slot and weight (one round of loads
    // instead of a dependent chain per pair), then kBatch pairs' row loads (kParts 16-byte
    // vectors each) are issued back to back and accumulated in k order.
    for (int kc = 0; kc < g.K; kc += 32) {
      const uint8_t* my_row = nullptr;
      float my_w = 0.f;
      if (kc + ix.lane < g.K && t < n) {
        const int64_t q = int64_t(t) * g.K + kc + ix.lane;
        const int d = P.dest[q];  // the three loads are independent: one latency, not a chain
        const int32_t slot = P.pair_slot[q];
        my_w = P.weights[q];
        if (d >= 0 && d < g.N) my_row = row(t, d, slot);
      }
      const int kn = min(32, g.K - kc);
      for (int k0 = 0; k0 < kn; k0 += kBatch) {
        constexpr int kV = YKind == ElemKind::kF32 ? 2 : kParts;  // 16-byte vectors per pair and lane
        int4 raw[kBatch][kV];
        float wt[kBatch];
        bool has[kBatch];
        // Every load of the batch before any conversion: with each load beside its use (the
        // dtype a run-time branch), the batch ran one load latency at a time (2026-12-01 profile).
#pragma unroll
        for (int u = 0; u < kBatch; ++u) {
          const int src = min(k0 + u, 31);
          const auto r_bits = __shfl_sync(0xffffffffu, reinterpret_cast<unsigned long long>(my_row), src);
          wt[u] = __shfl_sync(0xffffffffu, my_w, src);
          const uint8_t* r = k0 + u < kn ? reinterpret_cast<const uint8_t*>(r_bits) : nullptr;
          has[u] = r != nullptr;
#pragma unroll
          for (int v = 0; v < kV; ++v) raw[u][v] = make_int4(0, 0, 0, 0);
          if (has[u]) {
            if constexpr (kParts == 1) {  // one call: both vectors of f32, the one of narrow 16-bit
              if (on[0]) load_raw8<YKind>(r, h[0], raw[u]);
            } else {  // 16-bit: one vector per part
#pragma unroll
              for (int c = 0; c < kParts; ++c)
                if (on[c]) load_raw8<YKind>(r, h[c], &raw[u][c]);
            }
          }
          if (!has[u]) wt[u] = 0.f;
        }
        // then the conversions and sums, pair by pair in k order
#pragma unroll
        for (int u = 0; u < kBatch; ++u) {
          if (k0 + u >= kn) break;
#pragma unroll
          for (int c = 0; c < kParts; ++c) {
            float v[kReduceVec];
            raw8_to_f32<YKind>(kParts == 1 ? raw[u] : &raw[u][c], v);
#pragma unroll
            for (int i = 0; i < kReduceVec; ++i) acc[c][i] = fmaf(wt[u], v[i], acc[c][i]);
            if (on[c] && P.pairs)
              store_vec8(P.pairs, (int64_t(t) * g.K + kc + k0 + u) * g.H + h[c], ElemKind::kF32, v);
          }
        }
      }
    }
#pragma unroll
    for (int c = 0; c < kParts; ++c) {
      if (!on[c]) continue;
      if (P.out_in) {
        float o[kReduceVec];
        load_vec8(P.out_in, int64_t(t) * g.H + h[c], P.out_in_kind, o);
#pragma unroll
        for (int i = 0; i < kReduceVec; ++i) acc[c][i] += o[i];
      }
      store_vec8(P.out, int64_t(t) * g.H + h[c], P.out_kind, acc[c]);
    }
  }
}

// The calling warp's first work item of reduce_combine_vec: lane k < K prefetches pair k's dest,
// slot and weight into L1 (combine_recv issues it before its wait on the expert ranks, so that the
// item's first round of loads finds them there).
template <bool kNarrow = false>
__device__ inline void prefetch_reduce_meta(const CombineRecvParams& P, const GridIdx& ix) {
  const Geometry& g = P.g;
  const int64_t seg = P.y_kind == ElemKind::kF32 ? ReduceShape<ElemKind::kF32, kNarrow>::kSegment
                                                : ReduceShape<ElemKind::kBF16, kNarrow>::kSegment;
  const int64_t segs = (g.H + seg - 1) / seg;
  const int64_t w = reduce_warp(ix);
  if (w >= int64_t(g.T) * segs || ix.lane >= g.K) return;
  const int64_t q = w / segs * g.K + ix.lane;
  ptx::prefetch_l1(P.dest + q);
  ptx::prefetch_l1(P.pair_slot + q);
  ptx::prefetch_l1(P.weights + q);
}

// `row(t, d, slot)` may return null for a pair with no row (counted as a row of zeros);
// `rows_aligned`: every row it returns is 16-byte aligned (the vector path needs it);
template <bool kNarrow = false, typename RowFn>
__device__ void reduce_combine(const CombineRecvParams& P, int n, const GridIdx& ix, RowFn row,
                               bool rows_aligned = true) {
  const Geometry& g = P.g;
  const bool vec = g.H % kReduceVec == 0 && is_float(P.y_kind) && is_float(P.out_kind) && (!P.out_in || is_float(P.out_in_kind)) &&
                   rows_aligned && aligned16(P.out) && aligned16(P.out_in) &&
                   aligned16(P.pairs);  // XLA's buffers (ours are padded)
  if (vec) {
    switch (P.y_kind) {
      case ElemKind::kF32: reduce_combine_vec<ElemKind::kF32, kNarrow>(P, n, ix, row); return;
      case ElemKind::kBF16: reduce_combine_vec<ElemKind::kBF16, kNarrow>(P, n, ix, row); return;
      case ElemKind::kF16: reduce_combine_vec<ElemKind::kF16, kNarrow>(P, n, ix, row); return;
      case ElemKind::kF8E4M3: break;  // not a float kind: vec is false
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
      const uint8_t* r = d >= 0 && d < g.N ? row(t, d, P.pair_slot[q]) : nullptr;
      if (r != nullptr) {
        v = load_elem(r, h, P.y_kind);
        acc = fmaf(P.weights[q], v, acc);
      }
      if (P.pairs) P.pairs[q * g.H + h] = v;
    }
    if (P.out_in) acc += load_elem(P.out_in, int64_t(t) * g.H + h, P.out_in_kind);
    store_elem(P.out, int64_t(t) * g.H + h, P.out_kind, acc);
  }
}

}  // namespace a2a::gpu
