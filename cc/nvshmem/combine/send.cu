// nvshmem combine send: put each received row's expert output back at its source, at the slot
// the source chose, for every member of the source's tp group (put-with-signal, +1 on
// c_rows[me] there); zeros for rows the capacity rule dropped. No closing signal: receivers
// count rows.
#include "nvshmem/device.cuh"
#include "nvshmem/kernels.h"

namespace a2a::nvshmem {
namespace {

__global__ void __launch_bounds__(cuda::kThreads) combine_send_kernel(cuda::CombineSendParams P, NvSlot nv) {
  const Geometry& g = P.g;
  const Layout& lay = nv.lay;
  cuda::cg::grid_group grid = cuda::cg::this_grid();
  const cuda::GridIdx ix;
  const int me = P.p.rank;
  cuda::Epochs* ep = cuda::epochs_of(g, P.p.priv);
  const uint64_t epoch = ep->c_send;
  int64_t* arr_scratch = cuda::arrangement_scratch(g, P.p.priv);

  if (cuda::slot_failed(g, P.p)) return;  // an earlier op of this slot failed: the host raises it
  // Every source must have reduced our previous rows before we overwrite them.
  if (blockIdx.x == 0 &&
      wait_signals(P.p, g, 2, [&](int r) { return &signals_at(P.p, me)->c_free[r]; }, [&](int) { return epoch; }) &&
      threadIdx.x == 0)
    cuda::compute_arrangement(g, P.recv_counts, arr_scratch, nullptr, nullptr);
  grid.sync();
  if (cuda::slot_failed(g, P.p)) return;
  const cuda::Arrangement a = cuda::arrangement_view(g, arr_scratch);
  const int64_t stride = int64_t(g.H) * cuda::elem_bytes(P.y_kind);
  const uint8_t* zero = P.p.priv + lay.off_zero;  // [H * 4] zeros, never written
  for (int64_t w = ix.gwarp; w < int64_t(g.N) * g.P; w += ix.nwarps) {  // warp per row (source s, slot j)
    const int s = w / g.P;
    const int64_t j = w % g.P;
    if (j >= a.rows_from[s]) continue;
    int l;
    const int64_t pos = cuda::row_position(g, a, s, j, &l);
    const uint8_t* src = pos >= 0 ? static_cast<const uint8_t*>(P.y) + pos * stride : zero;
    const int g0 = s / g.tp * g.tp;
    for (int m = g0; m < g0 + g.tp; ++m)
      put_row_signal(P.p.peer_shared[m] + lay.off_c_rows + ((int64_t(me) * g.tp + s % g.tp) * g.P + j) * stride, src,
                     stride, &signals_at(P.p, m)->c_rows[me], nv.pe[m]);
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    ep->c_send = epoch + 1;
    P.handle[0] = static_cast<int32_t>(epoch);
    P.handle[1] = P.p.slot;
  }
}

}  // namespace

cudaError_t launch_combine_send(const cuda::CombineSendParams& p, const NvSlot& nv, int blocks, cudaStream_t stream) {
  return cuda::launch_cooperative(combine_send_kernel, blocks, stream, p, nv);
}

}  // namespace a2a::nvshmem
