// Launchers of the cuda backend's kernels (one kernel per half; the grid-routed dispatch_send is
// two, one per routing phase: docs/gpu_kernels.md). Each returns the launch error; a failure
// inside a kernel (a peer that never arrives) records an ErrorRecord in mapped host memory and
// ends the op without a trap (gpu/failure.cuh, slot_failed).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <vector>

#include "gpu/chunk_kind.h"
#include "gpu/params.h"

namespace a2a::cuda {
using namespace ::a2a::gpu;  // the shared device library (cc/gpu)

// dispatch_send picks its kernel (cuda/dispatch/send.cu): block-routed when every peer is
// node-local, tp_size is 1, K <= 16 and the routing tables fit in kBlockRoutingSmem bytes
// (gpu/params.h) of shared memory (decode batches), else grid-routed. Block-routed, the token is
// staged in registers (cuda/dispatch/send_regs.cu) where regs_staging_kind allows, else in
// shared memory (send_block.cu). JAX_MOE_A2A_DISPATCH_SEND=grid|block|auto (default auto) forces one where
// it applies (block: the shared-memory staging), read once per process: for benchmarks and tests.
int64_t block_routing_smem_bytes(const Geometry& g);
int64_t block_routing_smem_bytes_regs(const Geometry& g);
bool use_block_routing(const Geometry& g, const SlotPtrs& p);
// The register-staged kernel for these parameters (gpu/chunk_kind.h): quantise x of a float kind
// to fp8, copy x in the wire dtype, or !ok() (sizes, alignment or dtypes it does not take).
ChunkKind regs_staging_kind(const DispatchSendParams& p);
cudaError_t launch_dispatch_send(const DispatchSendParams& p, int blocks, cudaStream_t stream);
cudaError_t launch_dispatch_send_block(const DispatchSendParams& p, int blocks, cudaStream_t stream);
cudaError_t launch_dispatch_send_regs(const DispatchSendParams& p, ChunkKind kind, int blocks, cudaStream_t stream);
cudaError_t launch_dispatch_recv(const DispatchRecvParams& p, int blocks, cudaStream_t stream);
cudaError_t launch_combine_send(const CombineSendParams& p, int blocks, cudaStream_t stream);
cudaError_t launch_combine_recv(const CombineRecvParams& p, int blocks, cudaStream_t stream);
// A kernel of this backend as its launcher launches it for geometry g: for loading it ahead of
// its first launch and for the launch report (cuda/preload.h). fn is what cudaFuncGetAttributes
// and the occupancy calculator take; smem the dynamic shared memory of its launches.
struct KernelRef {
  const char* name;
  const void* fn;
  size_t smem;
  int threads;       // per block
  bool cooperative;  // launched with cudaLaunchCooperativeKernel (its blocks meet in grid.sync)
};
// Each launcher's file appends the kernels it may launch (every template instance).
void dispatch_send_kernels(const Geometry& g, std::vector<KernelRef>* out);
void dispatch_send_block_kernels(const Geometry& g, std::vector<KernelRef>* out);
void dispatch_send_regs_kernels(const Geometry& g, std::vector<KernelRef>* out);
void dispatch_recv_kernels(const Geometry& g, std::vector<KernelRef>* out);
void combine_send_kernels(const Geometry& g, std::vector<KernelRef>* out);
void combine_recv_kernels(const Geometry& g, std::vector<KernelRef>* out);
void timing_barrier_kernels(std::vector<KernelRef>* out);
// Kernel timing only (cuda/timing_barrier.cu): a barrier of the node-local ranks on `stream`,
// the count-th one (every rank passes the same count).
cudaError_t launch_timing_barrier(const SlotPtrs& slot0, int num_ranks, uint64_t count, cudaStream_t stream);

}  // namespace a2a::cuda
