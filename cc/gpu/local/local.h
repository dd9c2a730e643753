// EP = 1, the local path of the GPU backends (cuda, nvshmem): with one rank on the EP axis nothing
// moves between ranks, so dispatch is one kernel that routes the tokens and writes them straight
// into dispatch_recv's outputs, and combine is one kernel that reduces the expert outputs where
// they are (docs/gpu_kernels.md, "EP = 1"). The results are those of the exchange kernels at
// N = 1, bit for bit: the same routing (gpu/block_route.cuh), the same canonical order (local
// expert, then token), the same quantiser and the same reduction (gpu/reduce.cuh).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "gpu/params.h"

namespace a2a::cuda {

// The local dispatch kernel's chunk kind for these parameters (gpu/token_chunks.cuh: 0/1/2
// quantise f32/bf16/f16 x, 3 copy), or -1 where it does not apply: N or tp_size above 1, K > 16,
// routing tables past 48 KiB of shared memory (large T), x or the x output not 16-byte aligned,
// or sizes and dtypes the register chunks do not take. There the handler runs the exchange
// kernels (dispatch_send, then dispatch_recv) instead.
int local_dispatch_kind(const LocalDispatchParams& p);
cudaError_t launch_local_dispatch(const LocalDispatchParams& p, int kind, int blocks, cudaStream_t stream);

// The local combine: any shape (N = 1).
cudaError_t launch_local_combine(const LocalCombineParams& p, int blocks, cudaStream_t stream);

}  // namespace a2a::cuda
