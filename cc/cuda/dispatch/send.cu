// dispatch send: route, quantise/convert, push rows and counts into every peer's buffer, raise
// each peer's arrival flag. One cooperative kernel; phases separated by grid syncs.
#include "cuda/common.cuh"
#include "cuda/kernels.h"
#include "core/fp8.h"

namespace a2a::cuda {
namespace {

struct SendScratch {
  int32_t* pair_expert;  // [T*K] expert id of a routed pair, -1 otherwise
  int32_t* pos_in;       // [T*K] index among (member, expert)'s pairs in token order
  int32_t* cnt;          // [tp*E]
};

__device__ SendScratch send_scratch(const Geometry& g, uint8_t* priv) {
  int32_t* base = reinterpret_cast<int32_t*>(priv + g.off_scratch);
  SendScratch s;
  const int64_t tk = int64_t(g.T) * g.K;
  s.pair_expert = base;
  s.pos_in = base + tk;
  s.cnt = base + 2 * tk;
  return s;
}

// Phase 1, grid-wide: validity and dedup of every pair -> pair_expert, dest.
__device__ void route_pairs(const DispatchSendParams& P, const SendScratch& s, int n, int64_t gtid, int64_t gstride) {
  const Geometry& g = P.g;
  for (int64_t q = gtid; q < int64_t(g.T) * g.K; q += gstride) {
    const int t = q / g.K, k = q % g.K;
    const int32_t id = P.ids[q];
    bool routed = t < n && id >= 0 && id < g.E;
    for (int j = 0; routed && j < k; ++j) routed = P.ids[int64_t(t) * g.K + j] != id;
    s.pair_expert[q] = routed ? id : -1;
    P.dest[q] = routed ? id / g.L : g.N;
  }
}

// Block 0 after phase 1: pairs of our member dropped (invalid or repeated ids; -1 is not a drop).
__device__ void count_dropped(const DispatchSendParams& P, const SendScratch& s, int n) {
  const Geometry& g = P.g;
  const int me = P.p.rank % g.tp;
  __shared__ int dropped;
  if (threadIdx.x == 0) dropped = 0;
  __syncthreads();
  int mine = 0;
  for (int64_t q = threadIdx.x; q < int64_t(n) * g.K; q += blockDim.x) {
    const int t = q / g.K;
    if (s.pair_expert[q] < 0 && P.ids[q] != -1 && t % g.tp == me) ++mine;
  }
  if (mine) atomicAdd(&dropped, mine);
  __syncthreads();
  if (threadIdx.x == 0) *P.dropped = dropped;
}

// Phase 2, grid-wide: one warp per (member, expert) scans that member's tokens in order, 32 at a
// time, giving each pair its index among the expert's pairs (token order) and the expert's count.
__device__ void scan_experts(const DispatchSendParams& P, const SendScratch& s, int n, int gwarp, int nwarps, int lane) {
  const Geometry& g = P.g;
  for (int me_e = gwarp; me_e < g.tp * g.E; me_e += nwarps) {
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
}

// Phase 3, warp-cooperative: slot of pair (member m, expert e) inside (m, dest)'s run = rows of
// m for the dest's earlier local experts + the pair's index. Every lane gets the result.
__device__ __forceinline__ int pair_slot_of(const Geometry& g, const SendScratch& s, int m, int e, int pos_in, int lane) {
  const int d = e / g.L, l = e % g.L;
  const int32_t* c = s.cnt + int64_t(m) * g.E + int64_t(d) * g.L;
  int before = 0;
  for (int i = lane; i < l; i += 32) before += c[i];
  for (int off = 16; off > 0; off >>= 1) before += __shfl_xor_sync(0xffffffffu, before, off);
  return before + pos_in;
}

// Token t of our member -> staging row (payload, scales). One warp per token.
__device__ void stage_token(const DispatchSendParams& P, int t, int lane) {
  const Geometry& g = P.g;
  uint8_t* row = P.p.priv + g.off_staging + int64_t(t) * g.row;
  if (g.wire_kind == 3) {
    uint8_t* q = row;
    float* sc = reinterpret_cast<float*>(row + g.payload);
    if (P.x_kind == 3) {  // pre-quantised
      warp_copy(q, static_cast<const uint8_t*>(P.x) + int64_t(t) * g.H, g.H, lane);
      for (int b = lane; b < g.S; b += 32) sc[b] = P.x_scale[int64_t(t) * g.S + b];
      return;
    }
    for (int b = 0; b < g.S; ++b) {
      const int64_t base = int64_t(t) * g.H + int64_t(b) * g.scale_block;
      float amax = 0.f;
      for (int i = lane; i < g.scale_block; i += 32) amax = fmaxf(amax, fabsf(load_elem(P.x, base + i, P.x_kind)));
      for (int off = 16; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
      const float s = fp8_block_scale(amax, g.pow2 != 0);
      const float inv = __frcp_rn(s);
      if (lane == 0) sc[b] = s;
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

__global__ void __launch_bounds__(kThreads) dispatch_send_kernel(DispatchSendParams P) {
  const Geometry& g = P.g;
  cg::grid_group grid = cg::this_grid();
  const GridIdx ix;
  const int lane = ix.lane, gwarp = ix.gwarp, nwarps = ix.nwarps;
  const int me = P.p.rank, member = me % g.tp;
  Epochs* ep = reinterpret_cast<Epochs*>(P.p.priv + g.off_epochs);
  const uint64_t epoch = ep->d_send;
  const int n = max(0, min(*P.num_tokens, g.T));
  SendScratch s = send_scratch(g, P.p.priv);

  // Phase 1: route pairs and stage (quantise) our member's tokens; block 0 also waits until
  // every peer has finished reading our previous rows, since phase 3 overwrites them.
  route_pairs(P, s, n, ix.gtid, ix.gstride);
  for (int t = gwarp; t < n; t += nwarps)
    if (t % g.tp == member) stage_token(P, t, lane);
  if (blockIdx.x == 0) wait_flags(P.p, g, 0, [&](int r) { return &flags_of(P.p, me)->d_free[r]; }, epoch);
  grid.sync();

  // Phase 2: per-(member, expert) order and counts; the dropped count.
  if (blockIdx.x == 0) count_dropped(P, s, n);
  scan_experts(P, s, n, gwarp, nwarps, lane);
  grid.sync();

  // Phase 3: every pair's slot (all members: combine_recv reads the whole group's tokens); push
  // our member's rows into the destination's region for us, one warp per pair.
  const int64_t body = g.payload + 4 * int64_t(g.S);
  for (int64_t q = gwarp; q < int64_t(g.T) * g.K; q += nwarps) {
    const int e = s.pair_expert[q];
    const int t = q / g.K;
    if (e < 0) {
      if (lane == 0) P.pair_slot[q] = 0;
      continue;
    }
    const int m = t % g.tp;
    const int j = pair_slot_of(g, s, m, e, s.pos_in[q], lane);
    if (lane == 0) P.pair_slot[q] = j;
    if (m != member) continue;
    const int d = e / g.L;
    uint8_t* dst = P.p.peer_shared[d] + g.off_rows + (int64_t(me) * g.P + j) * g.row;
    const uint8_t* src = P.p.priv + g.off_staging + int64_t(t) * g.row;
    warp_copy(dst, src, body / 16 * 16, lane);
    if (lane == 0) {
      for (int64_t b = body / 16 * 16; b < body; ++b) dst[b] = src[b];
      int32_t tok = t;
      float w = P.weights[q];
      memcpy(dst + body, &tok, 4);
      memcpy(dst + body + 4, &w, 4);
    }
  }
  // Our counts column into every peer: counts[me][l] = rows we send it for local expert l.
  for (int64_t i = ix.gtid; i < int64_t(g.N) * g.L; i += ix.gstride) {
    const int d = i / g.L, l = i % g.L;
    int32_t* c = reinterpret_cast<int32_t*>(P.p.peer_shared[d] + g.off_counts) + int64_t(me) * g.L + l;
    *c = s.cnt[int64_t(member) * g.E + d * g.L + l];
  }
  grid.sync();
  if (blockIdx.x == 0) {
    if (threadIdx.x < g.N) {
      __threadfence_system();
      ptx::st_release_sys(&flags_of(P.p, threadIdx.x)->d_arrived[me], epoch + 1);
    }
    if (threadIdx.x == 0) {
      ep->d_send = epoch + 1;
      P.handle[0] = static_cast<int32_t>(epoch);
      P.handle[1] = P.p.slot;
    }
  }
}

}  // namespace

cudaError_t launch_dispatch_send(const DispatchSendParams& p, int blocks, cudaStream_t stream) {
  void* args[] = {const_cast<DispatchSendParams*>(&p)};
  return cudaLaunchCooperativeKernel(reinterpret_cast<void*>(dispatch_send_kernel), blocks, kThreads, args, 0, stream);
}

}  // namespace a2a::cuda
