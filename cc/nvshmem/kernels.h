// Launchers of the nvshmem backend's kernels (one kernel per half, only dispatch_send
// cooperative; the cuda backend's parameter structs plus NvSlot). Each returns the launch error;
// a peer that never arrives makes the kernel record an ErrorRecord in mapped host memory and end
// the op (no trap).
#pragma once

#include <cuda_runtime_api.h>

#include "gpu/params.h"
#include "nvshmem/params.h"

namespace a2a::nvshmem {

cudaError_t launch_dispatch_send(const gpu::DispatchSendParams& p, const NvSlot& nv, int blocks, cudaStream_t stream);
cudaError_t launch_dispatch_recv(const gpu::DispatchRecvParams& p, const NvSlot& nv, int blocks, cudaStream_t stream);
cudaError_t launch_combine_send(const gpu::CombineSendParams& p, const NvSlot& nv, int blocks, cudaStream_t stream);
cudaError_t launch_combine_recv(const gpu::CombineRecvParams& p, const NvSlot& nv, int blocks, cudaStream_t stream);

}  // namespace a2a::nvshmem
