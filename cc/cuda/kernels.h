// Launchers of the cuda backend's kernels (one cooperative kernel per half). Each returns the
// launch error; a failure inside a kernel (a peer that never arrives) records an ErrorRecord in
// mapped host memory and ends the op without a trap (cuda/common.cuh, slot_failed).
#pragma once

#include <cuda_runtime_api.h>

#include "cuda/params.h"

namespace a2a::cuda {

// Private scratch bytes per slot (routing and arrangement tables) for a geometry.
int64_t scratch_bytes(const Geometry& g);

// Blocks per kernel launch for this device (cooperative: all blocks co-resident).
int grid_blocks(int device);

cudaError_t launch_dispatch_send(const DispatchSendParams& p, int blocks, cudaStream_t stream);
cudaError_t launch_dispatch_recv(const DispatchRecvParams& p, int blocks, cudaStream_t stream);
cudaError_t launch_combine_send(const CombineSendParams& p, int blocks, cudaStream_t stream);
cudaError_t launch_combine_recv(const CombineRecvParams& p, int blocks, cudaStream_t stream);

}  // namespace a2a::cuda
