// Device helpers of the cuda backend's kernels: where a rank's epoch flags live in its shared
// slot area (SyncFlags, written by peers through CUDA IPC or peer mappings) and the wait on them
// (a send half's FREE targets: gpu/mask.cuh FreeDue). The inter-node side is cuda/remote.cuh.
#pragma once

#include <cstdint>

#include "gpu/failure.cuh"
#include "gpu/mask.cuh"
#include "gpu/params.h"
#include "gpu/ptx.cuh"
#include "gpu/wait.cuh"

namespace a2a::cuda {
using namespace ::a2a::gpu;  // the shared device library (cc/gpu)

__device__ __forceinline__ SyncFlags* flags_of(const SlotPtrs& p, int rank) {
  return reinterpret_cast<SyncFlags*>(p.peer_shared[rank]);
}

// Threads 0..N-1 wait until flag(r) reaches want(r) for every node-local rank; ranks on other
// nodes are the proxy's (cuda/remote.cuh), ranks with a bit in `skip` (elastic EP: masked ones,
// gpu/mask.cuh) are not waited for. `want`: a per-rank target (FreeDue) or wait_flags' one value.
template <typename FlagFn, typename WantFn>
__device__ bool wait_flags_due(const SlotPtrs& p, const Geometry& g, Half op, FlagFn flag, WantFn want,
                               bool report = true, uint64_t skip = 0) {
  const uint64_t none = p.remote.mask | skip;
  return wait_flags_each(p, g, op, flag, [&](int r) { return none >> r & 1 ? uint64_t(0) : uint64_t(want(r)); },
                         "cuda", report);
}
// The same wait with one target for every node-local rank (the cuda backend's epoch flags).
template <typename FlagFn>
__device__ bool wait_flags(const SlotPtrs& p, const Geometry& g, Half op, FlagFn flag, uint64_t want,
                           bool report = true, uint64_t skip = 0) {
  return wait_flags_due(p, g, op, flag, [want](int) { return want; }, report, skip);
}
// One look at the flags, no waiting: thread r < N reads flag(r) once (acquire, so a flag seen set
// orders the thread's later writes, and the block's after a barrier); true in threads >= N and
// where it reached `want`. AND it over the block (__syncthreads_and) to skip wait_flags when every
// flag was already set at kernel entry.
// Ranks with a bit in `skip` count as set; their flag is still loaded first (our own memory), so
// that the load never waits for `skip` (which the callers load from the slot's Epochs).
template <typename FlagFn>
__device__ __forceinline__ bool flag_set_now(const Geometry& g, FlagFn flag, uint64_t want, uint64_t skip = 0) {
  if (threadIdx.x >= g.N) return true;
  const bool set = ptx::ld_acquire_sys(flag(static_cast<int>(threadIdx.x))) >= want;
  return set || (skip >> threadIdx.x & 1);
}
// flag_set_now for a send half's FREE flags (rank r against due(r)). The flag load goes out first
// again, beside the lagging bits loaded before it (free_due); a flag at the call's epoch is set for
// every rank (nobody owes more), and only a lagging rank below it compares with owed[r], loaded
// after the flag (only after a call with a mask left someone out).
template <typename FlagFn>
__device__ __forceinline__ bool free_set_now(const Geometry& g, FlagFn flag, const FreeDue& due, uint64_t skip) {
  if (threadIdx.x >= g.N) return true;
  const int r = static_cast<int>(threadIdx.x);
  const uint64_t f = ptx::ld_acquire_sys(flag(r));
  return f >= due.epoch || (skip >> r & 1) || (due.lags(r) && f >= due.owed[r]);
}

}  // namespace a2a::cuda
