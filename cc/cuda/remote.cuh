// Device side of the cuda backend's inter-node path: what the kernels do for peers on other nodes.
// Their rows go through the buffers of RemotePtrs (GPU memory where the engine registers it, else
// mapped pinned host memory; the count matrices always mapped host memory) that the rank's proxy
// thread (cc/proxy) moves with the TransferEngine; kernels and proxy talk through the flags of
// SlotCtrl (see cc/core/ctrl.h for the sequence). The kernels write theirs to
// p.remote.ctrl (host memory) and read the proxy's from p.remote.in (host memory too, or GPU
// memory when the proxy writes through GDRCopy). Every helper is a no-op when
// p.remote.mask == 0 (all peers node-local).
#pragma once

#include "cuda/device.cuh"
#include "gpu/failure.cuh"
#include "gpu/ptx.cuh"
#include "gpu/wait.cuh"
#include "core/ctrl.h"

namespace a2a::cuda::remote {
using namespace ::a2a::gpu;  // the shared device library (cc/gpu)

__device__ __forceinline__ bool any(const SlotPtrs& p) { return p.remote.mask != 0; }
__device__ __forceinline__ bool is_remote(const SlotPtrs& p, int r) { return p.remote.mask >> (r & 63) & 1; }

// The proxy's flags are read where it writes them for us: `flag` names a proxy-written field of
// *p.remote.ctrl (e.g. &ctrl->d_landed); the same field of *p.remote.in is returned (identical on
// the mapped-host path; the GPU-memory copy the proxy stores into through GDRCopy otherwise).
__device__ __forceinline__ const uint64_t* proxy_flag(const SlotPtrs& p, const uint64_t* flag) {
  const auto off = reinterpret_cast<const char*>(flag) - reinterpret_cast<const char*>(p.remote.ctrl);
  return reinterpret_cast<const uint64_t*>(reinterpret_cast<const char*>(p.remote.in) + off);
}

// The slot's GPU-memory copy of proxy flag `flag` (a proxy-written field of *p.remote.ctrl:
// d_send_ok, d_landed, c_send_ok or c_landed): Epochs::proxy_seen.
__device__ __forceinline__ uint64_t* proxy_seen(const SlotPtrs& p, const Geometry& g, const uint64_t* flag) {
  return &epochs_of(g, p.priv)->proxy_seen[flag - &p.remote.ctrl->d_send_ok];
}

// Thread 0 of the calling block waits until *flag >= want, a flag the proxy raises; true when it
// came. Only the reporting block reads the flag where the proxy writes it (host memory, through
// proxy_flag): it first raises waiting[op] = want (the proxy's timeout for the step runs from
// then), then polls, runs `gather` (every thread of the block: a copy of what the other blocks
// will read from host memory into GPU memory), and then copies the flag's value into the slot's
// proxy_seen (GPU memory). The other blocks (`report` false: every block of the kernel waits,
// block 0 reports) wait on that copy: when each of a kernel's blocks read the host flag itself,
// the reads (one PCIe round trip each, apparently serialised) cost about 1 us per block, some
// 140 us per kernel on an H200 (2026-12-03, notes/benchmarks.md). The reporting block gives up a little after the proxy's own
// timeout (timeout * 1.5 + 2 s) or as soon as the proxy recorded a failure: then it records the
// ErrorRecord (op, slot, the proxy's missing ranks), marks the slot failed like wait_flags, prints,
// and every thread of the block gets false; the other blocks give up when the slot is marked
// failed, or after the same time. Call from every thread of the block; block 0 must call it
// (with `report`) whenever another block does (it is dispatched first, so the other blocks'
// spinning never keeps it off the GPU).
struct NoGather {
  __device__ void operator()() const {}
};
template <typename Gather = NoGather>
__device__ inline bool wait_proxy(const SlotPtrs& p, const Geometry& g, Half op, const uint64_t* flag, uint64_t want,
                                  bool report = true, Gather gather = {}) {
  __shared__ int failed;
  __shared__ uint64_t got;
  if (threadIdx.x == 0) {
    failed = 0;
    const uint64_t start = ptx::globaltimer();
    const uint64_t limit = static_cast<uint64_t>(p.timeout_ns) * 3 / 2 + 2000000000ull;
    uint64_t* seen = proxy_seen(p, g, flag);
    if (report) {
      ptx::st_release_sys(&p.remote.ctrl->waiting[static_cast<int>(op)], want);
      const uint64_t* in = proxy_flag(p, flag);
      uint64_t v;
      while ((v = ptx::ld_acquire_sys(in)) < want) {
        if (ptx::ld_acquire_sys_s32(&p.remote.error->code) != 0) {
          failed = 1;
          break;
        }
        if (ptx::globaltimer() - start > limit) {
          failed = 2;
          break;
        }
        __nanosleep(128);
      }
      got = v;
    } else {
      while (ptx::ld_acquire_sys(seen) < want) {
        if (slot_failed(g, p)) {
          failed = 3;  // the reporting block recorded why
          break;
        }
        if (ptx::globaltimer() - start > limit) {
          failed = 2;
          break;
        }
        __nanosleep(64);
      }
    }
    if (failed == 1 || failed == 2) {
      record_timeout(p, op, failed == 1 ? *reinterpret_cast<const volatile uint64_t*>(&p.remote.error->missing) : 0);
      mark_failed(g, p);
      if (report)
        printf("jax_moe_a2a cuda %s (slot %d, rank %d): %s\n", op_name(op), p.slot, p.rank,
             failed == 1 ? "the proxy thread failed (see last_error())" : "the proxy thread raised no flag in time");
    }
  }
  __syncthreads();
  const bool ok = failed == 0;
  if (report && ok) {  // what the other blocks need from host memory, then the flag's copy for them
    gather();
    __syncthreads();
    if (threadIdx.x == 0) ptx::st_release_sys(proxy_seen(p, g, flag), got);  // sys: rows may be host memory
  }
  __syncthreads();  // every thread read `failed` before a later wait resets it
  return ok;
}

// A block's waits before a kernel's work: node-local peers' flags (flag(r) up to want(r): a
// per-rank target such as a send half's FreeDue), then (with remote peers) the proxy's flag; true
// when everything arrived. Call from every thread of the block; `report` as in wait_flags_each
// (block 0 when every block waits).
template <typename FlagFn, typename WantFn, typename Gather = NoGather>
__device__ bool wait_peers_due(const SlotPtrs& p, const Geometry& g, Half op, FlagFn flag, WantFn want,
                               const uint64_t* proxy_flag, uint64_t proxy_want, bool report = true,
                               uint64_t skip = 0, Gather gather = {}) {
  if (!wait_flags_due(p, g, op, flag, want, report, skip)) return false;
  return !any(p) || wait_proxy(p, g, op, proxy_flag, proxy_want, report, gather);
}
// The same with one target for every node-local rank.
template <typename FlagFn, typename Gather = NoGather>
__device__ bool wait_peers(const SlotPtrs& p, const Geometry& g, Half op, FlagFn flag, uint64_t want,
                           const uint64_t* proxy_flag, uint64_t proxy_want, bool report = true, uint64_t skip = 0,
                           Gather gather = {}) {
  return wait_peers_due(p, g, op, flag, [want](int) { return want; }, proxy_flag, proxy_want, report, skip, gather);
}

// The entry wait of a receive half (every block, every thread): one look at the node-local flags
// (flag_set_now) with the slot's failure word loaded beside it, one barrier; only when something
// is missing (or peers are remote) the full wait_peers. true: proceed; false: the slot failed or
// a peer never arrived (recorded). In the common case of a receive launched after its data landed
// this is one round of loads and one barrier instead of wait_flags_each's three barriers behind
// the failure word's load.
// With remote peers, block 0 runs `gather` (every thread) once the proxy's flag came, before the
// other blocks may go on (wait_proxy).
template <typename FlagFn, typename Gather = NoGather>
__device__ __forceinline__ bool arrived(const SlotPtrs& p, const Geometry& g, Half op, FlagFn flag, uint64_t want,
                                        const uint64_t* proxy_flag, uint64_t skip, Gather gather = {}) {
  const bool failed = slot_failed(g, p);  // issued beside the flag loads, not before them
  const bool now = !any(p) && flag_set_now(g, flag, want, skip);
  if (__syncthreads_and(now && !failed)) return true;
  return !slot_failed(g, p) && wait_peers(p, g, op, flag, want, proxy_flag, want, blockIdx.x == 0, skip, gather);
}

// Makes this thread's earlier stores to mapped memory visible system-wide, then (thread 0 of the
// block, after a __syncthreads) raises a flag for the proxy. Call from every thread of the block.
__device__ inline void raise_for_proxy(uint64_t* flag, uint64_t value) {
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x == 0) ptx::st_release_sys(flag, value);
}

