// Programmatic dependent launch (PDL): a kernel launched with the attribute below may start while
// the stream's previous kernel is still finishing, so its launch and prologue overlap that
// kernel's tail. Such a kernel calls wait_for_previous_grid() in every thread before its first
// global read or write (the previous kernel done and its writes visible; a no-op for a launch
// without the attribute), and may call allow_next_grid() to let the stream's next kernel, if
// launched the same way, start early too (it waits likewise). Used by the grouped GEMMs' own
// kernels (cc/gemm: the fp8 kernels and the SwiGLU kernel).
#pragma once

#include <cuda_runtime_api.h>

namespace a2a::gpu {

// The launch attribute (cudaLaunchKernelEx) that allows the overlap.
inline cudaLaunchAttribute pdl_attribute() {
  cudaLaunchAttribute a{};
  a.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  a.val.programmaticStreamSerializationAllowed = 1;
  return a;
}

__device__ __forceinline__ void wait_for_previous_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void allow_next_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

}  // namespace a2a::gpu
