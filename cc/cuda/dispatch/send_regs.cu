// dispatch send, block-routed, the token staged in registers: the decode fast path. Taken when
// the block-routed kernel applies (cuda/dispatch/send.cu, use_block_routing) and the token's wire
// row splits into 16-byte chunks that the block's threads hold (gpu/token_chunks.cuh: fp8
// quantisation of f32 / bf16 / f16 x, or a copy of x already in the wire dtype; regs_staging_kind
// below).
//
// Why (2026-12-01 profile of the shared-memory kernel, notes/benchmarks.md): its x loads waited
// until the routing was done, its ids were deduplicated with dependent loads, and the row went
// register -> shared -> register -> global behind a barrier. Here the block's first token's x
// loads, its ids and the peers' free flags are all issued at entry; the routing (shared memory)
// runs while they are in flight, and each thread then writes its chunks straight to each of the
// token's destinations: 16-byte stores, one barrier after the routing, one per later token.
#include "cuda/device.cuh"
#include "cuda/dispatch/block_send.cuh"
#include "cuda/kernels.h"
#include "gpu/block_route.cuh"
#include "gpu/copy.cuh"
#include "gpu/elems.cuh"
#include "gpu/failure.cuh"
#include "gpu/grid.cuh"
#include "gpu/kernel.cuh"
#include "gpu/route.cuh"
#include "gpu/token_chunks.cuh"

namespace a2a::cuda {
using namespace ::a2a::gpu;  // the shared device library (cc/gpu)
namespace {

// Where each thread's chunks go: the token's destination rows and router weights (threads < K
// fill them for each token).
struct RegsTail {
  uint8_t* dst[kBlockRouteMaxK];  // row of pair k at its destination, null when not routed
  float w[kBlockRouteMaxK];
};

template <class Chunks>
__global__ void __launch_bounds__(kThreads) dispatch_send_regs_kernel(DispatchSendParams P) {
  extern __shared__ __align__(16) uint8_t smem[];
  A2A_KERNEL_START(P);
  // 0. Everything this block reads first goes out at once, before the slot check: its first
  // token's x (registers; rows t < T exist whatever num_tokens says), the peers' free flags
  // (threads < N; acquire, so a flag seen set orders our later row writes), the token count.
  Chunks ch;
  int t = blockIdx.x;
  if (t < g.T) ch.load(P, t);
  const uint64_t out = masked_ranks(g, P.p);  // elastic EP: ranks we neither wait for nor write to
  const FreeDue due = free_due(g, P.p, Half::kDispatchSend, epoch);  // ... and the FREE flag the others owe us
  const bool free_now = free_set_now(g, [&](int r) { return &flags_of(P.p, me)->d_free[r]; }, due, out);
  const int n = max(0, min(*P.num_tokens, g.T));
  const BlockRouteSmem lay(g, sizeof(RegsTail));
  const BlockRoute rt(smem, lay, g.L);
  RegsTail* tail = reinterpret_cast<RegsTail*>(smem + lay.off_tail);
  if (slot_failed(g, P.p)) {  // an earlier op of this slot failed: the host raises it
    abandon_dispatch_send(P, ix);
    return;
  }

  // 1. Routing in shared memory while those loads are in flight, dest, pair_slot, drops; 2. a
  // peer still reading our previous rows: wait for it (with the timeout) before overwriting.
  if (!block_route_and_wait(P, n, rt, free_now, ix, due, out, epoch)) return;

  // 3. Our tokens t = blockIdx.x, + gridDim.x, ...: threads < K find the pair's destination row;
  // every thread writes its chunks to each of them, thread k the token and weight after pair k's body.
  const int64_t body = g.payload + 4 * int64_t(g.S);
  for (; t < n; t += gridDim.x) {
    if (t != static_cast<int>(blockIdx.x)) ch.load(P, t);
    if (threadIdx.x < g.K) {
      const int64_t q = int64_t(t) * g.K + threadIdx.x;
      const int e = rt.pe[q];
      tail->dst[threadIdx.x] =
          e >= 0 ? block_dest_row(P, e / g.L, rt.slot_of(t, e)) : nullptr;
      tail->w[threadIdx.x] = P.weights[q];
    }
    ch.convert(P);
    __syncthreads();
    uint8_t* rows[kBlockRouteMaxK];  // all destinations first, then the stores back to back
#pragma unroll
    for (int k = 0; k < kBlockRouteMaxK; ++k) rows[k] = k < g.K ? tail->dst[k] : nullptr;
#pragma unroll
    for (int k = 0; k < kBlockRouteMaxK; ++k)
      if (rows[k] != nullptr) ch.store(P, rows[k], rows[k] + g.payload);
    if (threadIdx.x < g.K && tail->dst[threadIdx.x] != nullptr) {
      uint8_t* row = tail->dst[threadIdx.x];
      store_u32(row + body, static_cast<uint32_t>(t));
      store_f32(row + body + 4, tail->w[threadIdx.x]);
    }
    if (t + static_cast<int>(gridDim.x) < n) __syncthreads();  // tail is rewritten for the next token
  }

  // 4. Our counts column into every peer; the last block raises the arrival flags.
  close_block_send(P, rt, ep, epoch, due, out);
}

bool aligned16_host(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

}  // namespace

ChunkKind regs_staging_kind(const DispatchSendParams& p) {
  const Geometry& g = p.g;
  if (!aligned16_host(p.x) || g.row % 16 != 0 || g.off_rows % 16 != 0) return ChunkKind{};
  for (int d = 0; d < g.N; ++d)
    if (!aligned16_host(p.p.remote.mask >> (d & 63) & 1 ? p.p.remote.d_send : p.p.peer_shared[d])) return ChunkKind{};
  if (block_routing_smem_bytes_regs(g) > kBlockRoutingSmem) return ChunkKind{};
  return regs_chunk_kind(g, p.x_kind, p.x_scale != nullptr);
}

int64_t block_routing_smem_bytes_regs(const Geometry& g) { return BlockRouteSmem(g, sizeof(RegsTail)).bytes; }

cudaError_t launch_dispatch_send_regs(const DispatchSendParams& p, ChunkKind kind, int blocks, cudaStream_t stream) {
  const size_t smem = static_cast<size_t>(block_routing_smem_bytes_regs(p.g));
  return with_chunk_kind(kind, [&](auto chunks) {
    return launch_plain(dispatch_send_regs_kernel<decltype(chunks)>, blocks, smem, stream, p);
  });
}

void dispatch_send_regs_kernels(const Geometry& g, std::vector<KernelRef>* out) {
  const size_t smem = static_cast<size_t>(block_routing_smem_bytes_regs(g));
  using How = ChunkKind::How;
  const ChunkKind kinds[] = {{How::kQuantize, ElemKind::kF32}, {How::kQuantize, ElemKind::kBF16},
                             {How::kQuantize, ElemKind::kF16}, {How::kCopy, ElemKind::kF32}};
  const char* names[] = {"dispatch_send (block-routed, registers: f32 to fp8)",
                         "dispatch_send (block-routed, registers: bf16 to fp8)",
                         "dispatch_send (block-routed, registers: f16 to fp8)",
                         "dispatch_send (block-routed, registers: copy)"};
  for (int i = 0; i < 4; ++i)
    with_chunk_kind(kinds[i], [&](auto chunks) {
      out->push_back({names[i], reinterpret_cast<const void*>(&dispatch_send_regs_kernel<decltype(chunks)>), smem, kThreads, false});
      return 0;
    });
}

}  // namespace a2a::cuda
