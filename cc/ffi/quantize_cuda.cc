// FFI handler: fp8 block quantiser on XLA's CUDA stream. Decode, validate, launch.
// Only launches device work and never touches the host: safe inside XLA command buffers.
#include <cuda_runtime_api.h>

#include "gpu/quantize/quantize_fp8.h"
#include "ffi/common.h"
#include "ffi/handlers.h"

namespace ffi = xla::ffi;

static ffi::Error QuantizeFp8CudaImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> q,
                                      ffi::Result<ffi::Buffer<ffi::F32>> scale, int64_t block,
                                      int32_t pow2) {
  a2a::QuantizeParams p;
  if (auto err = a2a::ffi_util::decode_quantize(x, q, scale, block, pow2, &p); err.failure()) return err;
  cudaError_t rc = a2a::gpu::launch_quantize_fp8(p, stream);
  if (rc != cudaSuccess)
    return ffi::Error(ffi::ErrorCode::kInternal,
                      std::string("jax_moe_a2a: quantize_fp8 launch failed: ") + cudaGetErrorString(rc));
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(A2aQuantizeFp8Cuda, QuantizeFp8CudaImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("block")
                                  .Attr<int32_t>("pow2"),
                              {ffi::Traits::kCmdBufferCompatible});
