// combine recv: wait for every expert rank's rows, reduce each token's pairs in f32 with the
// router weights (plus `out`), then free our combine region for the expert ranks.
// Work is split into (token, 256-element segment) items, one warp each, so that a decode batch
// (T = 128) still spreads over every SM; each lane reduces 8 consecutive elements with 16-byte
// loads (scalar fallback when H is not a multiple of 8).
#include "cuda/common.cuh"
#include "cuda/kernels.h"

namespace a2a::cuda {
namespace {

constexpr int kVec = 8;                 // elements per lane step
constexpr int kSegment = 32 * kVec;     // elements per warp item

// Where pair q's row sits in our combine region, or null when the pair was not routed.
__device__ __forceinline__ const uint8_t* pair_row(const CombineRecvParams& P, const uint8_t* region, int64_t stride,
                                                   int t, int64_t q) {
  const Geometry& g = P.g;
  const int d = P.dest[q];
  if (d < 0 || d >= g.N) return nullptr;
  return region + ((int64_t(d) * g.tp + t % g.tp) * g.P + P.pair_slot[q]) * stride;
}

__device__ __forceinline__ void reduce_vec(const CombineRecvParams& P, const uint8_t* region, int64_t stride, int t,
                                           int n, int64_t h) {
  const Geometry& g = P.g;
  float acc[kVec];
#pragma unroll
  for (int i = 0; i < kVec; ++i) acc[i] = 0.f;
  if (t < n) {
#pragma unroll 2
    for (int k = 0; k < g.K; ++k) {
      const int64_t q = int64_t(t) * g.K + k;
      const uint8_t* row = pair_row(P, region, stride, t, q);
      float v[kVec];
      if (row) {
        load_vec8(row, h, P.y_kind, v);
        const float w = P.weights[q];
#pragma unroll
        for (int i = 0; i < kVec; ++i) acc[i] = fmaf(w, v[i], acc[i]);
      } else {
#pragma unroll
        for (int i = 0; i < kVec; ++i) v[i] = 0.f;
      }
      if (P.pairs) store_vec8(P.pairs, q * g.H + h, 0, v);
    }
  } else if (P.pairs) {
    float z[kVec] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int k = 0; k < g.K; ++k) store_vec8(P.pairs, (int64_t(t) * g.K + k) * g.H + h, 0, z);
  }
  if (P.out_in) {
    float o[kVec];
    load_vec8(static_cast<const uint8_t*>(P.out_in), int64_t(t) * g.H + h, P.out_in_kind, o);
#pragma unroll
    for (int i = 0; i < kVec; ++i) acc[i] += o[i];
  }
  store_vec8(P.out, int64_t(t) * g.H + h, P.out_kind, acc);
}

__device__ __forceinline__ void reduce_scalar(const CombineRecvParams& P, const uint8_t* region, int64_t stride, int t,
                                              int n, int64_t h) {
  const Geometry& g = P.g;
  float acc = 0.f;
  for (int k = 0; k < g.K; ++k) {
    const int64_t q = int64_t(t) * g.K + k;
    const uint8_t* row = t < n ? pair_row(P, region, stride, t, q) : nullptr;
    const float v = row ? load_elem(row, h, P.y_kind) : 0.f;
    if (row) acc += P.weights[q] * v;
    if (P.pairs) P.pairs[q * g.H + h] = v;
  }
  if (P.out_in) acc += load_elem(P.out_in, int64_t(t) * g.H + h, P.out_in_kind);
  store_elem(P.out, int64_t(t) * g.H + h, P.out_kind, acc);
}

__global__ void __launch_bounds__(kThreads) combine_recv_kernel(CombineRecvParams P) {
  const Geometry& g = P.g;
  cg::grid_group grid = cg::this_grid();
  const GridIdx ix;
  const int me = P.p.rank;
  const uint64_t epoch = static_cast<uint64_t>(P.handle[0]);
  SyncFlags* mine = flags_of(P.p, me);
  if (blockIdx.x == 0) wait_flags(P.p, g, 3, [&](int r) { return &mine->c_arrived[r]; }, epoch + 1);
  grid.sync();
  const int n = max(0, min(*P.num_tokens, g.T));
  const int64_t stride = int64_t(g.H) * elem_bytes(P.y_kind);
  const uint8_t* region = P.p.peer_shared[me] + g.off_c_rows;
  const bool vec = g.H % kVec == 0 && P.out_kind != 3 && P.y_kind != 3 && (!P.out_in || P.out_in_kind != 3);
  if (vec) {
    const int segs = (g.H + kSegment - 1) / kSegment;
    for (int64_t w = ix.gwarp; w < int64_t(g.T) * segs; w += ix.nwarps) {
      const int t = static_cast<int>(w / segs);
      const int64_t h = (w % segs) * kSegment + int64_t(ix.lane) * kVec;
      if (h < g.H) reduce_vec(P, region, stride, t, n, h);
    }
  } else {
    for (int64_t i = ix.gtid; i < int64_t(g.T) * g.H; i += ix.gstride)
      reduce_scalar(P, region, stride, static_cast<int>(i / g.H), n, i % g.H);
  }
  grid.sync();
  if (blockIdx.x == 0 && threadIdx.x < g.N)
    ptx::st_release_sys(&flags_of(P.p, threadIdx.x)->c_free[me], epoch + 1);
}

}  // namespace

cudaError_t launch_combine_recv(const CombineRecvParams& p, int blocks, cudaStream_t stream) {
  void* args[] = {const_cast<CombineRecvParams*>(&p)};
  return cudaLaunchCooperativeKernel(reinterpret_cast<void*>(combine_recv_kernel), blocks, kThreads, args, 0, stream);
}

int64_t scratch_bytes(const Geometry& g) {
  return arrangement_offset(g) + 8 * Arrangement::scratch_elems(g.N, g.L);
}

int grid_blocks(int device) {
  int sms = 0;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || sms <= 0) sms = 1;
  // One block of kThreads per SM is always co-resident (the kernels use little shared memory).
  return sms;
}

}  // namespace a2a::cuda
