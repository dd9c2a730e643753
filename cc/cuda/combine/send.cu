// combine send: put each received row's expert output back at its source, at the slot the
// source chose, for every member of the source's tp group; zeros for rows the capacity rule
// dropped. Then raise each rank's combine arrival flag.
#include "cuda/common.cuh"
#include "cuda/kernels.h"
#include "cuda/remote.cuh"

namespace a2a::cuda {
namespace {

__global__ void __launch_bounds__(kThreads) combine_send_kernel(CombineSendParams P) {
  const Geometry& g = P.g;
  cg::grid_group grid = cg::this_grid();
  const GridIdx ix;
  const int lane = ix.lane, gwarp = ix.gwarp, nwarps = ix.nwarps;
  const int me = P.p.rank;
  Epochs* ep = epochs_of(g, P.p.priv);
  const uint64_t epoch = ep->c_send;
  int64_t* arr_scratch = arrangement_scratch(g, P.p.priv);
  SyncFlags* mine = flags_of(P.p, me);

  if (slot_failed(g, P.p)) return;  // an earlier op of this slot failed: the host raises it
  if (blockIdx.x == 0 && remote::wait_peers(P.p, g, 2, [&](int r) { return &mine->c_free[r]; }, epoch,
                                            &P.p.remote.ctrl->c_send_ok, epoch + 1)) {
    if (threadIdx.x == 0) {
      compute_arrangement(g, P.recv_counts, arr_scratch, nullptr, nullptr);
      if (remote::any(P.p)) {  // what the proxy needs to write our rows back
        const Arrangement a = arrangement_view(g, arr_scratch);
        for (int s = 0; s < g.N; ++s) P.p.remote.ctrl->rows_from[s] = static_cast<int32_t>(a.rows_from[s]);
        P.p.remote.ctrl->c_stride = int64_t(g.H) * elem_bytes(P.y_kind);
      }
    }
  }
  grid.sync();
  if (slot_failed(g, P.p)) return;
  const Arrangement a = arrangement_view(g, arr_scratch);
  const int ybytes = elem_bytes(P.y_kind);
  const int64_t stride = int64_t(g.H) * ybytes;
  for (int64_t w = gwarp; w < int64_t(g.N) * g.P; w += nwarps) {
    const int s = w / g.P;
    const int64_t j = w % g.P;
    if (j >= a.rows_from[s]) continue;
    int l;
    const int64_t pos = row_position(g, a, s, j, &l);
    const int g0 = s / g.tp * g.tp;
    const bool to_proxy = remote::group_has_remote(P.p, g, s);  // once into c_send [s][P][stride]
    for (int m = g0; m < g0 + g.tp + (to_proxy ? 1 : 0); ++m) {  // every member of the source's group gets the row
      if (m < g0 + g.tp && remote::is_remote(P.p, m)) continue;
      uint8_t* dst = m == g0 + g.tp
                         ? P.p.remote.c_send + (int64_t(s) * g.P + j) * stride
                         : P.p.peer_shared[m] + g.off_c_rows + ((int64_t(me) * g.tp + s % g.tp) * g.P + j) * stride;
      if (pos >= 0)
        warp_copy(dst, static_cast<const uint8_t*>(P.y) + pos * stride, stride, lane);
      else
        warp_zero(dst, stride, lane);
    }
  }
  if (remote::any(P.p)) __threadfence_system();  // our rows in c_send, before the proxy's flag
  grid.sync();
  if (blockIdx.x == 0) {
    if (remote::any(P.p)) remote::raise_for_proxy(&P.p.remote.ctrl->c_packed, epoch + 1);
    if (threadIdx.x < g.N && !remote::is_remote(P.p, threadIdx.x)) {
      __threadfence_system();
      ptx::st_release_sys(&flags_of(P.p, threadIdx.x)->c_arrived[me], epoch + 1);
    }
    if (threadIdx.x == 0) {
      ep->c_send = epoch + 1;
      P.handle[0] = static_cast<int32_t>(epoch);
      P.handle[1] = P.p.slot;
    }
  }
}

}  // namespace

cudaError_t launch_combine_send(const CombineSendParams& p, int blocks, cudaStream_t stream) {
  return launch_cooperative(combine_send_kernel, blocks, stream, p);
}

}  // namespace a2a::cuda
