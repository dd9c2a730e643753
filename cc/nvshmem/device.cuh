// Device helpers of the nvshmem backend's kernels: where a slot's signals, metadata and rows
// live (at our own address or, as a symmetric address, at a peer's), and the one put helper.
// Every remote write is an NVSHMEM put-with-signal or signal operation; nothing calls quiet or
// fence: each wait counts the signals of the data it reads, and a put's signal lands after its
// data.
#pragma once

#include <nvshmem.h>
#include <nvshmemx.h>

#include "gpu/params.h"
#include "gpu/wait.cuh"
#include "nvshmem/params.h"

namespace a2a::nvshmem {

using cuda::Geometry;
using cuda::SlotPtrs;

__device__ __forceinline__ Signals* signals_at(const SlotPtrs& p, int rank) {
  return reinterpret_cast<Signals*>(p.peer_shared[rank]);
}

// Rank `src`'s meta block inside rank `at`'s slot: counts [L] int32, then (token, weight) per row.
__device__ __forceinline__ int32_t* meta_at(const SlotPtrs& p, const Layout& lay, int at, int src) {
  return reinterpret_cast<int32_t*>(p.peer_shared[at] + lay.off_meta + int64_t(src) * lay.meta_stride);
}

// Per-source cumulative counters of rows consumed so far: [0] dispatch rows, [1] combine rows.
__device__ __forceinline__ uint64_t* seen(const SlotPtrs& p, const Layout& lay, int which, const Geometry& g) {
  return reinterpret_cast<uint64_t*>(p.priv + lay.off_seen) + int64_t(which) * g.N;
}

// Warp-wide: `bytes` from local `src` to `dst` (a symmetric address) on PE `pe`, then adds 1 to
// the signal `sig` there (it lands after the data).
__device__ __forceinline__ void put_row_signal(void* dst, const void* src, int64_t bytes, uint64_t* sig, int pe) {
  nvshmemx_putmem_signal_nbi_warp(dst, src, static_cast<size_t>(bytes), sig, 1, NVSHMEM_SIGNAL_ADD, pe);
}

// The same wait as the cuda backend's, with a target per rank and this backend's name; false
// (slot marked failed, error recorded) when a rank did not arrive in time.
// `report`: this block records and prints a timeout (block 0 where every block waits).
template <typename FlagFn, typename WantFn>
__device__ bool wait_signals(const SlotPtrs& p, const Geometry& g, int op, FlagFn flag, WantFn want,
                             bool report = true) {
  return cuda::wait_flags_each(p, g, op, flag, want, "nvshmem", report);
}

}  // namespace a2a::nvshmem
