// What every kernel of the four halves (both GPU backends) opens with.
#pragma once

#include <cstdint>

#include "gpu/failure.cuh"
#include "gpu/grid.cuh"
#include "gpu/params.h"

namespace a2a::gpu {

// This call's epoch: a send half's is the slot's counter (advanced by the kernel's last block,
// after every block read it); a receive half's is in the handle its send half returned.
__device__ __forceinline__ uint64_t call_epoch(const DispatchSendParams&, const Epochs* ep) { return ep->d_send; }
__device__ __forceinline__ uint64_t call_epoch(const CombineSendParams&, const Epochs* ep) { return ep->c_send; }
__device__ __forceinline__ uint64_t call_epoch(const DispatchRecvParams& P, const Epochs*) {
  return static_cast<uint64_t>(P.handle[0]);
}
__device__ __forceinline__ uint64_t call_epoch(const CombineRecvParams& P, const Epochs*) {
  return static_cast<uint64_t>(P.handle[0]);
}

}  // namespace a2a::gpu

// Declares, from the kernel's parameter struct P: g (its Geometry), ix (this thread's GridIdx), me
// (our rank), ep (the slot's device-side Epochs) and epoch (this call's, call_epoch).
#define A2A_KERNEL_START(P)                                                                      \
  const ::a2a::gpu::Geometry& g = (P).g;                                                        \
  const ::a2a::gpu::GridIdx ix;                                                                 \
  [[maybe_unused]] const int me = (P).p.rank;                                                    \
  [[maybe_unused]] ::a2a::gpu::Epochs* const ep = ::a2a::gpu::epochs_of(g, (P).p.priv);        \
  const uint64_t epoch = ::a2a::gpu::call_epoch((P), ep)
