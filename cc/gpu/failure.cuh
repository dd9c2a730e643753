// How a kernel of the GPU backends fails without a trap: the slot's device-side epochs and
// failure mark, the timeout record the host raises, and the outputs a failed op leaves.
#pragma once

#include <cstdint>

#include "gpu/elems.cuh"
#include "gpu/grid.cuh"
#include "gpu/params.h"

namespace a2a::gpu {

// The slot's device-side epoch counters and failure mark, in its private region `priv`.
__device__ __forceinline__ Epochs* epochs_of(const Geometry& g, uint8_t* priv) {
  return reinterpret_cast<Epochs*>(priv + g.off_epochs);
}

// Failure without a trap. A wait that times out records the missing ranks (ErrorRecord, mapped),
// marks the slot failed and returns false; its kernel ends after the next grid sync or kernel
// boundary (every block reads the mark there), and every later kernel of the slot ends at once,
// with its outputs poisoned (abandon_dispatch_recv, poison_combine_recv). The host raises the recorded error at the
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

// Names of the four halves (ErrorRecord::op), for the device's printf.
__device__ __forceinline__ const char* op_name(Half op) {
  switch (op) {
    case Half::kDispatchSend: return "dispatch_send";
    case Half::kDispatchRecv: return "dispatch_recv";
    case Half::kCombineSend: return "combine_send";
    case Half::kCombineRecv: break;
  }
  return "combine_recv";
}

// One thread records an error in the mapped error record (code: kErrorTimeout or
// kErrorCounterAhead; missing: bit r = rank r), fields first and code last, each made visible to
// the host before the next.
__device__ inline void record_error(const SlotPtrs& p, Half op, uint64_t missing, int32_t code) {
  p.err->missing = missing;
  p.err->op = op;
  p.err->slot = p.slot;
  p.err->rank = p.rank;
  __threadfence_system();
  p.err->code = code;
  __threadfence_system();
}
__device__ inline void record_timeout(const SlotPtrs& p, Half op, uint64_t missing) {
  record_error(p, op, missing, kErrorTimeout);
}

// dispatch_send's outputs when the op failed (grid-wide): nothing routed, nothing dropped (the
// drop count feeds stats and debug checks, which must not see garbage), no rows owed.
__device__ inline void abandon_dispatch_send(const DispatchSendParams& P, const GridIdx& ix) {
  const Geometry& g = P.g;
  for (int64_t q = ix.gtid; q < int64_t(g.T) * g.K; q += ix.gstride) {
    P.dest[q] = -1;
    P.pair_slot[q] = 0;
  }
  if (P.dest_counts)
    for (int64_t r = ix.gtid; r < g.N; r += ix.gstride) P.dest_counts[r] = 0;
  if (ix.gtid == 0) *P.dropped = 0;
}

// dispatch_recv's outputs when the op failed (grid-wide): no rows, every row unused.
__device__ inline void abandon_dispatch_recv(const DispatchRecvParams& P, const GridIdx& ix) {
  const Geometry& g = P.g;
  const int64_t rows_out = g.ragged() ? g.capacity : int64_t(g.L) * g.capacity;
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

}  // namespace a2a::gpu
