// EP = 1, the local path of the GPU backends (cuda, nvshmem): with one rank on the EP axis nothing
// moves between ranks, so dispatch is one kernel that routes the tokens and writes them straight
// into dispatch_recv's outputs, and combine is one kernel that reduces the expert outputs where
// they are (docs/gpu_kernels.md, "EP = 1"). The results are those of the exchange kernels at
// N = 1, bit for bit: the same routing (gpu/block_route.cuh), the same canonical order (local
// expert, then token), the same quantiser and the same reduction (gpu/reduce.cuh).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "gpu/chunk_kind.h"
#include "gpu/params.h"

namespace a2a::gpu {

// The local dispatch kernel for these parameters: the chunk kind (gpu/token_chunks.cuh: quantise
// x of a float kind, or copy) of the block-routed kernel (gpu/local/dispatch.cu), with
// grid_routed set for the grid-routed kernel (gpu/local/dispatch_grid.cu) when its routing tables
// pass 48 KiB of shared memory (large T, prefill); !ok() where neither applies: N or tp_size above 1, K > 16, x or the x output not 16-byte aligned,
// pre-quantised fp8 x with the rows dequantised on receive,
// sizes and dtypes the register chunks do not take, or (grid-routed) tables past the slot's
// private area or the shared memory a block may take. There the handler runs the exchange kernels
// (dispatch_send, then dispatch_recv) instead.
ChunkKind local_dispatch_kind(const LocalDispatchParams& p);
// `blocks`: one per SM (the grid-routed kernel takes up to two per SM, cooperatively).
cudaError_t launch_local_dispatch(const LocalDispatchParams& p, ChunkKind kind, int blocks, cudaStream_t stream);

// The grid-routed kernel (gpu/local/dispatch_grid.cu): whether its tables fit, and its launch.
bool local_dispatch_grid_fits(const LocalDispatchParams& p, int64_t max_smem);
cudaError_t launch_local_dispatch_grid(const LocalDispatchParams& p, ChunkKind kind, int sms, cudaStream_t stream);

// The local combine: any shape (N = 1).
cudaError_t launch_local_combine(const LocalCombineParams& p, int blocks, cudaStream_t stream);

}  // namespace a2a::gpu
