// CUDA fp8 block quantiser (the GPU twin of cc/core/quantize.cc).
#pragma once

#include <cuda_runtime_api.h>

#include "core/quantize.h"

namespace a2a::cuda {

// Quantises p.x [p.rows, p.hidden] into p.q (e4m3fn) and p.scale [p.rows, p.hidden / p.scale_block]
// on `stream`. One warp per scale block; lanes stride the block so loads are coalesced.
cudaError_t launch_quantize_fp8(const QuantizeParams& p, cudaStream_t stream);

}  // namespace a2a::cuda
