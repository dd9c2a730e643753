// Device helpers shared by the cuda backend's kernels: element conversion, flag waits with
// timeouts, region addressing, 16-byte copies.
#pragma once

#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <cstdio>

#include "gpu/params.h"
#include "gpu/ptx.cuh"

namespace a2a::cuda {

namespace cg = cooperative_groups;

constexpr int kThreads = 512;

// Where the calling thread sits in a 1-D grid: lane, global warp, global thread, strides.
struct GridIdx {
  int lane, gwarp, nwarps;
  int64_t gtid, gstride;
  __device__ GridIdx()
      : lane(threadIdx.x & 31),
        gwarp(static_cast<int>((blockIdx.x * blockDim.x + threadIdx.x) >> 5)),
        nwarps(static_cast<int>((gridDim.x * blockDim.x) >> 5)),
        gtid(int64_t(blockIdx.x) * blockDim.x + threadIdx.x),
        gstride(int64_t(gridDim.x) * blockDim.x) {}
};

__device__ __forceinline__ float load_elem(const void* base, int64_t i, int kind) {
  switch (kind) {
    case 0: return static_cast<const float*>(base)[i];
    case 1: return __bfloat162float(static_cast<const __nv_bfloat16*>(base)[i]);
    case 2: return __half2float(static_cast<const __half*>(base)[i]);
    default: {
      __nv_fp8_e4m3 v;
      v.__x = static_cast<const __nv_fp8_storage_t*>(base)[i];
      return float(v);
    }
  }
}

__device__ __forceinline__ void store_elem(void* base, int64_t i, int kind, float v) {
  switch (kind) {
    case 0: static_cast<float*>(base)[i] = v; break;
    case 1: static_cast<__nv_bfloat16*>(base)[i] = __float2bfloat16_rn(v); break;
    case 2: static_cast<__half*>(base)[i] = __float2half_rn(v); break;
    default:
      static_cast<__nv_fp8_storage_t*>(base)[i] = __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3);
  }
}

// Eight consecutive elements base[i .. i+8) of kind 0 (f32), 1 (bf16) or 2 (f16) as f32, with
// 16-byte volatile loads (no stale L1 lines of a peer-written region; i a multiple of 8, base
// 16-byte aligned).
__device__ __forceinline__ void load_vec8(const void* base, int64_t i, int kind, float v[8]) {
  const uint8_t* b = static_cast<const uint8_t*>(base);
  if (kind == 0) {
    const int4* p = reinterpret_cast<const int4*>(b + i * 4);
    const int4 x = ptx::ld_volatile_v4(p), y = ptx::ld_volatile_v4(p + 1);
    const int w[8] = {x.x, x.y, x.z, x.w, y.x, y.y, y.z, y.w};
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = __int_as_float(w[j]);
    return;
  }
  const int4 x = ptx::ld_volatile_v4(reinterpret_cast<const int4*>(b + i * 2));
  const uint32_t w[4] = {uint32_t(x.x), uint32_t(x.y), uint32_t(x.z), uint32_t(x.w)};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    if (kind == 1) {
      v[2 * j] = __uint_as_float(w[j] << 16);
      v[2 * j + 1] = __uint_as_float(w[j] & 0xffff0000u);
    } else {
      v[2 * j] = __half2float(__ushort_as_half(static_cast<unsigned short>(w[j] & 0xffffu)));
      v[2 * j + 1] = __half2float(__ushort_as_half(static_cast<unsigned short>(w[j] >> 16)));
    }
  }
}

// Stores eight f32 values as kind 0/1/2 at base[i .. i+8) with 16-byte stores (round to nearest even).
__device__ __forceinline__ void store_vec8(void* base, int64_t i, int kind, const float v[8]) {
  if (kind == 0) {
    int4* p = reinterpret_cast<int4*>(static_cast<float*>(base) + i);
    p[0] = make_int4(__float_as_int(v[0]), __float_as_int(v[1]), __float_as_int(v[2]), __float_as_int(v[3]));
    p[1] = make_int4(__float_as_int(v[4]), __float_as_int(v[5]), __float_as_int(v[6]), __float_as_int(v[7]));
    return;
  }
  uint32_t w[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    uint32_t lo, hi;
    if (kind == 1) {
      lo = __bfloat16_as_ushort(__float2bfloat16_rn(v[2 * j]));
      hi = __bfloat16_as_ushort(__float2bfloat16_rn(v[2 * j + 1]));
    } else {
      lo = __half_as_ushort(__float2half_rn(v[2 * j]));
      hi = __half_as_ushort(__float2half_rn(v[2 * j + 1]));
    }
    w[j] = lo | (hi << 16);
  }
  *reinterpret_cast<int4*>(static_cast<uint8_t*>(base) + i * 2) = make_int4(int(w[0]), int(w[1]), int(w[2]), int(w[3]));
}

