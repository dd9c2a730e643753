// Elastic EP in the GPU kernels (docs/api.md, "Elastic EP"): the ranks a call leaves out. The
// communicator has already stopped every pair to or from a masked rank (its id is E), so the
// kernels only leave masked ranks out of their waits and writes and read a masked source's stale
// counts as zeros. A rank masked itself sends and receives nothing: every rank is left out.
#pragma once

#include <cstdint>

#include "gpu/failure.cuh"
#include "gpu/params.h"

namespace a2a::gpu {

// Bit r: rank r is left out of this call (p.alive[r] == 0; every bit when we are masked). 0
// without a mask (p.alive null), the common case, with no load at all. Every thread may call it:
// N loads through the read-only cache.
__device__ __forceinline__ uint64_t masked_ranks(const Geometry& g, const SlotPtrs& p) {
  if (p.alive == nullptr) return 0;
  uint64_t m = 0;
  for (int r = 0; r < g.N; ++r)
    if (__ldg(p.alive + r) == 0) m |= 1ull << r;
  const uint64_t all = g.N >= 64 ? ~0ull : (1ull << g.N) - 1;
  return (m >> p.rank & 1) ? all : m;
}

__device__ __forceinline__ bool left_out(uint64_t masked, int r) { return masked >> (r & 63) & 1; }

// ---- the FREE flags a send half awaits (both GPU backends) ------------------------------------
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

// The slot's owed array of dispatch (which: Half::kDispatchSend) or combine (Half::kCombineSend):
// [N] uint64, the dispatch one first.
__device__ __forceinline__ uint64_t* owed_free(const Geometry& g, uint8_t* priv, Half which) {
  return reinterpret_cast<uint64_t*>(priv + g.off_epochs + sizeof(Epochs)) + (which == Half::kDispatchSend ? 0 : int64_t(g.N));
}

// A send half's FREE targets (every thread, at entry: one load of the lagging bits, beside the
// epoch's, as the last op's mask was before; owed[] only where a bit is set). which: the send
// half, Half::kDispatchSend or Half::kCombineSend. The send half's last block rewrites both (owe_free), after every block waited.
__device__ __forceinline__ FreeDue free_due(const Geometry& g, const SlotPtrs& p, Half which, uint64_t epoch) {
  const Epochs* ep = epochs_of(g, p.priv);
  return {epoch, which == Half::kDispatchSend ? ep->d_lagging : ep->c_lagging, owed_free(g, p.priv, which)};
}

// The last block of a send half (every thread of it), after every block's FREE wait: the ranks
// this call leaves out (`out`: masked, every rank when we are) keep owing what they owed (the
// call's epoch where their bit was clear: written into owed[] now), every other rank owes this
// call's FREE next time (its bit clears). Without a mask ever: one store of 0.
__device__ __forceinline__ void owe_free(const Geometry& g, const SlotPtrs& p, Half which, const FreeDue& due,
                                         uint64_t out) {
  const int r = threadIdx.x;
  if (r < g.N && left_out(out, r) && !due.lags(r)) owed_free(g, p.priv, which)[r] = due.epoch;
  if (threadIdx.x == 0) {
    Epochs* ep = epochs_of(g, p.priv);
    (which == Half::kDispatchSend ? ep->d_lagging : ep->c_lagging) = out;
  }
}

}  // namespace a2a::gpu
