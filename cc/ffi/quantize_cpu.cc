// FFI handler: fp8 block quantiser on CPU. Decode, validate, forward to cc/core/quantize.
#include "core/quantize.h"
#include "ffi/common.h"
#include "ffi/handlers.h"

namespace ffi = xla::ffi;

static ffi::Error QuantizeFp8CpuImpl(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> q,
                                     ffi::Result<ffi::Buffer<ffi::F32>> scale, int64_t block,
                                     int32_t pow2) {
  a2a::QuantizeParams p;
  if (auto err = a2a::ffi_util::decode_quantize(x, q, scale, block, pow2, &p); err.failure()) return err;
  a2a::quantize_fp8(p);
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(A2aQuantizeFp8Cpu, QuantizeFp8CpuImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("block")
                                  .Attr<int32_t>("pow2"));