__device__ __forceinline__ int elem_bytes(int kind) { return kind == 0 ? 4 : kind == 3 ? 1 : 2; }

__device__ __forceinline__ SyncFlags* flags_of(const SlotPtrs& p, int rank) {
  return reinterpret_cast<SyncFlags*>(p.peer_shared[rank]);
}

// 32 bits at a byte address that need not be 4-byte aligned (an fp8 row's scales and its token
// and weight follow its H payload bytes, so they are misaligned when H % 4 != 0). The unaligned
// path is four byte accesses written out: a memcpy there was merged with the aligned branch into
// one 4-byte load (compute-sanitizer: misaligned read in dispatch_recv, H = 30).
__device__ __forceinline__ void store_u32(uint8_t* p, uint32_t v) {
  if ((reinterpret_cast<uintptr_t>(p) & 3) == 0) {
    *reinterpret_cast<uint32_t*>(p) = v;
    return;
  }
  volatile uint8_t* b = p;
  b[0] = uint8_t(v);
  b[1] = uint8_t(v >> 8);
  b[2] = uint8_t(v >> 16);
  b[3] = uint8_t(v >> 24);
}
__device__ __forceinline__ uint32_t load_u32(const uint8_t* p) {
  if ((reinterpret_cast<uintptr_t>(p) & 3) == 0) return *reinterpret_cast<const uint32_t*>(p);
  const volatile uint8_t* b = p;
  return uint32_t(b[0]) | uint32_t(b[1]) << 8 | uint32_t(b[2]) << 16 | uint32_t(b[3]) << 24;
}
__device__ __forceinline__ void store_f32(uint8_t* p, float v) { store_u32(p, __float_as_uint(v)); }
__device__ __forceinline__ float load_f32(const uint8_t* p) { return __uint_as_float(load_u32(p)); }

__device__ __forceinline__ bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

// The calling warp copies `bytes` bytes: 16-byte volatile loads when both ends are 16-byte aligned
// (rows of XLA arrays are not when H * element size % 16 != 0), bytes otherwise. A lane issues four
// 16-byte loads before their stores, so that four loads per lane are in flight.
__device__ __forceinline__ void warp_copy(uint8_t* dst, const uint8_t* src, int64_t bytes, int lane) {
  if (!aligned16(dst) || !aligned16(src)) {
    for (int64_t i = lane; i < bytes; i += 32) dst[i] = src[i];
    return;
  }
  const int64_t nv = bytes / 16;
  const int4* s4 = reinterpret_cast<const int4*>(src);
  int4* d4 = reinterpret_cast<int4*>(dst);
  int64_t i = lane;
  for (; i + 96 < nv; i += 128) {
    const int4 a = ptx::ld_volatile_v4(s4 + i), b = ptx::ld_volatile_v4(s4 + i + 32);
    const int4 c = ptx::ld_volatile_v4(s4 + i + 64), d = ptx::ld_volatile_v4(s4 + i + 96);
    d4[i] = a;
    d4[i + 32] = b;
    d4[i + 64] = c;
    d4[i + 96] = d;
  }
  for (; i < nv; i += 32) d4[i] = ptx::ld_volatile_v4(s4 + i);
  for (int64_t i = nv * 16 + lane; i < bytes; i += 32) dst[i] = src[i];
}

// The calling warp zeroes `bytes` bytes: 16-byte stores when dst is 16-byte aligned (combine rows
// of H * element size % 16 != 0 bytes are not), bytes otherwise.
__device__ __forceinline__ void warp_zero(uint8_t* dst, int64_t bytes, int lane) {
  if (!aligned16(dst)) {
    for (int64_t i = lane; i < bytes; i += 32) dst[i] = 0;
    return;
  }
  const int64_t nv = bytes / 16;
  int4* d4 = reinterpret_cast<int4*>(dst);
  for (int64_t i = lane; i < nv; i += 32) d4[i] = make_int4(0, 0, 0, 0);
  for (int64_t i = nv * 16 + lane; i < bytes; i += 32) dst[i] = 0;
}

