// CUDA fp8 block quantiser (the GPU twin of cc/core/quantize.cc).
#pragma once

#include <cuda_runtime_api.h>

#include "core/quantize.h"

namespace a2a::gpu {

// Quantises p.x [p.rows, p.hidden] into p.q (e4m3fn) and p.scale [p.rows, ceil(p.hidden / p.scale_block)]
// (the last block of a row partial when scale_block does not divide hidden)
// on `stream`. One warp per scale block; lanes stride the block so loads are coalesced.
cudaError_t launch_quantize_fp8(const QuantizeParams& p, cudaStream_t stream);

}  // namespace a2a::gpu
