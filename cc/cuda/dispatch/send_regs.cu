// dispatch send, block-routed, the token staged in registers: the decode fast path. Taken when
// the block-routed kernel applies (cuda/dispatch/send.cu, use_block_routing) and the token's wire
// row splits into 16-byte chunks that the block's threads hold (regs_staging_kind below):
//   - fp8 quantisation of f32 / bf16 / f16 x: a chunk is 16 values -> 16 fp8 bytes, the scale
//     block's lanes (scale_block / 16 of them, a power of two) share one f32 scale;
//   - a copy when x is already in the wire dtype (pre-quantised fp8 brings its scales).
// Chunk c of the payload is thread c % blockDim's, i = c / blockDim of its kChunks registers.
//
// Why (2026-12-01 profile of the shared-memory kernel, docs/benchmarks.md): its x loads waited
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

namespace a2a::cuda {
namespace {

// Where each thread's chunks go: the token's destination rows and router weights (threads < K
// fill them for each token).
struct RegsTail {
  uint8_t* dst[kBlockRouteMaxK];  // row of pair k at its destination, null when not routed
  float w[kBlockRouteMaxK];
};

__device__ __forceinline__ int chunk_of(int i) { return threadIdx.x + i * blockDim.x; }

// fp8 quantisation of x of kind XK (0 f32, 1 bf16, 2 f16) in registers. Chunk c holds values
// [16c, 16c + 16) of the token, scale block c / lpb (lpb = scale_block / 16 lanes, a power of two
// <= 32, so a scale block's lanes are aligned within a warp). The same arithmetic as stage_rows'
// vector path (gpu/route.cuh): amax over the block, fp8_block_scale, x * (1 / scale) rounded
// to e4m3 with saturation.
template <int XK>
struct QuantChunks {
  static constexpr int kChunks = 2;  // payload <= 2 * 16 * blockDim bytes
  int4 raw[kChunks][2][2];           // [chunk][half of 16 values][load_raw8's vectors]
  uint4 q[kChunks];
  float scale[kChunks];

  __device__ void load(const DispatchSendParams& P, int t) {
    const uint8_t* x = static_cast<const uint8_t*>(P.x) + int64_t(t) * P.g.H * (XK == 0 ? 4 : 2);
#pragma unroll
    for (int i = 0; i < kChunks; ++i) {
      const int64_t h = int64_t(chunk_of(i)) * 16;
      if (h < P.g.H) {
        load_raw8<XK>(x, h, raw[i][0]);
        load_raw8<XK>(x, h + 8, raw[i][1]);
      } else {
        raw[i][0][0] = raw[i][0][1] = raw[i][1][0] = raw[i][1][1] = make_int4(0, 0, 0, 0);
      }
    }
  }
  __device__ void convert(const DispatchSendParams& P) {
    const int lpb = P.g.scale_block / 16;
#pragma unroll
    for (int i = 0; i < kChunks; ++i) {  // every lane runs every step: the shuffles need the warp
      float v[16];
      raw8_to_f32<XK>(raw[i][0], v);
      raw8_to_f32<XK>(raw[i][1], v + 8);
      float amax = 0.f;  // chunks past the end hold zeros
#pragma unroll
      for (int j = 0; j < 16; ++j) amax = fmaxf(amax, fabsf(v[j]));
      amax = group_max(amax, lpb, threadIdx.x & 31);  // lpb a power of two: xor shuffles
      const float sc = fp8_block_scale(amax, P.g.pow2 != 0);
      const float inv = __frcp_rn(sc);
      uint32_t w[4] = {0u, 0u, 0u, 0u};
#pragma unroll
      for (int j = 0; j < 16; ++j)
        w[j / 4] |= uint32_t(__nv_cvt_float_to_fp8(__fmul_rn(v[j], inv), __NV_SATFINITE, __NV_E4M3)) << (8 * (j % 4));
      q[i] = make_uint4(w[0], w[1], w[2], w[3]);
      scale[i] = sc;
    }
  }
  __device__ void store(const DispatchSendParams& P, uint8_t* row) const {
    const int lpb = P.g.scale_block / 16;
#pragma unroll
    for (int i = 0; i < kChunks; ++i) {
      const int c = chunk_of(i);
      if (int64_t(c) * 16 >= P.g.H) continue;
      *reinterpret_cast<uint4*>(row + int64_t(c) * 16) = q[i];
      if (c % lpb == 0) store_f32(row + P.g.payload + 4 * int64_t(c / lpb), scale[i]);
    }
  }
};

// x already in the wire dtype: its payload bytes in 16-byte chunks, and (pre-quantised fp8) the
// S scales from x_scale, scale b in thread b.
struct CopyChunks {
  static constexpr int kChunks = 4;  // payload <= 4 * 16 * blockDim bytes
  int4 v[kChunks];
  float scale;

