// Device helpers of the nvshmem backend's kernels: where a slot's signals, metadata and rows
// live (at our own address or, as a symmetric address, at a peer's), the one put helper, and the
// guard on the cumulative row counters under a rank mask. Every remote write is an NVSHMEM
// put-with-signal or signal operation; nothing calls quiet or fence: each wait counts the signals
// of the data it reads, and a put's signal lands after its data.
//
// Elastic EP (docs/api.md, "Elastic EP"; gpu/mask.cuh): every half leaves the masked ranks out of
// its waits (a masked rank's target is 0) and its puts, reads a masked source's stale meta block
// as zeros, never advances `seen` for it and sends it no FREE; a send half awaits each live rank's
// FREE of the last step both took part in (FreeDue, gpu/mask.cuh, shared with the cuda backend). The row counters (Signals::d_rows / c_rows)
// are cumulative, so they must stay in step with `seen`:
//   - a masked rank that still runs is masked in its own calls too (masked_ranks: every bit): it
//     puts nothing and nobody puts to it, so both sides' counters stand still and it can be
//     unmasked at any later step;
//   - a rank that died in the middle of its puts may leave its counter at a survivor ahead of
//     `seen` for good. In that step the survivor either waited for it (its meta signal goes out
//     after its rows; a combine_recv waits for the rows it is owed) and timed out: the slot is
//     marked failed, no later kernel of the slot reads a counter, and recover() is refused on the
//     GPU backends (make a new communicator); or it had the rank masked already and read nothing
//     of it. A dead rank stays masked for the rest of the communicator, so its counter is never
//     read again; unmasking it is a timeout (its meta signal never comes), not a hang and not a
//     misread.
// Ranks that pass different masks (a user error) can put rows their receiver does not count:
// counters_in_step finds a counter past what this epoch explains before the FREE signals go out,
// and fails the op (error code gpu::kErrorCounterAhead) instead of letting a later step read stale rows.
#pragma once

#include <nvshmem.h>
#include <nvshmemx.h>

#include "gpu/failure.cuh"
#include "gpu/mask.cuh"
#include "gpu/params.h"
#include "gpu/ptx.cuh"
#include "gpu/wait.cuh"
#include "nvshmem/params.h"

namespace a2a::nvshmem {

using gpu::Geometry;
using gpu::left_out;
using gpu::masked_ranks;
using gpu::SlotPtrs;

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

// Warp-wide: starts loading [src, src + bytes) into this SM's L1 (one prefetch per 128-byte line,
// lanes side by side) without waiting for it. NVSHMEM's warp put over load/store paths (NVLink,
// the same GPU) copies one 16-byte vector per lane per round, each round's store waiting for its
// load (the loop is not unrolled: 15 rounds for a 7.4 KB dispatch row, 10 for a 4.6 KB meta
// block); with the source prefetched, the first round waits for L2 and the rest hit L1. Only
// for sources this kernel does not write again before the put (L1 is not coherent with other
// SMs' writes; lines written before a grid sync or a last_block_done are safe). Over a remote
// transport the NIC reads the source and the prefetch only costs its instructions.
__device__ __forceinline__ void prefetch_source_l1(const void* src, int64_t bytes, int lane) {
  const uintptr_t lo = reinterpret_cast<uintptr_t>(src) & ~uintptr_t(127);
  const uintptr_t hi = reinterpret_cast<uintptr_t>(src) + static_cast<uintptr_t>(bytes);
  for (uintptr_t a = lo + uintptr_t(lane) * 128; a < hi; a += 32 * 128)
    gpu::ptx::prefetch_l1(reinterpret_cast<const void*>(a));
}

// The same wait as the cuda backend's, with a target per rank and this backend's name; false
// (slot marked failed, error recorded) when a rank did not arrive in time.
// `report`: this block records and prints a timeout (block 0 where every block waits).
template <typename FlagFn, typename WantFn>
__device__ bool wait_signals(const SlotPtrs& p, const Geometry& g, Half op, FlagFn flag, WantFn want,
                             bool report = true) {
  return gpu::wait_flags_each(p, g, op, flag, want, "nvshmem", report);
}

// Elastic EP's guard on the cumulative row counters (header comment), called by every thread of
// a receive half's last block, after every block's row wait and before the FREE signals: a source
// r not in `skip` cannot have put rows of its next epoch yet (it waits for our FREE), so
// *counter(r) > want(r) (seen plus this epoch's rows) means its counter and our `seen` are out
// of step, and the rows we just read may be another epoch's. Then the offending sources are
// recorded (ErrorRecord code gpu::kErrorCounterAhead, `missing` = their bits), the slot is marked failed
// and every thread gets false: the caller poisons its outputs and sends no FREE. Only with a mask
// operand (p.alive): counters drift only when ranks disagree about a mask, and without one the
// receive halves keep their closing path as it was (no extra load and barriers).
template <typename CounterFn, typename WantFn>
__device__ bool counters_in_step(const SlotPtrs& p, const Geometry& g, Half op, uint64_t skip, CounterFn counter,
                                 WantFn want) {
  if (p.alive == nullptr) return true;
  __shared__ unsigned long long ahead;
  if (threadIdx.x == 0) ahead = 0;
  __syncthreads();
  const int r = threadIdx.x;
  if (r < g.N && !left_out(skip, r) && gpu::ptx::ld_acquire_sys(counter(r)) > want(r)) atomicOr(&ahead, 1ull << r);
  __syncthreads();
  const unsigned long long bad = ahead;
  if (bad == 0) return true;
  if (threadIdx.x == 0) {
    gpu::record_error(p, op, bad, gpu::kErrorCounterAhead);
    gpu::mark_failed(g, p);
    printf("jax_moe_a2a nvshmem %s (slot %d, rank %d): the row counters of ranks with bits 0x%llx set ran ahead of "
           "what we consumed (ranks passing different rank masks?)\n",
           gpu::op_name(op), p.slot, p.rank, bad);
  }
  return false;
}

// A GridIdx that makes one block cover the whole grid's range: the last block poisons every
// output of an op that failed after the other blocks wrote theirs (it sees their writes).
__device__ __forceinline__ gpu::GridIdx whole_grid_in_block() {
  gpu::GridIdx ix;
  ix.gtid = threadIdx.x;
  ix.gstride = blockDim.x;
  ix.gwarp = static_cast<int>(threadIdx.x >> 5);
  ix.nwarps = static_cast<int>(blockDim.x >> 5);
  return ix;
}

}  // namespace a2a::nvshmem
