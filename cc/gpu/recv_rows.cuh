// dispatch_recv's output side, shared by the GPU backends (cuda, nvshmem): given a block's
// arrangement (gpu/arrange.cuh), write the small outputs and copy the block's share of the
// received rows to their canonical positions. Work items are (row, segment) so that a decode
// batch (a few hundred to a few thousand rows) spreads over every warp of the grid.
#pragma once

#include "gpu/arrange.cuh"
#include "gpu/copy.cuh"
#include "gpu/dequant.cuh"
#include "gpu/grid.cuh"
#include "gpu/params.h"

namespace a2a::gpu {

// group_sizes [L], overflow [], recv_counts [N, L + 1] (block 0: the counts, then c_off(s), where
// source s's combine region part expects our rows), and for every output row no received row
// lands on: weight 0, src (-1, -1), recv_slot -1 (grid-wide, disjoint from the copied rows).
template <typename COffFn>
__device__ inline void write_recv_outputs(const DispatchRecvParams& P, const BlockArrangement& a, const GridIdx& ix,
                                          COffFn c_off) {
  const Geometry& g = P.g;
  if (blockIdx.x == 0) {
    const int cs = counts_stride(g);
    for (int i = threadIdx.x; i < g.N * cs; i += blockDim.x)
      P.recv_counts[i] = i % cs < g.L ? a.counts[i / cs * g.L + i % cs] : c_off(i / cs);
    for (int l = threadIdx.x; l < g.L; l += blockDim.x) P.group_sizes[l] = a.kept[l];
    if (threadIdx.x == 0) *P.overflow = a.overflow;
  }
  const int64_t rows_out = g.ragged() ? g.capacity : int64_t(g.L) * g.capacity;
  for (int64_t i = ix.gtid; i < rows_out; i += ix.gstride) {
    if (output_row_used(g, a, i)) continue;
    P.weights[i] = 0.f;
    P.src[2 * i] = -1;
    P.src[2 * i + 1] = -1;
    P.recv_slot[i] = -1;
  }
}

// Every received row w (compact order) to x [pos] (payload; with P.x_kind != wire_kind its values
// dequantised: gpu/dequant.cuh), scale [pos] (fp8 scales, read from the row after the payload;
// null when dequantised), weights/src/recv_slot [pos]; row(s, j) is where source s's slot j
// landed (a wire row: payload, scales, token, weight) and meta(s, j, row, &token, &weight) reads
// that row's token and router weight.
template <typename RowFn, typename MetaFn>
__device__ inline void copy_received_rows(const DispatchRecvParams& P, const BlockArrangement& a, const GridIdx& ix,
                                          RowFn row_of, MetaFn meta) {
  const Geometry& g = P.g;
  const int32_t total = a.row_base[g.N];
  const int64_t seg = row_segment_bytes(g.payload, total, ix.nwarps);
  const int64_t nseg = (g.payload + seg - 1) / seg;
  for (int64_t w = ix.gwarp; w < int64_t(total) * nseg; w += ix.nwarps) {
    const RowLoc r = locate_row(g, a, static_cast<int32_t>(w / nseg));
    if (r.pos < 0) continue;
    const int64_t lo = (w % nseg) * seg;
    const uint8_t* row = row_of(r.s, r.j);
    if (P.x_kind == g.wire_kind)
      warp_copy(static_cast<uint8_t*>(P.x) + r.pos * g.payload + lo, row + lo, min(seg, g.payload - lo), ix.lane);
    else  // fp8 on the wire, dequantised into x (payload bytes are elements)
      warp_dequant(static_cast<uint8_t*>(P.x) + r.pos * g.H * elem_bytes(P.x_kind), P.x_kind, row, g, lo,
                   min(seg, g.payload - lo), ix.lane);
    if (lo != 0) continue;
    if (P.scale)
      for (int b = ix.lane; b < g.S; b += 32) P.scale[r.pos * g.S + b] = load_f32(row + g.payload + 4 * b);
    if (ix.lane == 0) {
      int32_t tok;
      float wt;
      meta(r.s, r.j, row, &tok, &wt);
      P.weights[r.pos] = wt;
      P.src[2 * r.pos] = r.s;
      P.src[2 * r.pos + 1] = tok;
      P.recv_slot[r.pos] = r.j;
    }
  }
}

// The cuda backend's wire rows carry token and weight after the scales.
__device__ __forceinline__ void row_trailer(const Geometry& g, const uint8_t* row, int32_t* tok, float* wt) {
  *tok = static_cast<int32_t>(load_u32(row + g.payload + 4 * int64_t(g.S)));
  *wt = load_f32(row + g.payload + 4 * int64_t(g.S) + 4);
}

}  // namespace a2a::gpu
