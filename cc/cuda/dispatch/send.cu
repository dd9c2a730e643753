// dispatch send: route, quantise/convert, push rows and counts into every peer's buffer, raise
// each peer's arrival flag. One cooperative kernel; phases separated by grid syncs.
#include "cuda/common.cuh"
#include "cuda/kernels.h"
#include "cuda/remote.cuh"
#include "cuda/route.cuh"

namespace a2a::cuda {
namespace {

__global__ void __launch_bounds__(kThreads) dispatch_send_kernel(DispatchSendParams P) {
  const Geometry& g = P.g;
  cg::grid_group grid = cg::this_grid();
  const GridIdx ix;
  const int lane = ix.lane, gwarp = ix.gwarp, nwarps = ix.nwarps;
  const int me = P.p.rank, member = me % g.tp;
  Epochs* ep = epochs_of(g, P.p.priv);
  const uint64_t epoch = ep->d_send;
  const int n = max(0, min(*P.num_tokens, g.T));
  SendScratch s = send_scratch(g, P.p.priv);

  if (blockIdx.x == 0) {
    route(P, s, n);
    // Peers must have finished reading our previous rows before we overwrite them.
    wait_flags(P.p, g, 0, [&](int r) { return &flags_of(P.p, me)->d_free[r]; }, epoch);
    if (remote::any(P.p)) {  // remote peers freed our rows there, and d_send is ours again
      remote::wait_proxy(P.p, 0, &P.p.remote.ctrl->d_send_ok, epoch + 1);
      remote::publish_counts(P.p, g, s.cnt + int64_t(member) * g.E, epoch);
    }
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
    uint8_t* dst = remote::is_remote(P.p, d) ? remote::send_row(P.p, g, d, j)
                                             : P.p.peer_shared[d] + g.off_rows + (int64_t(me) * g.P + j) * g.row;
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
    if (remote::is_remote(P.p, d)) continue;  // the proxy sends our whole count matrix there
    int32_t* c = reinterpret_cast<int32_t*>(P.p.peer_shared[d] + g.off_counts) + int64_t(me) * g.L + l;
    *c = s.cnt[int64_t(member) * g.E + d * g.L + l];
  }
  if (remote::any(P.p)) __threadfence_system();  // our rows in d_send, before the proxy's flag
  grid.sync();
  if (blockIdx.x == 0) {
    if (remote::any(P.p)) remote::raise_for_proxy(&P.p.remote.ctrl->d_packed, epoch + 1);
    if (threadIdx.x < g.N && !remote::is_remote(P.p, threadIdx.x)) {
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
  return launch_cooperative(dispatch_send_kernel, blocks, stream, p);
}

}  // namespace a2a::cuda
