// Sender-side routing and staging shared by the GPU backends' dispatch_send kernels (cuda, nvshmem):
// which pairs are routed, their order per (member, expert), their slot in the destination's
// region, and one token's wire row (payload, then fp8 scales) in the private staging area.
#pragma once

#include "core/fp8.h"
#include "cuda/common.cuh"

namespace a2a::cuda {

struct SendScratch {
  int32_t* pair_expert;  // [T*K] expert id of a routed pair, -1 otherwise
  int32_t* pos_in;       // [T*K] index among (member, expert)'s pairs in token order
  int32_t* cnt;          // [tp*E]
  int32_t* start;        // [tp*E] first slot of (member, expert) within (member, dest)
};

__device__ inline SendScratch send_scratch(const Geometry& g, uint8_t* priv) {
  int32_t* base = reinterpret_cast<int32_t*>(priv + g.off_scratch);
  SendScratch s;
  const int64_t tk = int64_t(g.T) * g.K;
  s.pair_expert = base;
  s.pos_in = base + tk;
  s.cnt = base + 2 * tk;
  s.start = s.cnt + int64_t(g.tp) * g.E;
  return s;
}

// Block 0: validity, dedup, per-(member, expert) order by token, slots.
__device__ inline void route(const DispatchSendParams& P, const SendScratch& s, int n) {
  const Geometry& g = P.g;
  const int tid = threadIdx.x, nthreads = blockDim.x;
  const int lane = tid & 31, warp = tid >> 5, nwarps = nthreads >> 5;
  const int me = P.p.rank % g.tp;
  __shared__ int dropped;
  if (tid == 0) dropped = 0;
  __syncthreads();
  for (int64_t q = tid; q < int64_t(g.T) * g.K; q += nthreads) {
    const int t = q / g.K, k = q % g.K;
    const int32_t id = P.ids[q];
    bool routed = t < n && id >= 0 && id < g.E;
    for (int j = 0; routed && j < k; ++j) routed = P.ids[int64_t(t) * g.K + j] != id;
    if (!routed && t < n && id != -1 && t % g.tp == me) atomicAdd(&dropped, 1);
    s.pair_expert[q] = routed ? id : -1;
    P.dest[q] = routed ? id / g.L : g.N;
  }
  __syncthreads();
  // One warp per (member, expert): scan tokens of that member in order, 32 at a time.
  for (int me_e = warp; me_e < g.tp * g.E; me_e += nwarps) {
    const int m = me_e / g.E, e = me_e % g.E;
    int running = 0;
    for (int t0 = 0; t0 < n; t0 += 32) {
      const int t = t0 + lane;
      int hit_k = -1;
      if (t < n && t % g.tp == m)
        for (int k = 0; k < g.K; ++k)
          if (s.pair_expert[int64_t(t) * g.K + k] == e) hit_k = k;
      const unsigned ballot = __ballot_sync(0xffffffffu, hit_k >= 0);
      if (hit_k >= 0) s.pos_in[int64_t(t) * g.K + hit_k] = running + __popc(ballot & ((1u << lane) - 1));
      running += __popc(ballot);
    }
    if (lane == 0) s.cnt[me_e] = running;
  }
  __syncthreads();
  for (int md = tid; md < g.tp * g.N; md += nthreads) {  // prefix over local experts per (member, dest)
    const int m = md / g.N, d = md % g.N;
    int run = 0;
    for (int l = 0; l < g.L; ++l) {
      const int64_t i = int64_t(m) * g.E + d * g.L + l;
      s.start[i] = run;
      run += s.cnt[i];
    }
  }
  __syncthreads();
  for (int64_t q = tid; q < int64_t(g.T) * g.K; q += nthreads) {
    const int e = s.pair_expert[q];
    const int t = q / g.K;
    P.pair_slot[q] = e >= 0 ? s.start[int64_t(t % g.tp) * g.E + e] + s.pos_in[q] : 0;
  }
  if (tid == 0) *P.dropped = dropped;
}

// Token t of our member -> staging row (payload, scales). One warp per token.
__device__ inline void stage_token(const DispatchSendParams& P, int t, int lane) {
  const Geometry& g = P.g;
  uint8_t* row = P.p.priv + g.off_staging + int64_t(t) * g.row;
  if (g.wire_kind == 3) {
    uint8_t* q = row;
    uint8_t* sc = row + g.payload;  // S f32 scales, 4-byte aligned only when H % 4 == 0
    if (P.x_kind == 3) {  // pre-quantised
      warp_copy(q, static_cast<const uint8_t*>(P.x) + int64_t(t) * g.H, g.H, lane);
      for (int b = lane; b < g.S; b += 32) store_f32(sc + 4 * b, P.x_scale[int64_t(t) * g.S + b]);
      return;
    }
    for (int b = 0; b < g.S; ++b) {
      const int64_t base = int64_t(t) * g.H + int64_t(b) * g.scale_block;
      float amax = 0.f;
      for (int i = lane; i < g.scale_block; i += 32) amax = fmaxf(amax, fabsf(load_elem(P.x, base + i, P.x_kind)));
      for (int off = 16; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
      const float s = fp8_block_scale(amax, g.pow2 != 0);
      const float inv = __frcp_rn(s);
      if (lane == 0) store_f32(sc + 4 * b, s);
      for (int i = lane; i < g.scale_block; i += 32)
        q[int64_t(b) * g.scale_block + i] =
            __nv_cvt_float_to_fp8(__fmul_rn(load_elem(P.x, base + i, P.x_kind), inv), __NV_SATFINITE, __NV_E4M3);
    }
    return;
  }
  if (P.x_kind == g.wire_kind) {
    warp_copy(row, static_cast<const uint8_t*>(P.x) + int64_t(t) * g.payload, g.payload, lane);
    return;
  }
  for (int h = lane; h < g.H; h += 32) store_elem(row, h, g.wire_kind, load_elem(P.x, int64_t(t) * g.H + h, P.x_kind));
}

}  // namespace a2a::cuda