// The slot's device-side epoch counters and failure mark, in its private region `priv`.
__device__ __forceinline__ Epochs* epochs_of(const Geometry& g, uint8_t* priv) {
  return reinterpret_cast<Epochs*>(priv + g.off_epochs);
}

// Failure without a trap. A wait that times out records the missing ranks (ErrorRecord, mapped),
// marks the slot failed and returns false; its kernel ends after the next grid sync (every block
// reads the mark there), and every later kernel of the slot ends at once, with its outputs
// poisoned (abandon_dispatch_recv, poison_combine_recv). The host raises the recorded error at the
// next call of any half (RankState::check_error), and the CUDA context stays usable. (A trap here
// left one of four processes sharing a GPU hung with its kernel resident.) The mark is set only
// after a full timeout, so every block of a cooperative grid, resident from the start, reads the
// same value at kernel entry.
__device__ __forceinline__ bool slot_failed(const Geometry& g, const SlotPtrs& p) {
  return *reinterpret_cast<const volatile uint64_t*>(&epochs_of(g, p.priv)->failed) != 0;
}
__device__ __forceinline__ void mark_failed(const Geometry& g, const SlotPtrs& p) {
  *reinterpret_cast<volatile uint64_t*>(&epochs_of(g, p.priv)->failed) = 1;
  __threadfence();
}

// Names of the four halves by op index (ErrorRecord::op).
__device__ __forceinline__ const char* op_name(int op) {
  switch (op & 3) {
    case 0: return "dispatch_send";
    case 1: return "dispatch_recv";
    case 2: return "combine_send";
    default: return "combine_recv";
  }
}

// One thread records a timeout in the mapped error record (missing: bit r = rank r), fields
// first and code last, each made visible to the host before the next.
__device__ inline void record_timeout(const SlotPtrs& p, int op, uint64_t missing) {
  p.err->missing = missing;
  p.err->op = op;
  p.err->slot = p.slot;
  p.err->rank = p.rank;
  __threadfence_system();
  p.err->code = 1;
  __threadfence_system();
}

// Threads 0..N-1 of the calling block each wait until *flag(r) >= want(r); true when all arrived.
// On timeout the missing ranks are recorded in the mapped error record and printed (naming
// `backend`), the slot is marked failed, and every thread of the block gets false.
// `report`: this block prints the timeout (block 0 of a kernel whose every block waits; every
// block that gives up records it and marks the slot failed).
template <typename FlagFn, typename WantFn>
__device__ bool wait_flags_each(const SlotPtrs& p, const Geometry& g, int op, FlagFn flag, WantFn want,
                                const char* backend, bool report = true) {
  __shared__ unsigned long long missing;
  if (threadIdx.x == 0) missing = 0;
  __syncthreads();
  if (threadIdx.x < g.N) {
    const int r = threadIdx.x;
    const uint64_t* f = flag(r);
    const uint64_t w = want(r);
    const uint64_t start = ptx::globaltimer();
    while (ptx::ld_acquire_sys(f) < w) {
      if (ptx::globaltimer() - start > static_cast<uint64_t>(p.timeout_ns)) {
        atomicOr(&missing, 1ull << (r & 63));
        break;
      }
      __nanosleep(64);
    }
  }
  __syncthreads();
  const unsigned long long miss = missing;
  __syncthreads();  // every thread read it before a later wait resets it
  if (miss == 0) return true;
  if (threadIdx.x == 0) {  // every block that gave up marks the slot, so the host always raises
    record_timeout(p, op, miss);
    mark_failed(g, p);
    if (report)
      printf("jax_moe_a2a %s %s (slot %d, rank %d): ranks with bits 0x%llx set never arrived within "
           "%.1f s (crashed process, or calls out of order?)\n",
           backend, op_name(op), p.slot, p.rank, miss, p.timeout_ns * 1e-9);
  }
  return false;
}

// The same wait with one target for every node-local rank (the cuda backend's epoch flags); ranks
// on other nodes are the proxy's (cuda/remote.cuh).
template <typename FlagFn>
__device__ bool wait_flags(const SlotPtrs& p, const Geometry& g, int op, FlagFn flag, uint64_t want,
                           bool report = true) {
  const uint64_t remote = p.remote.mask;
  return wait_flags_each(p, g, op, flag, [want, remote](int r) { return remote >> r & 1 ? 0 : want; }, "cuda",
                         report);
}

