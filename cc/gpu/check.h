// Turning a CUDA runtime error into an exception that names who called and what failed.
#pragma once

#include <cuda_runtime_api.h>

#include <stdexcept>
#include <string>

namespace a2a::gpu {

// Throws std::runtime_error("<who>: <what>: <CUDA's text>") unless rc is cudaSuccess.
inline void check_cuda(cudaError_t rc, const char* who, const char* what) {
  if (rc != cudaSuccess) throw std::runtime_error(std::string(who) + ": " + what + ": " + cudaGetErrorString(rc));
}

}  // namespace a2a::gpu
