// combine recv: every block waits for every expert rank's rows and reduces its share of each
// token's pairs in f32 with the router weights (plus `out`); the last block to finish frees our
// combine region for the expert ranks. No grid-wide barrier.
#include "cuda/device.cuh"
#include "cuda/kernels.h"
#include "cuda/remote.cuh"
#include "gpu/elems.cuh"
#include "gpu/failure.cuh"
#include "gpu/grid.cuh"
#include "gpu/kernel.cuh"
#include "gpu/reduce.cuh"

namespace a2a::cuda {
using namespace ::a2a::gpu;  // the shared device library (cc/gpu)
namespace {

__global__ void __launch_bounds__(kThreads) combine_recv_kernel(CombineRecvParams P) {
  A2A_KERNEL_START(P);
  // The token count (written before the launch) is loaded at entry, so that its latency overlaps
  // the flag wait instead of following it (the acquire loads keep a later load behind them).
  const int32_t num_tokens = *P.num_tokens;
  SyncFlags* mine = flags_of(P.p, me);
  prefetch_reduce_meta(P, ix);  // our pairs' dest / slot / weight into L1 while we wait
  const uint64_t out = masked_ranks(g, P.p);  // elastic EP: wrote us nothing (our pairs to them were stopped)
  if (!remote::arrived(P.p, g, Half::kCombineRecv, [&](int r) { return &mine->c_arrived[r]; }, epoch + 1, &P.p.remote.ctrl->c_landed,
                       out)) {
    poison_combine_recv(P, ix);  // an op of this slot failed: the host raises it
    return;
  }
  const int n = max(0, min(num_tokens, g.T));
  const int64_t stride = int64_t(g.H) * elem_bytes(P.y_kind);
  const uint8_t* region = P.p.peer_shared[me] + g.off_c_rows;  // [tp][Q][stride]
  reduce_combine(P, n, ix, [&](int t, int d, int32_t slot) {
    const int64_t at = (int64_t(t % g.tp) * g.Q + slot) * stride;  // slot: the pair's row in its member's part
    return remote::is_remote(P.p, d) ? P.p.remote.c_recv + at : region + at;
  });
  if (last_block_done(ep->done_of(Half::kCombineRecv))) {  // expert ranks may overwrite our rows now
    if (threadIdx.x < g.N && !remote::is_remote(P.p, threadIdx.x) && !left_out(out, threadIdx.x))
      ptx::st_release_sys(&flags_of(P.p, threadIdx.x)->c_free[me], epoch + 1);
    if (remote::any(P.p)) remote::raise_for_proxy(&P.p.remote.ctrl->c_consumed, epoch + 1);
  }
}

}  // namespace

cudaError_t launch_combine_recv(const CombineRecvParams& p, int blocks, cudaStream_t stream) {
  return launch_plain(combine_recv_kernel, blocks, 0, stream, p);
}

void combine_recv_kernels(const Geometry&, std::vector<KernelRef>* out) {
  out->push_back({"combine_recv", reinterpret_cast<const void*>(&combine_recv_kernel), 0, kThreads, false});
}

}  // namespace a2a::cuda
