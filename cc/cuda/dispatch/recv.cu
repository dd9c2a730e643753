// dispatch recv: wait for every source's arrival flag, lay the rows out canonically (local
// expert, source, token) with the capacity rule, then free the sources' rows.
#include "cuda/common.cuh"
#include "cuda/kernels.h"
#include "cuda/remote.cuh"

namespace a2a::cuda {
namespace {

__global__ void __launch_bounds__(kThreads) dispatch_recv_kernel(DispatchRecvParams P) {
  const Geometry& g = P.g;
  cg::grid_group grid = cg::this_grid();
  const GridIdx ix;
  const int lane = ix.lane, gwarp = ix.gwarp, nwarps = ix.nwarps;
  const int64_t gtid = ix.gtid, gstride = ix.gstride;
  const int me = P.p.rank;
  const uint64_t epoch = static_cast<uint64_t>(P.handle[0]);
  SyncFlags* mine = flags_of(P.p, me);
  int64_t* arr_scratch = arrangement_scratch(g, P.p.priv);
  const int32_t* counts = reinterpret_cast<const int32_t*>(P.p.peer_shared[me] + g.off_counts);

  if (slot_failed(g, P.p)) {  // an earlier op of this slot failed: the host raises it
    abandon_dispatch_recv(P, ix);
    return;
  }
  if (blockIdx.x == 0 && remote::wait_peers(P.p, g, 1, [&](int r) { return &mine->d_arrived[r]; }, epoch + 1,
                                            &P.p.remote.ctrl->d_landed, epoch + 1)) {
    if (threadIdx.x == 0) {
      if (remote::any(P.p)) remote::pull_remote_counts(P.p, g, const_cast<int32_t*>(counts));
      compute_arrangement(g, counts, arr_scratch, P.group_sizes, P.overflow);
    }
  }
  const int64_t rows_out = g.layout == 0 ? g.capacity : int64_t(g.L) * g.capacity;
  for (int64_t i = gtid; i < rows_out; i += gstride) {  // rows past the counts: weight 0, src -1
    P.weights[i] = 0.f;
    P.src[2 * i] = -1;
    P.src[2 * i + 1] = -1;
    P.recv_slot[i] = -1;
  }
  grid.sync();
  if (slot_failed(g, P.p)) {
    abandon_dispatch_recv(P, ix);
    return;
  }
  for (int64_t i = gtid; i < int64_t(g.N) * g.L; i += gstride) P.recv_counts[i] = counts[i];
  const Arrangement a = arrangement_view(g, arr_scratch);
  // Warp per received row (source s, slot j).
  for (int64_t w = gwarp; w < int64_t(g.N) * g.P; w += nwarps) {
    const int s = w / g.P;
    const int64_t j = w % g.P;
    if (j >= a.rows_from[s]) continue;
    int l;
    const int64_t pos = row_position(g, a, s, j, &l);
    if (pos < 0) continue;
    const uint8_t* row = remote::is_remote(P.p, s) ? remote::landed_row(P.p, g, s, j)
                                                   : P.p.peer_shared[me] + g.off_rows + (int64_t(s) * g.P + j) * g.row;
    warp_copy(static_cast<uint8_t*>(P.x) + pos * g.payload, row, g.payload, lane);
    if (P.scale)
      for (int b = lane; b < g.S; b += 32) P.scale[pos * g.S + b] = load_f32(row + g.payload + 4 * b);
    if (lane == 0) {
      const int32_t tok = static_cast<int32_t>(load_u32(row + g.payload + 4 * int64_t(g.S)));
      const float wt = load_f32(row + g.payload + 4 * int64_t(g.S) + 4);
      P.weights[pos] = wt;
      P.src[2 * pos] = s;
      P.src[2 * pos + 1] = tok;
      P.recv_slot[pos] = static_cast<int32_t>(j);
    }
  }
  grid.sync();
  if (blockIdx.x == 0) {  // sources may reuse their rows here
    if (threadIdx.x < g.N && !remote::is_remote(P.p, threadIdx.x))
      ptx::st_release_sys(&flags_of(P.p, threadIdx.x)->d_free[me], epoch + 1);
    if (remote::any(P.p)) remote::raise_for_proxy(&P.p.remote.ctrl->d_consumed, epoch + 1);
  }
}

}  // namespace

cudaError_t launch_dispatch_recv(const DispatchRecvParams& p, int blocks, cudaStream_t stream) {
  return launch_cooperative(dispatch_recv_kernel, blocks, stream, p);
}

}  // namespace a2a::cuda