// Where dispatch_send packs row j of ours for remote destination d: d_send [d][P][row].
__device__ __forceinline__ uint8_t* send_row(const SlotPtrs& p, const Geometry& g, int d, int64_t j) {
  return p.remote.d_send + (int64_t(d) * g.P + j) * g.row;
}

// Block 0 of dispatch_send: our whole count matrix [N][L] (rows we send each destination per local
// expert; cnt[d * L + l]) into counts_send, then d_counts = epoch + 1. Call from every thread of block 0.
__device__ inline void publish_counts(const SlotPtrs& p, const Geometry& g, const int32_t* cnt, uint64_t epoch) {
  int32_t* out = p.remote.counts_send;
  for (int i = threadIdx.x; i < g.N * g.L; i += blockDim.x) out[i] = cnt[i];
  raise_for_proxy(&p.remote.ctrl->d_counts, epoch + 1);
}

// dispatch_recv's gather (block 0, every thread, after d_landed): what this dispatch's remote
// sources left in host memory, once, into GPU memory, so that no block reads host memory per
// count or row. Into `counts` (our node-local counts records [N src][L + 1], where only
// node-local sources write): for remote source s, record l < L = the rows it sends us for local
// expert l (its count matrix in counts_recv [N src][N][L], row `me`), record L = its combine
// offset for us (the proxy's snapshot of this dispatch, Exchange::combine_offsets; our
// combine_send writes its rows itself into the members of s's tp group that are node-local to
// us, the proxy offsets the rest). Into Epochs::over_base: where s's overflow rows start in our
// overflow region.
__device__ inline void gather_landing(const SlotPtrs& p, const Geometry& g, int32_t* counts, Epochs* ep) {
  const int cs = counts_stride(g);
  const volatile int32_t* m = p.remote.counts_recv;
  for (int i = threadIdx.x; i < g.N * cs; i += blockDim.x) {
    const int s = i / cs, l = i % cs;
    if (!is_remote(p, s)) continue;
    counts[i] = l < g.L ? m[(int64_t(s) * g.N + p.rank) * g.L + l]
                        : *reinterpret_cast<const volatile int32_t*>(&p.remote.in->c_off[s]);
  }
  for (int s = threadIdx.x; s < g.N; s += blockDim.x)
    if (is_remote(p, s)) ep->over_base[s] = *reinterpret_cast<const volatile int64_t*>(&p.remote.in->over_base[s]);
}

