// Host side of our own fp8 kernels' launches (gemm_fp8_wgmma.cu): the TMA descriptors
// (cuTensorMapEncodeTiled, fetched from the driver at run time: the library never links libcuda),
// the launch configuration and the per-device shared-memory limit.
#pragma once

#include <atomic>
#include <cstdint>

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>

#include "gemm/fp8_wgmma.cuh"  // kBM, kBK, kThreads
#include "gpu/pdl.cuh"

namespace a2a::gemm::wgmma {

inline constexpr int kMaxDevices = 64;  // devices a process keeps per-device launch state for (more: set each launch)

inline PFN_cuTensorMapEncodeTiled_v12000 encoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess)
      f = nullptr;
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  }();
  return fn;
}

// A [rows, k] e4m3 row-major tensor read as [box_rows, 128 k] boxes, 128-byte swizzled (the WGMMA
// operand layout of fp8_wgmma.cuh); rows past the tensor read as zeros.
inline bool encode_rows(CUtensorMap* map, const void* base, uint64_t rows, uint64_t k, int box_rows = kBM) {
  auto fn = encoder();
  if (fn == nullptr) return false;
  const cuuint64_t dims[2] = {k, rows};
  const cuuint64_t strides[1] = {k};  // bytes between rows
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(kBK), static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t elem[2] = {1, 1};
  return fn(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, const_cast<void*>(base), dims, strides, box, elem,
            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// A launch's configuration: grid, block, shared memory and stream, with programmatic stream
// serialization (the kernel may start while the stream's previous kernel finishes: gpu/pdl.cuh)
// when pdl is set, and a cluster size above 1. attr: room for both.
inline cudaLaunchConfig_t launch_config(int grid, size_t smem, cudaStream_t stream, bool pdl, int cluster,
                                 cudaLaunchAttribute (&attr)[2]) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(static_cast<unsigned>(grid));
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = 0;
  if (cluster > 1) {
    attr[cfg.numAttrs].id = cudaLaunchAttributeClusterDimension;
    attr[cfg.numAttrs].val.clusterDim.x = static_cast<unsigned>(cluster);
    attr[cfg.numAttrs].val.clusterDim.y = 1;
    attr[cfg.numAttrs].val.clusterDim.z = 1;
    ++cfg.numAttrs;
  }
  if (pdl) attr[cfg.numAttrs++] = gpu::pdl_attribute();
  return cfg;
}

// Sets `kernel`'s dynamic shared-memory limit to `bytes` once per device and kernel (the limit
// belongs to each device's context; one process may drive several GPUs), not at every launch.
template <class Kernel>
cudaError_t smem_limit_once(Kernel kernel, int bytes, std::atomic<bool> (&set)[kMaxDevices]) {
  int dev = 0;
  if (cudaError_t e = cudaGetDevice(&dev); e != cudaSuccess) return e;
  if (dev < kMaxDevices && set[dev].load(std::memory_order_acquire)) return cudaSuccess;
  if (cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes); e != cudaSuccess) return e;
  if (dev < kMaxDevices) set[dev].store(true, std::memory_order_release);
  return cudaSuccess;
}

}  // namespace a2a::gemm::wgmma
