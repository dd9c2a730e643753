// Device helpers of the cuda backend's kernels: where a rank's epoch flags live in its shared
// slot area (SyncFlags, written by peers through CUDA IPC or peer mappings), the wait on them, and
// the FREE flag values a send half awaits under elastic EP. The inter-node side is cuda/remote.cuh.
#pragma once

#include <cstdint>

#include "gpu/failure.cuh"
#include "gpu/mask.cuh"
#include "gpu/params.h"
#include "gpu/ptx.cuh"
#include "gpu/wait.cuh"

namespace a2a::cuda {

__device__ __forceinline__ SyncFlags* flags_of(const SlotPtrs& p, int rank) {
  return reinterpret_cast<SyncFlags*>(p.peer_shared[rank]);
}

// ---- the FREE flags a send half awaits (elastic EP: docs/api.md) --------------------------------
// Rank r owes us the FREE flag of this slot's last dispatch / combine in which both of us took
// part: that op's epoch + 1 (0: none). A send half waits for it from every rank it does not leave
// out now, so a rank masked for a step and unmasked the next is still awaited for the step before,
// which it may still be reading (the last op's mask alone would skip it: it sat that op out).
// Kept so that the common case costs what it did: a rank that took part in the slot's last op
// (every rank, when no call had a mask) owes the call's epoch; for the others, whose bit is set in
// Epochs::d_lagging / c_lagging, the value is in the slot's owed array ([2][N] uint64 after
// Epochs), loaded only for them.
struct FreeDue {
  uint64_t epoch;        // this call's: what a rank that took part in the slot's last op owes
  uint64_t lagging;      // Epochs::d_lagging / c_lagging as the call found them
  const uint64_t* owed;  // [N]: the older values, where `lagging` has the bit
  __device__ __forceinline__ bool lags(int r) const { return lagging >> (r & 63) & 1; }
  __device__ __forceinline__ uint64_t operator()(int r) const { return lags(r) ? owed[r] : epoch; }
};

// The slot's owed array of dispatch (which 0) or combine (which 1): [N] uint64.
__device__ __forceinline__ uint64_t* owed_free(const Geometry& g, uint8_t* priv, int which) {
  return reinterpret_cast<uint64_t*>(priv + g.off_epochs + sizeof(Epochs)) + int64_t(which) * g.N;
}

// A send half's FREE targets (every thread, at entry: one load of the lagging bits, beside the
// epoch's, as the last op's mask was before; owed[] only where a bit is set). which 0: dispatch,
// 1: combine. The send half's last block rewrites both (owe_free), after every block waited.
__device__ __forceinline__ FreeDue free_due(const Geometry& g, const SlotPtrs& p, int which, uint64_t epoch) {
  const Epochs* ep = epochs_of(g, p.priv);
  return {epoch, which == 0 ? ep->d_lagging : ep->c_lagging, owed_free(g, p.priv, which)};
}

// The last block of a send half (every thread of it), after every block's FREE wait: the ranks
// this call leaves out (`out`: masked, every rank when we are) keep owing what they owed (the
// call's epoch where their bit was clear: written into owed[] now), every other rank owes this
// call's FREE next time (its bit clears). Without a mask ever: one store of 0.
__device__ __forceinline__ void owe_free(const Geometry& g, const SlotPtrs& p, int which, const FreeDue& due,
                                         uint64_t out) {
  const int r = threadIdx.x;
  if (r < g.N && left_out(out, r) && !due.lags(r)) owed_free(g, p.priv, which)[r] = due.epoch;
  if (threadIdx.x == 0) {
    Epochs* ep = epochs_of(g, p.priv);
    (which == 0 ? ep->d_lagging : ep->c_lagging) = out;
  }
}

// Threads 0..N-1 wait until flag(r) reaches want(r) for every node-local rank; ranks on other
// nodes are the proxy's (cuda/remote.cuh), ranks with a bit in `skip` (elastic EP: masked ones,
// gpu/mask.cuh) are not waited for. `want`: a per-rank target (FreeDue) or wait_flags' one value.
template <typename FlagFn, typename WantFn>
__device__ bool wait_flags_due(const SlotPtrs& p, const Geometry& g, int op, FlagFn flag, WantFn want,
                               bool report = true, uint64_t skip = 0) {
  const uint64_t none = p.remote.mask | skip;
  return wait_flags_each(p, g, op, flag, [&](int r) { return none >> r & 1 ? uint64_t(0) : uint64_t(want(r)); },
                         "cuda", report);
}
// The same wait with one target for every node-local rank (the cuda backend's epoch flags).
template <typename FlagFn>
__device__ bool wait_flags(const SlotPtrs& p, const Geometry& g, int op, FlagFn flag, uint64_t want,
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