// dispatch_send's outputs when the op failed (grid-wide): nothing routed, nothing dropped (the
// drop count feeds stats and debug checks, which must not see garbage).
__device__ inline void abandon_dispatch_send(const DispatchSendParams& P, const GridIdx& ix) {
  const Geometry& g = P.g;
  for (int64_t q = ix.gtid; q < int64_t(g.T) * g.K; q += ix.gstride) {
    P.dest[q] = -1;
    P.pair_slot[q] = 0;
  }
  if (ix.gtid == 0) *P.dropped = 0;
}

// dispatch_recv's outputs when the op failed (grid-wide): no rows, every row unused.
__device__ inline void abandon_dispatch_recv(const DispatchRecvParams& P, const GridIdx& ix) {
  const Geometry& g = P.g;
  const int64_t rows_out = g.layout == 0 ? g.capacity : int64_t(g.L) * g.capacity;
  for (int64_t i = ix.gtid; i < rows_out; i += ix.gstride) {
    P.weights[i] = 0.f;
    P.src[2 * i] = -1;
    P.src[2 * i + 1] = -1;
    P.recv_slot[i] = -1;
  }
  for (int64_t i = ix.gtid; i < int64_t(g.N) * g.L; i += ix.gstride) P.recv_counts[i] = 0;
  for (int64_t i = ix.gtid; i < g.L; i += ix.gstride) P.group_sizes[i] = 0;
  if (ix.gtid == 0) *P.overflow = 0;
}

// combine_recv's outputs when the op failed (grid-wide): NaN everywhere, so that a step whose
// exchange failed cannot pass for a result.
__device__ inline void poison_combine_recv(const CombineRecvParams& P, const GridIdx& ix) {
  const Geometry& g = P.g;
  for (int64_t i = ix.gtid; i < int64_t(g.T) * g.H; i += ix.gstride) store_elem(P.out, i, P.out_kind, __int_as_float(0x7fc00000));
  if (P.pairs)
    for (int64_t i = ix.gtid; i < int64_t(g.T) * g.K * g.H; i += ix.gstride) P.pairs[i] = __int_as_float(0x7fc00000);
}

// combine_recv's reduction, shared by the GPU backends: for every token t of [0, T),
//   out[t, h] = sum_k weights[t, k] * row(t, d, slot)[h] (+ out_in[t, h]), f32 accumulation in k order,
//   pairs[t, k, h] = row(t, d, slot)[h] (0 for pairs not routed and tokens t >= n),
// where q = t * K + k, d = dest[q], slot = pair_slot[q] and row(t, d, slot) is the start of that
// pair's y row (H elements of y_kind, 16-byte aligned). Work items are (token, 256-element segment), one warp each, so that
// a decode batch (T = 128) still spreads over every SM; a lane reduces 8 consecutive elements with
// 16-byte loads and stores. One thread per element when H % 8 != 0 or a buffer is fp8.
constexpr int kReduceVec = 8;
constexpr int kReduceSegment = 32 * kReduceVec;
constexpr int kReduceBatch = 8;

