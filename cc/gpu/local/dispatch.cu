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
#include "gpu/local/outputs.cuh"
#include "gpu/token_chunks.cuh"

namespace a2a::cuda {
namespace {

template <class Chunks, bool kDequant>
__global__ void __launch_bounds__(kThreads) local_dispatch_kernel(LocalDispatchParams P) {
  extern __shared__ __align__(16) uint8_t smem[];
  const DispatchSendParams& S = P.s;
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
      local_place(P, tail, t, threadIdx.x, q, j, e >= 0 ? local_pos(g, rt, e, j) : -1);
    }
    local_store_rows<kDequant>(P, tail, ch);
    if (t + static_cast<int>(gridDim.x) < n) __syncthreads();  // tail is rewritten for the next token
  }
}

bool aligned16_host(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

int64_t local_smem_bytes(const Geometry& g) { return BlockRouteSmem(g, sizeof(LocalTail)).bytes; }

// Shared memory one block may opt in to on the current device (227 KiB on Hopper), cached.
int64_t max_block_smem() {
  static int cache[64] = {};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return 48 * 1024;
  if (dev >= 0 && dev < 64 && cache[dev] > 0) return cache[dev];
  int v = 0;
  if (cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess || v <= 0) v = 48 * 1024;
  if (dev >= 0 && dev < 64) cache[dev] = v;
  return v;
}

}  // namespace

int local_dispatch_kind(const LocalDispatchParams& p) {
  const Geometry& g = p.s.g;
  if (g.N != 1 || g.tp != 1 || g.K > kBlockRouteMaxK) return -1;
  if (!aligned16_host(p.s.x) || !aligned16_host(p.r.x) || g.payload % 16 != 0) return -1;
  const bool dequant = p.r.x_kind != g.wire_kind;  // fp8 rows dequantised on receive: no scale output
  if (g.wire_kind == 3 && !dequant && p.r.scale == nullptr) return -1;
  const int kind = regs_chunk_kind(g, p.s.x_kind, p.s.x_scale != nullptr);
  if (dequant && kind == 3) return -1;  // pre-quantised x: a chunk's scale is another thread's (CopyChunks)
  if (kind < 0 || local_smem_bytes(g) <= kBlockRoutingSmem) return kind;
  return local_dispatch_grid_fits(p, max_block_smem()) ? kind + kLocalGridRouted : -1;
}

cudaError_t launch_local_dispatch(const LocalDispatchParams& p, int kind, int blocks, cudaStream_t stream) {
  if (kind >= kLocalGridRouted) return launch_local_dispatch_grid(p, kind - kLocalGridRouted, blocks, stream);
  const size_t smem = static_cast<size_t>(local_smem_bytes(p.s.g));
  return with_chunk_kind(kind, [&](auto chunks) {
    using Chunks = decltype(chunks);
    if constexpr (Chunks::kQuantizes)
      if (p.r.x_kind != p.s.g.wire_kind) return launch_plain(local_dispatch_kernel<Chunks, true>, blocks, smem, stream, p);
    return launch_plain(local_dispatch_kernel<Chunks, false>, blocks, smem, stream, p);
  });
}

}  // namespace a2a::cuda
