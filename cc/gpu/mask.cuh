// Elastic EP in the GPU kernels (docs/api.md, "Elastic EP"): the ranks a call leaves out. The
// communicator has already stopped every pair to or from a masked rank (its id is E), so the
// kernels only leave masked ranks out of their waits and writes and read a masked source's stale
// counts as zeros. A rank masked itself sends and receives nothing: every rank is left out.
#pragma once

#include <cstdint>

#include "gpu/params.h"

namespace a2a::cuda {

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

}  // namespace a2a::cuda
