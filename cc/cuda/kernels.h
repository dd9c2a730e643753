// Launchers of the cuda backend's kernels (one kernel per half; only the grid-routed
// dispatch_send is cooperative: docs/gpu_kernels.md). Each returns the launch error; a failure
// inside a kernel (a peer that never arrives) records an ErrorRecord in mapped host memory and
// ends the op without a trap (gpu/failure.cuh, slot_failed).
#pragma once

#include <cuda_runtime_api.h>

#include "gpu/params.h"

namespace a2a::cuda {

// dispatch_send picks its kernel: block-routed (cuda/dispatch/send_block.cu) when every peer is
// node-local, tp_size is 1 and the routing tables fit in kBlockRoutingSmem bytes of shared memory
// (decode batches), else grid-routed (cuda/dispatch/send.cu). JAX_MOE_A2A_DISPATCH_SEND=grid|block
// forces one (block only where it applies), read once per process: for benchmarks and tests.
constexpr int64_t kBlockRoutingSmem = 48 * 1024;
int64_t block_routing_smem_bytes(const Geometry& g);
bool use_block_routing(const Geometry& g, const SlotPtrs& p);
cudaError_t launch_dispatch_send(const DispatchSendParams& p, int blocks, cudaStream_t stream);
cudaError_t launch_dispatch_send_block(const DispatchSendParams& p, int blocks, cudaStream_t stream);
cudaError_t launch_dispatch_recv(const DispatchRecvParams& p, int blocks, cudaStream_t stream);
cudaError_t launch_combine_send(const CombineSendParams& p, int blocks, cudaStream_t stream);
cudaError_t launch_combine_recv(const CombineRecvParams& p, int blocks, cudaStream_t stream);

}  // namespace a2a::cuda
