// EP = 1 dispatch (gpu/local/local.h): dispatch_send's routing and dispatch_recv's layout in one
// kernel, without communication memory. Every block routes the whole batch in its shared memory
// (block_route, as the cuda backend's decode dispatch_send does), writes its share of the small
// outputs, then takes tokens blockIdx.x, + gridDim.x, ...: the token is loaded, quantised or
// copied in registers (gpu/token_chunks.cuh) and stored once per routed pair at the pair's
// canonical output row. At N = 1 a pair's slot j in the receive arrangement is its canonical
// position: ragged row j (dropped at j >= capacity), or expert_major [e][j - start[e]].
#include "gpu/block_route.cuh"
#include "gpu/copy.cuh"
#include "gpu/grid.cuh"
#include "gpu/local/local.h"
#include "gpu/token_chunks.cuh"

namespace a2a::cuda {
namespace {

// Where a token's chunks go (threads < K fill them for each token).
struct LocalTail {
  int32_t pos[kBlockRouteMaxK];  // output row of pair k, -1 when not routed or past the capacity
};

// Output row of the routed pair of expert e with slot j, or -1 past the capacity.
__device__ __forceinline__ int64_t local_pos(const Geometry& g, const BlockRoute& rt, int e, int32_t j) {
  if (g.layout == 0) return j < g.capacity ? int64_t(j) : -1;
  const int32_t within = j - rt.start[e];
  return within < g.capacity ? int64_t(e) * g.capacity + within : -1;
}

// Rows of local expert l the capacity rule keeps (its group size).
__device__ __forceinline__ int32_t local_kept(const Geometry& g, const BlockRoute& rt, int l) {
  if (g.layout == 0) return min(rt.start[l] + rt.cnt[l], g.capacity) - min(rt.start[l], g.capacity);
  return min(rt.cnt[l], g.capacity);
}

// The small outputs from the block's complete routing tables: block 0 writes group_sizes [L],
// recv_counts [1, L], overflow, dropped and the handle; the grid marks every output row no pair
// lands on (weight 0, src (-1, -1), recv_slot -1), as dispatch_recv does.
__device__ void local_small_outputs(const LocalDispatchParams& P, const BlockRoute& rt, int dropped,
                                    const GridIdx& ix) {
  const DispatchRecvParams& R = P.r;
  const Geometry& g = R.g;
  if (blockIdx.x == 0) {
    __shared__ int over;
    if (threadIdx.x == 0) over = 0;
    __syncthreads();
    int mine = 0;
    for (int l = threadIdx.x; l < g.L; l += blockDim.x) {
      const int32_t kept = local_kept(g, rt, l);
      R.recv_counts[l] = rt.cnt[l];
      R.group_sizes[l] = kept;
      mine += rt.cnt[l] - kept;
    }
    for (int off = 16; off > 0; off >>= 1) mine += __shfl_xor_sync(0xffffffffu, mine, off);
    if ((threadIdx.x & 31) == 0 && mine) atomicAdd(&over, mine);
    __syncthreads();
    if (threadIdx.x == 0) {
      *R.overflow = over;  // an integer sum: the same in any order
      *P.s.dropped = dropped;
      P.s.handle[0] = 0;
      P.s.handle[1] = P.s.p.slot;
    }
  }
  const int64_t total = int64_t(rt.start[g.E - 1]) + rt.cnt[g.E - 1];
  const int64_t rows_out = g.layout == 0 ? g.capacity : int64_t(g.L) * g.capacity;
  for (int64_t i = ix.gtid; i < rows_out; i += ix.gstride) {
    const bool used = g.layout == 0 ? i < min(total, int64_t(g.capacity))
                                    : i % g.capacity < local_kept(g, rt, static_cast<int>(i / g.capacity));
    if (used) continue;
    R.weights[i] = 0.f;
    R.src[2 * i] = -1;
    R.src[2 * i + 1] = -1;
    R.recv_slot[i] = -1;
  }
}

template <class Chunks>
__global__ void __launch_bounds__(kThreads) local_dispatch_kernel(LocalDispatchParams P) {
  extern __shared__ __align__(16) uint8_t smem[];
  const DispatchSendParams& S = P.s;
  const DispatchRecvParams& R = P.r;
  const Geometry& g = S.g;
  const GridIdx ix;
  // The block's first token's x goes out before the routing, which runs while it is in flight.
  Chunks ch;
  int t = blockIdx.x;
  if (t < g.T) ch.load(S, t);
  const int n = max(0, min(*S.num_tokens, g.T));
  const BlockRouteSmem lay(g, sizeof(LocalTail));
  const BlockRoute rt(smem, lay, g.L);
  LocalTail* tail = reinterpret_cast<LocalTail*>(smem + lay.off_tail);
  const BlockRouteResult routed = block_route(S, n, rt, true);
  write_route_outputs(S, rt, ix);
  local_small_outputs(P, rt, routed.dropped, ix);

  // Our tokens: threads < K place pair k (its row, and its weight, source and slot outputs),
  // then every thread stores its chunks at each of the token's rows.
  for (; t < n; t += gridDim.x) {
    if (t != static_cast<int>(blockIdx.x)) ch.load(S, t);
    if (threadIdx.x < g.K) {
      const int64_t q = int64_t(t) * g.K + threadIdx.x;
      const int e = rt.pe[q];
      const int32_t j = e >= 0 ? rt.slot_of(t, e) : 0;
      const int64_t pos = e >= 0 ? local_pos(g, rt, e, j) : -1;
      tail->pos[threadIdx.x] = static_cast<int32_t>(pos);
      if (pos >= 0) {
        R.weights[pos] = S.weights[q];
        R.src[2 * pos] = 0;
        R.src[2 * pos + 1] = t;
        R.recv_slot[pos] = j;
      }
    }
    ch.convert(S);
    __syncthreads();
    int32_t rows[kBlockRouteMaxK];  // every row first, then the stores back to back
#pragma unroll
    for (int k = 0; k < kBlockRouteMaxK; ++k) rows[k] = k < g.K ? tail->pos[k] : -1;
#pragma unroll
    for (int k = 0; k < kBlockRouteMaxK; ++k)
      if (rows[k] >= 0)
        ch.store(S, static_cast<uint8_t*>(R.x) + int64_t(rows[k]) * g.payload,
                 reinterpret_cast<uint8_t*>(R.scale + int64_t(rows[k]) * g.S));
    if (t + static_cast<int>(gridDim.x) < n) __syncthreads();  // tail is rewritten for the next token
  }
}

bool aligned16_host(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

int64_t local_smem_bytes(const Geometry& g) { return BlockRouteSmem(g, sizeof(LocalTail)).bytes; }

}  // namespace

int local_dispatch_kind(const LocalDispatchParams& p) {
  const Geometry& g = p.s.g;
  if (g.N != 1 || g.tp != 1 || g.K > kBlockRouteMaxK || local_smem_bytes(g) > kBlockRoutingSmem) return -1;
  if (!aligned16_host(p.s.x) || !aligned16_host(p.r.x) || g.payload % 16 != 0) return -1;
  if (g.wire_kind == 3 && p.r.scale == nullptr) return -1;
  return regs_chunk_kind(g, p.s.x_kind, p.s.x_scale != nullptr);
}

cudaError_t launch_local_dispatch(const LocalDispatchParams& p, int kind, int blocks, cudaStream_t stream) {
  const size_t smem = static_cast<size_t>(local_smem_bytes(p.s.g));
  switch (kind) {
    case 0: return launch_plain(local_dispatch_kernel<QuantChunks<0>>, blocks, smem, stream, p);
    case 1: return launch_plain(local_dispatch_kernel<QuantChunks<1>>, blocks, smem, stream, p);
    case 2: return launch_plain(local_dispatch_kernel<QuantChunks<2>>, blocks, smem, stream, p);
    default: return launch_plain(local_dispatch_kernel<CopyChunks>, blocks, smem, stream, p);
  }
}

}  // namespace a2a::cuda