  __device__ void load(const DispatchSendParams& P, int t) {
    const int4* x = reinterpret_cast<const int4*>(static_cast<const uint8_t*>(P.x) + int64_t(t) * P.g.payload);
#pragma unroll
    for (int i = 0; i < kChunks; ++i)
      if (int64_t(chunk_of(i)) * 16 < P.g.payload) v[i] = __ldg(x + chunk_of(i));
    if (P.g.wire_kind == 3 && threadIdx.x < P.g.S) scale = __ldg(P.x_scale + int64_t(t) * P.g.S + threadIdx.x);
  }
  __device__ void convert(const DispatchSendParams&) {}
  __device__ void store(const DispatchSendParams& P, uint8_t* row) const {
#pragma unroll
    for (int i = 0; i < kChunks; ++i)
      if (int64_t(chunk_of(i)) * 16 < P.g.payload) reinterpret_cast<int4*>(row)[chunk_of(i)] = v[i];
    if (P.g.wire_kind == 3 && threadIdx.x < P.g.S) store_f32(row + P.g.payload + 4 * int64_t(threadIdx.x), scale);
  }
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
  const bool free_now = flag_set_now(g, [&](int r) { return &flags_of(P.p, me)->d_free[r]; }, epoch);
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
  if (!block_route_and_wait(P, n, rt, free_now, ix, epoch)) return;

  // 3. Our tokens t = blockIdx.x, + gridDim.x, ...: threads < K find the pair's destination row;
  // every thread writes its chunks to each of them, thread k the token and weight after pair k's body.
  const int64_t body = g.payload + 4 * int64_t(g.S);
  for (; t < n; t += gridDim.x) {
    if (t != static_cast<int>(blockIdx.x)) ch.load(P, t);
    if (threadIdx.x < g.K) {
      const int64_t q = int64_t(t) * g.K + threadIdx.x;
      const int e = rt.pe[q];
      tail->dst[threadIdx.x] =
          e >= 0 ? P.p.peer_shared[e / g.L] + g.off_rows + (int64_t(me) * g.P + rt.slot_of(t, e)) * g.row : nullptr;
      tail->w[threadIdx.x] = P.weights[q];
    }
    ch.convert(P);
    __syncthreads();
    uint8_t* rows[kBlockRouteMaxK];  // all destinations first, then the stores back to back
#pragma unroll
    for (int k = 0; k < kBlockRouteMaxK; ++k) rows[k] = k < g.K ? tail->dst[k] : nullptr;
#pragma unroll
    for (int k = 0; k < kBlockRouteMaxK; ++k)
      if (rows[k] != nullptr) ch.store(P, rows[k]);
    if (threadIdx.x < g.K && tail->dst[threadIdx.x] != nullptr) {
      uint8_t* row = tail->dst[threadIdx.x];
      store_u32(row + body, static_cast<uint32_t>(t));
      store_f32(row + body + 4, tail->w[threadIdx.x]);
    }
    if (t + static_cast<int>(gridDim.x) < n) __syncthreads();  // tail is rewritten for the next token
  }

  // 4. Our counts column into every peer; the last block raises the arrival flags.
  close_block_send(P, rt, ep, epoch);
}

bool aligned16_host(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

}  // namespace

int regs_staging_kind(const DispatchSendParams& p) {
  const Geometry& g = p.g;
  if (!aligned16_host(p.x) || g.row % 16 != 0 || g.off_rows % 16 != 0) return -1;
  for (int d = 0; d < g.N; ++d)
    if (!aligned16_host(p.p.peer_shared[d])) return -1;
  if (block_routing_smem_bytes_regs(g) > kBlockRoutingSmem) return -1;
  const int64_t threads = kThreads;
  if (g.wire_kind == 3 && p.x_kind >= 0 && p.x_kind <= 2) {  // quantise
    const int lpb = g.scale_block / 16;
    const bool pow2_lanes = lpb >= 1 && lpb <= 32 && (lpb & (lpb - 1)) == 0 && g.scale_block % 16 == 0;
    const bool fits = g.H % 16 == 0 && g.H <= QuantChunks<1>::kChunks * 16 * threads;
    return pow2_lanes && fits ? p.x_kind : -1;
  }
  if (p.x_kind == g.wire_kind) {  // copy
    const bool scales_ok = g.wire_kind != 3 || (p.x_scale != nullptr && g.S <= threads);
    const bool fits = g.payload % 16 == 0 && g.payload <= CopyChunks::kChunks * 16 * threads;
    return scales_ok && fits ? 3 : -1;
  }
  return -1;
}

int64_t block_routing_smem_bytes_regs(const Geometry& g) { return BlockRouteSmem(g, sizeof(RegsTail)).bytes; }

cudaError_t launch_dispatch_send_regs(const DispatchSendParams& p, int kind, int blocks, cudaStream_t stream) {
  const size_t smem = static_cast<size_t>(block_routing_smem_bytes_regs(p.g));
  switch (kind) {
    case 0: return launch_plain(dispatch_send_regs_kernel<QuantChunks<0>>, blocks, smem, stream, p);
    case 1: return launch_plain(dispatch_send_regs_kernel<QuantChunks<1>>, blocks, smem, stream, p);
    case 2: return launch_plain(dispatch_send_regs_kernel<QuantChunks<2>>, blocks, smem, stream, p);
    default: return launch_plain(dispatch_send_regs_kernel<CopyChunks>, blocks, smem, stream, p);
  }
}

}  // namespace a2a::cuda
