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
  int32_t* start;        // [tp*E] first slot of (member, expert) within (member, dest)
};

__device__ SendScratch send_scratch(const Geometry& g, uint8_t* priv) {
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
__device__ void route(const DispatchSendParams& P, const SendScratch& s, int n) {
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

  if (blockIdx.x == 0) {
    route(P, s, n);
    // Peers must have finished reading our previous rows before we overwrite them.
    wait_flags(P.p, g, 0, [&](int r) { return &flags_of(P.p, me)->d_free[r]; }, epoch);
  }
  for (int t = gwarp; t < n; t += nwarps)  // stage our member's tokens
    if (t % g.tp == member) stage_token(P, t, lane);
  grid.sync();

  // Push every routed pair of ours: warp per pair.
  for (int64_t q = gwarp; q < int64_t(g.T) * g.K; q += nwarps) {
    const int e = s.pair_expert[q];
    const int t = q / g.K;
    if (e < 0 || t % g.tp != member) continue;
    const int d = e / g.L;
    const int64_t j = s.start[int64_t(member) * g.E + e] + s.pos_in[q];
    uint8_t* dst = P.p.peer_shared[d] + g.off_rows + (int64_t(me) * g.P + j) * g.row;
    const uint8_t* src = P.p.priv + g.off_staging + int64_t(t) * g.row;
    const int64_t body = g.payload + 4 * int64_t(g.S);
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
  for (int64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < int64_t(g.N) * g.L; i += gridDim.x * blockDim.x) {
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