// Row j that remote source s sent us (private region, or overflow at the proxy's base for s, as
// gather_landing left it in the slot's Epochs).
__device__ __forceinline__ const uint8_t* landed_row(const SlotPtrs& p, const Geometry& g, const Epochs* ep, int s,
                                                     int64_t j) {
  if (j < p.remote.priv) return p.remote.d_recv + (int64_t(s) * p.remote.priv + j) * g.row;
  return p.remote.d_recv + p.remote.over_off + (ep->over_base[s] + j - p.remote.priv) * g.row;
}

// Does the tp group of source s hold a rank on another node (then its rows go to c_send too)?
__device__ __forceinline__ bool group_has_remote(const SlotPtrs& p, const Geometry& g, int s) {
  const int g0 = s / g.tp * g.tp;
  for (int m = g0; m < g0 + g.tp; ++m)
    if (is_remote(p, m)) return true;
  return false;
}

// The last block of a send half (every thread of it): the proxy's flag `packed` (with remote
// peers), each node-local rank's arrival flag arrived(r) = epoch + 1 (not those in `skip`:
// elastic EP's masked ranks), our epoch counter and the handle [epoch, slot].
template <typename ArrivedFn>
__device__ inline void close_send(const SlotPtrs& p, const Geometry& g, uint64_t* packed, ArrivedFn arrived,
                                  uint64_t* epoch_counter, uint64_t epoch, int32_t* handle, uint64_t skip = 0) {
  if (any(p)) raise_for_proxy(packed, epoch + 1);
  if (threadIdx.x < g.N && !is_remote(p, threadIdx.x) && !(skip >> threadIdx.x & 1)) {
    __threadfence_system();
    ptx::st_release_sys(arrived(threadIdx.x), epoch + 1);
  }
  if (threadIdx.x == 0) {
    *epoch_counter = epoch + 1;
    handle[0] = static_cast<int32_t>(epoch);
    handle[1] = p.slot;
  }
}

}  // namespace a2a::cuda::remote
