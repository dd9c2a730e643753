// nvshmem dispatch recv: wait for every source's meta block (d_meta), lay out the arrangement
// from its counts, wait until every source's rows have landed (d_rows reaches what we consumed
// before plus the rows it announced), copy the rows out canonically (local expert, source,
// token) with the capacity rule, then tell every source its region is free (d_free).
#include "nvshmem/device.cuh"
#include "nvshmem/kernels.h"

namespace a2a::nvshmem {
namespace {

__global__ void __launch_bounds__(cuda::kThreads) dispatch_recv_kernel(cuda::DispatchRecvParams P, NvSlot nv) {
  const Geometry& g = P.g;
  const Layout& lay = nv.lay;
  cuda::cg::grid_group grid = cuda::cg::this_grid();
  const cuda::GridIdx ix;
  const int me = P.p.rank;
  const uint64_t epoch = static_cast<uint64_t>(P.handle[0]);
  Signals* mine = signals_at(P.p, me);
  int64_t* arr_scratch = cuda::arrangement_scratch(g, P.p.priv);
  const cuda::Arrangement a = cuda::arrangement_view(g, arr_scratch);

  if (cuda::slot_failed(g, P.p)) {  // an earlier op of this slot failed: the host raises it
    cuda::abandon_dispatch_recv(P, ix);
    return;
  }
  if (blockIdx.x == 0 && wait_signals(P.p, g, 1, [&](int r) { return &mine->d_meta[r]; }, [&](int) { return epoch + 1; })) {
    for (int64_t i = threadIdx.x; i < int64_t(g.N) * g.L; i += blockDim.x)
      P.recv_counts[i] = meta_at(P.p, lay, me, i / g.L)[i % g.L];
    __syncthreads();
    if (threadIdx.x == 0) cuda::compute_arrangement(g, P.recv_counts, arr_scratch, P.group_sizes, P.overflow);
    __syncthreads();
    uint64_t* consumed = seen(P.p, lay, 0, g);
    if (wait_signals(P.p, g, 1, [&](int r) { return &mine->d_rows[r]; },
                     [&](int r) { return consumed[r] + static_cast<uint64_t>(a.rows_from[r]); }) &&
        threadIdx.x < g.N)
      consumed[threadIdx.x] += static_cast<uint64_t>(a.rows_from[threadIdx.x]);
  }
  const int64_t rows_out = g.layout == 0 ? g.capacity : int64_t(g.L) * g.capacity;
  for (int64_t i = ix.gtid; i < rows_out; i += ix.gstride) {  // rows past the counts: weight 0, src -1
    P.weights[i] = 0.f;
    P.src[2 * i] = -1;
    P.src[2 * i + 1] = -1;
    P.recv_slot[i] = -1;
  }
  grid.sync();
  if (cuda::slot_failed(g, P.p)) {
    cuda::abandon_dispatch_recv(P, ix);
    return;
  }
  for (int64_t w = ix.gwarp; w < int64_t(g.N) * g.P; w += ix.nwarps) {  // warp per received row (s, j)
    const int s = w / g.P;
    const int64_t j = w % g.P;
    if (j >= a.rows_from[s]) continue;
    int l;
    const int64_t pos = cuda::row_position(g, a, s, j, &l);
    if (pos < 0) continue;
    const uint8_t* row = P.p.peer_shared[me] + lay.off_rows + (int64_t(s) * g.P + j) * g.row;
    cuda::warp_copy(static_cast<uint8_t*>(P.x) + pos * g.payload, row, g.payload, ix.lane);
    if (P.scale)
      for (int b = ix.lane; b < g.S; b += 32) P.scale[pos * g.S + b] = cuda::load_f32(row + g.payload + 4 * b);
    if (ix.lane == 0) {
      const int32_t* m = meta_at(P.p, lay, me, s) + g.L + 2 * j;
      P.weights[pos] = __int_as_float(m[1]);
      P.src[2 * pos] = s;
      P.src[2 * pos + 1] = m[0];
      P.recv_slot[pos] = static_cast<int32_t>(j);
    }
  }
  grid.sync();
  if (blockIdx.x == 0 && threadIdx.x < g.N)  // sources may overwrite their rows and meta now
    nvshmemx_signal_op(&signals_at(P.p, threadIdx.x)->d_free[me], epoch + 1, NVSHMEM_SIGNAL_SET, nv.pe[threadIdx.x]);
}

}  // namespace

cudaError_t launch_dispatch_recv(const cuda::DispatchRecvParams& p, const NvSlot& nv, int blocks, cudaStream_t stream) {
  return cuda::launch_cooperative(dispatch_recv_kernel, blocks, stream, p, nv);
}

}  // namespace a2a::nvshmem
