// dispatch recv: every block waits for every source's arrival flag, derives the canonical layout
// (local expert, source, token; capacity rule) in its own shared memory (gpu/arrange.cuh), and
// copies its share of (row, segment) work items; the last block to finish frees the sources' rows.
// No grid-wide barrier: blocks never wait for each other.
#include "cuda/device.cuh"
#include "cuda/kernels.h"
#include "cuda/remote.cuh"
#include "gpu/arrange.cuh"
#include "gpu/failure.cuh"
#include "gpu/grid.cuh"
#include "gpu/kernel.cuh"
#include "gpu/recv_rows.cuh"

namespace a2a::cuda {
using namespace ::a2a::gpu;  // the shared device library (cc/gpu)
namespace {

__global__ void __launch_bounds__(kThreads) dispatch_recv_kernel(DispatchRecvParams P) {
  extern __shared__ int32_t smem[];
  A2A_KERNEL_START(P);
  SyncFlags* mine = flags_of(P.p, me);
  // [N src][L + 1]: node-local sources write theirs; block 0 gathers the remote ones' (remote.cuh)
  int32_t* counts = reinterpret_cast<int32_t*>(P.p.peer_shared[me] + g.off_counts);
  const int cs = counts_stride(g);
  const uint64_t out = masked_ranks(g, P.p);  // elastic EP: sent us nothing; their counts are stale

  if (!remote::arrived(P.p, g, Half::kDispatchRecv, [&](int r) { return &mine->d_arrived[r]; }, epoch + 1, &P.p.remote.ctrl->d_landed,
                       out, [&] { remote::gather_landing(P.p, g, counts, ep); })) {
    abandon_dispatch_recv(P, ix);  // an op of this slot failed: the host raises it
    return;
  }
  const volatile int32_t* vc = counts;
  const BlockArrangement a =
      block_arrange(g, [&](int s, int l) { return left_out(out, s) ? 0 : vc[s * cs + l]; }, smem);
  write_recv_outputs(P, a, ix, [&](int s) { return left_out(out, s) ? 0 : vc[s * cs + g.L]; });
  copy_received_rows(P, a, ix, [&](int s, int32_t j) {
    return remote::is_remote(P.p, s) ? remote::landed_row(P.p, g, ep, s, j)
                                     : P.p.peer_shared[me] + g.off_rows + (int64_t(s) * g.P + j) * g.row;
  }, [&](int, int32_t, const uint8_t* row, int32_t* tok, float* wt) { row_trailer(g, row, tok, wt); });
  if (last_block_done(ep->done_of(Half::kDispatchRecv))) {  // sources may reuse their rows now
    if (threadIdx.x < g.N && !remote::is_remote(P.p, threadIdx.x) && !left_out(out, threadIdx.x))
      ptx::st_release_sys(&flags_of(P.p, threadIdx.x)->d_free[me], epoch + 1);
    if (remote::any(P.p)) remote::raise_for_proxy(&P.p.remote.ctrl->d_consumed, epoch + 1);
  }
}

}  // namespace

cudaError_t launch_dispatch_recv(const DispatchRecvParams& p, int blocks, cudaStream_t stream) {
  return launch_plain(dispatch_recv_kernel, blocks, arrangement_smem_bytes(p.g.N, p.g.L), stream, p);
}

void dispatch_recv_kernels(const Geometry& g, std::vector<KernelRef>* out) {
  out->push_back({"dispatch_recv", reinterpret_cast<const void*>(&dispatch_recv_kernel),
                  static_cast<size_t>(arrangement_smem_bytes(g.N, g.L)), kThreads, false});
}

}  // namespace a2a::cuda
