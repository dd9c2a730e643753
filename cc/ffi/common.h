// Small helpers shared by the FFI handlers: dtype decoding and error construction.
#pragma once

#include <string>

#include "core/dtype.h"
#include "core/quantize.h"
#include "xla/ffi/api/ffi.h"

namespace a2a::ffi_util {

namespace ffi = xla::ffi;

inline ffi::Error invalid(const std::string& msg) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument, "jax_moe_a2a: " + msg);
}

// The one map from an XLA dtype to the library's ElemKind (core/dtype.h); false for a dtype that
// is none of them. Every handler (host, cuda, nvshmem, the quantiser) decodes dtypes with it.
inline bool elem_kind_of(ffi::DataType t, ElemKind* kind) {
  switch (t) {
    case ffi::DataType::F32: *kind = ElemKind::kF32; return true;
    case ffi::DataType::BF16: *kind = ElemKind::kBF16; return true;
    case ffi::DataType::F16: *kind = ElemKind::kF16; return true;
    case ffi::DataType::F8E4M3FN: *kind = ElemKind::kF8E4M3; return true;
    default: return false;
  }
}

// Decodes and validates the operands of the fp8 quantiser into QuantizeParams.
//   x:     [rows, hidden] f32 / bf16 / f16
//   q:     [rows, hidden] f8e4m3fn
//   scale: [rows, ceil(hidden / block)] f32 (the last block partial when block does not divide hidden)
inline ffi::Error decode_quantize(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> q,
                                  ffi::Result<ffi::Buffer<ffi::F32>> scale, int64_t block,
                                  int32_t pow2, QuantizeParams* p) {
  auto dims = x.dimensions();
  if (dims.size() != 2) return invalid("quantize_fp8: x must be 2-D [rows, hidden]");
  if (!elem_kind_of(x.element_type(), &p->kind) || !is_float(p->kind))
    return invalid("quantize_fp8: x must be f32, bf16 or f16");
  if (q->element_type() != ffi::DataType::F8E4M3FN) return invalid("quantize_fp8: q must be f8e4m3fn");
  if (block <= 0) return invalid("quantize_fp8: block must be positive");
  auto sd = scale->dimensions();
  if (sd.size() != 2 || sd[0] != dims[0] || sd[1] != fp8_num_blocks(dims[1], block))
    return invalid("quantize_fp8: scale must be [rows, ceil(hidden / block)]");
  p->x = x.untyped_data();
  p->rows = dims[0];
  p->hidden = dims[1];
  p->scale_block = block;
  p->pow2_scale = pow2 != 0;
  p->q = static_cast<uint8_t*>(q->untyped_data());
  p->scale = scale->typed_data();
  return ffi::Error::Success();
}

}  // namespace a2a::ffi_util

// An ElemKind attribute (combine_recv's y_kind) decodes as the enum, from its int32 code.
XLA_FFI_REGISTER_ENUM_ATTR_DECODING(a2a::ElemKind);