template <typename RowFn>
__device__ void reduce_combine(const CombineRecvParams& P, int n, const GridIdx& ix, RowFn row) {
  const Geometry& g = P.g;
  const bool vec = g.H % kReduceVec == 0 && P.y_kind != 3 && P.out_kind != 3 && (!P.out_in || P.out_in_kind != 3) &&
                   aligned16(P.out) && aligned16(P.out_in) && aligned16(P.pairs);  // XLA's buffers (ours are padded)
  if (vec) {
    const int64_t segs = (g.H + kReduceSegment - 1) / kReduceSegment;
    for (int64_t w = ix.gwarp; w < int64_t(g.T) * segs; w += ix.nwarps) {
      const int t = static_cast<int>(w / segs);
      const int64_t h = (w % segs) * kReduceSegment + int64_t(ix.lane) * kReduceVec;
      const bool on = h < g.H;  // lanes past H only take part in the shuffles below
      float acc[kReduceVec];
#pragma unroll
      for (int i = 0; i < kReduceVec; ++i) acc[i] = 0.f;
      // Pairs in chunks of 32: lane i loads pair i's dest, slot and weight (one round of loads
      // instead of a dependent chain per pair), then kReduceBatch pairs' 16-byte row loads are
      // issued back to back and accumulated in k order.
      for (int kc = 0; kc < g.K; kc += 32) {
        int my_d = -1, my_slot = 0;
        float my_w = 0.f;
        if (kc + ix.lane < g.K && t < n) {
          const int64_t q = int64_t(t) * g.K + kc + ix.lane;
          my_d = P.dest[q];
          if (my_d >= 0 && my_d < g.N) {
            my_slot = P.pair_slot[q];
            my_w = P.weights[q];
          } else {
            my_d = -1;
          }
        }
        const int kn = min(32, g.K - kc);
        for (int k0 = 0; k0 < kn; k0 += kReduceBatch) {
          float v[kReduceBatch][kReduceVec];
          float wt[kReduceBatch];
#pragma unroll
          for (int u = 0; u < kReduceBatch; ++u) {
            const int src = min(k0 + u, 31);
            const int d = __shfl_sync(0xffffffffu, my_d, src);
            const int slot = __shfl_sync(0xffffffffu, my_slot, src);
            wt[u] = __shfl_sync(0xffffffffu, my_w, src);
            if (on && k0 + u < kn && d >= 0) {
              load_vec8(row(t, d, slot), h, P.y_kind, v[u]);
            } else {
              wt[u] = 0.f;
#pragma unroll
              for (int i = 0; i < kReduceVec; ++i) v[u][i] = 0.f;
            }
          }
#pragma unroll
          for (int u = 0; u < kReduceBatch; ++u) {
            if (k0 + u >= kn) break;
#pragma unroll
            for (int i = 0; i < kReduceVec; ++i) acc[i] = fmaf(wt[u], v[u][i], acc[i]);
            if (on && P.pairs) store_vec8(P.pairs, (int64_t(t) * g.K + kc + k0 + u) * g.H + h, 0, v[u]);
          }
        }
      }
      if (!on) continue;
      if (P.out_in) {
        float o[kReduceVec];
        load_vec8(P.out_in, int64_t(t) * g.H + h, P.out_in_kind, o);
#pragma unroll
        for (int i = 0; i < kReduceVec; ++i) acc[i] += o[i];
      }
      store_vec8(P.out, int64_t(t) * g.H + h, P.out_kind, acc);
    }
    return;
  }
  for (int64_t i = ix.gtid; i < int64_t(g.T) * g.H; i += ix.gstride) {
    const int t = static_cast<int>(i / g.H);
    const int64_t h = i % g.H;
    float acc = 0.f;
    for (int k = 0; k < g.K; ++k) {
      const int64_t q = int64_t(t) * g.K + k;
      const int d = t < n ? P.dest[q] : -1;
      float v = 0.f;
      if (d >= 0 && d < g.N) {
        v = load_elem(row(t, d, P.pair_slot[q]), h, P.y_kind);
        acc = fmaf(P.weights[q], v, acc);
      }
      if (P.pairs) P.pairs[q * g.H + h] = v;
    }
    if (P.out_in) acc += load_elem(P.out_in, int64_t(t) * g.H + h, P.out_in_kind);
    store_elem(P.out, int64_t(t) * g.H + h, P.out_kind, acc);
  }
}

// Launches `kernel` on `stream` as `blocks` x kThreads with `smem` bytes of dynamic shared memory
// and the given parameter structs: cooperatively (every block co-resident, for kernels that call
// grid.sync) or as a plain launch (kernels whose blocks never wait for each other).
template <typename... Params>
cudaError_t launch_cooperative(void (*kernel)(Params...), int blocks, size_t smem, cudaStream_t stream,
                               const Params&... params) {
  void* args[] = {const_cast<Params*>(&params)...};
  return cudaLaunchCooperativeKernel(reinterpret_cast<void*>(kernel), blocks, kThreads, args, smem, stream);
}
template <typename... Params>
cudaError_t launch_plain(void (*kernel)(Params...), int blocks, size_t smem, cudaStream_t stream,
                         const Params&... params) {
  void* args[] = {const_cast<Params*>(&params)...};
  return cudaLaunchKernel(reinterpret_cast<void*>(kernel), blocks, kThreads, args, smem, stream);
}

// Every thread of every block calls this once, after its block's work: true in exactly one block,
// the last to get here, which then sees every other block's earlier writes (the fence-and-count
// pattern of a grid barrier, without the waiting). `counter` is zero at kernel entry and the last
// block resets it for the next launch. A block that returns early must not call it, so the
// kernel's closing step (flags, epochs) runs only when every block finished.
__device__ __forceinline__ bool last_block_done(uint32_t* counter) {
  __shared__ bool last;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    last = atomicAdd(counter, 1u) == gridDim.x - 1;
    if (last) {
      *reinterpret_cast<volatile uint32_t*>(counter) = 0;
      __threadfence();
    }
  }
  __syncthreads();
  return last;
}

}  // namespace a2a::cuda
