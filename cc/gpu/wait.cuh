// The flag wait of the GPU backends' kernels: threads 0..N-1 of a block poll one flag per rank
// with system-scope acquire loads until it reaches its target or the slot's timeout passes.
#pragma once

#include <cstdint>
#include <cstdio>

#include "gpu/failure.cuh"
#include "gpu/params.h"
#include "gpu/ptx.cuh"

namespace a2a::gpu {

// Threads 0..N-1 of the calling block each wait until *flag(r) >= want(r); true when all arrived.
// On timeout the missing ranks are recorded in the mapped error record and printed (naming
// `backend`), the slot is marked failed, and every thread of the block gets false.
// `report`: this block prints the timeout (block 0 of a kernel whose every block waits; every
// block that gives up records it and marks the slot failed).
template <typename FlagFn, typename WantFn>
__device__ bool wait_flags_each(const SlotPtrs& p, const Geometry& g, Half op, FlagFn flag, WantFn want,
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

}  // namespace a2a::gpu
