// The kernel translation units of cc/gemm: one entry point per family (internal to the layer).
#pragma once

#include <cstddef>
#include <cstdlib>
#include <cstring>

#include <cuda_runtime_api.h>

#include "gemm/grouped_gemm.h"
#include "core/env.h"

namespace a2a::gemm::detail {

// Few rows per group (decode: bound by the weights' bytes): tiles of 64 rows (ping-pong
// schedule), so a group of a handful of rows pads less, each weight byte costs half the
// tensor-core work of a 128-row tile, and more tiles spread over the SMs. Decided from static
// shapes only (the mean rows per group <= 128); JAX_MOE_A2A_GEMM_TILE_M=64 or 128 forces one
// (for measurements; read at every call, so the workspace size and the launch agree).
inline bool few_rows_per_group(const GroupedGemmParams& p) {
  if (const char* force = env::get("JAX_MOE_A2A_GEMM_TILE_M")) {
    if (std::strcmp(force, "64") == 0) return true;
    if (std::strcmp(force, "128") == 0) return false;
  }
  const int64_t rows_total = p.layout == Layout::kRagged ? p.rows : p.rows * p.num_groups;
  return p.num_groups > 0 && rows_total <= 128 * p.num_groups;
}

size_t fp8_workspace_bytes(const GroupedGemmParams& p, int sm_count);
cudaError_t run_fp8(const GroupedGemmParams& p, int sm_count, cudaStream_t stream);
size_t bf16_workspace_bytes(const GroupedGemmParams& p, int sm_count);
cudaError_t run_bf16(const GroupedGemmParams& p, int sm_count, cudaStream_t stream);

}  // namespace a2a::gemm::detail
