// The kernel translation units of cc/gemm: one entry point per family (internal to the layer).
#pragma once

#include <cstddef>

#include <cuda_runtime_api.h>

#include "gemm/grouped_gemm.h"

namespace a2a::gemm::detail {

size_t fp8_workspace_bytes(const GroupedGemmParams& p, int sm_count);
cudaError_t run_fp8(const GroupedGemmParams& p, int sm_count, cudaStream_t stream);
size_t bf16_workspace_bytes(const GroupedGemmParams& p, int sm_count);
cudaError_t run_bf16(const GroupedGemmParams& p, int sm_count, cudaStream_t stream);

}  // namespace a2a::gemm::detail
