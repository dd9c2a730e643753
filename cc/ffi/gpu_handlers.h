// What the GPU backends' FFI handlers (cuda, nvshmem) share: the dtype codes of the kernels, the
// decoding of each half's operands into the cuda parameter structs, and each half's binding
// (operands, results, attributes). A backend's handler adds only finding its state and launching.
#pragma once

#include <cuda_runtime_api.h>

#include "gpu/params.h"
#include "xla/ffi/api/ffi.h"

namespace a2a::ffi_gpu {

namespace ffi = xla::ffi;

// Element kind of the kernels: 0 f32, 1 bf16, 2 f16, 3 fp8 e4m3; -1 for anything else.
inline int kind_of(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return 0;
    case ffi::DataType::BF16: return 1;
    case ffi::DataType::F16: return 2;
    case ffi::DataType::F8E4M3FN: return 3;
    default: return -1;
  }
}

// x [T, H] f32/bf16/f16 (or fp8 with x_scale [T, S] f32; else x_scale is empty), ids [T, K] s32,
// weights [T, K] f32, num_tokens [] s32 -> handle [2], dest [T, K], pair_slot [T, K], dropped [].
// The geometry and slot pointers are the caller's. Returns cudaErrorInvalidValue for a bad dtype.
inline cudaError_t decode(cuda::DispatchSendParams* p, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> x_scale,
                          ffi::Buffer<ffi::S32> ids, ffi::Buffer<ffi::F32> weights, ffi::Buffer<ffi::S32> num_tokens,
                          ffi::Result<ffi::Buffer<ffi::S32>> handle, ffi::Result<ffi::Buffer<ffi::S32>> dest,
                          ffi::Result<ffi::Buffer<ffi::S32>> pair_slot, ffi::Result<ffi::Buffer<ffi::S32>> dropped) {
  p->x = x.untyped_data();
  p->x_kind = kind_of(x.element_type());
  p->x_scale = x_scale.element_count() ? x_scale.typed_data() : nullptr;
  p->ids = ids.typed_data();
  p->weights = weights.typed_data();
  p->num_tokens = num_tokens.typed_data();
  p->handle = handle->typed_data();
  p->dest = dest->typed_data();
  p->pair_slot = pair_slot->typed_data();
  p->dropped = dropped->typed_data();
  return p->x_kind < 0 ? cudaErrorInvalidValue : cudaSuccess;
}

// handle [2] -> x [R', H] wire dtype, scale [R', S] f32 (empty unless fp8), group_sizes [L],
// weights [R'], src [R', 2], recv_slot [R'], recv_counts [N, L], overflow [].
inline cudaError_t decode(cuda::DispatchRecvParams* p, ffi::Buffer<ffi::S32> handle, ffi::Result<ffi::AnyBuffer> x,
                          ffi::Result<ffi::Buffer<ffi::F32>> scale, ffi::Result<ffi::Buffer<ffi::S32>> group_sizes,
                          ffi::Result<ffi::Buffer<ffi::F32>> weights, ffi::Result<ffi::Buffer<ffi::S32>> src,
                          ffi::Result<ffi::Buffer<ffi::S32>> recv_slot, ffi::Result<ffi::Buffer<ffi::S32>> recv_counts,
                          ffi::Result<ffi::Buffer<ffi::S32>> overflow) {
  p->handle = handle.typed_data();
  p->x = x->untyped_data();
  p->scale = scale->element_count() ? scale->typed_data() : nullptr;
  p->group_sizes = group_sizes->typed_data();
  p->weights = weights->typed_data();
  p->src = src->typed_data();
  p->recv_slot = recv_slot->typed_data();
  p->recv_counts = recv_counts->typed_data();
  p->overflow = overflow->typed_data();
  return cudaSuccess;
}

// y [R', H] f32/bf16/f16, recv_counts [N, L] s32 -> handle [2].
inline cudaError_t decode(cuda::CombineSendParams* p, ffi::AnyBuffer y, ffi::Buffer<ffi::S32> recv_counts,
                          ffi::Result<ffi::Buffer<ffi::S32>> handle) {
  p->y = y.untyped_data();
  p->y_kind = kind_of(y.element_type());
  p->recv_counts = recv_counts.typed_data();
  p->handle = handle->typed_data();
  return p->y_kind < 0 || p->y_kind == 3 ? cudaErrorInvalidValue : cudaSuccess;
}

// handle [2], dest/pair_slot [T, K] s32, weights [T, K] f32, num_tokens [], out_in [T, H] or
// empty -> out [T, H] combine dtype, pairs [T, K, H] f32 or empty.
inline cudaError_t decode(cuda::CombineRecvParams* p, ffi::Buffer<ffi::S32> handle, ffi::Buffer<ffi::S32> dest,
                          ffi::Buffer<ffi::S32> pair_slot, ffi::Buffer<ffi::F32> weights,
                          ffi::Buffer<ffi::S32> num_tokens, ffi::AnyBuffer out_in, ffi::Result<ffi::AnyBuffer> out,
                          ffi::Result<ffi::Buffer<ffi::F32>> pairs, int32_t y_kind) {
  p->handle = handle.typed_data();
  p->y_kind = y_kind;
  p->dest = dest.typed_data();
  p->pair_slot = pair_slot.typed_data();
  p->weights = weights.typed_data();
  p->num_tokens = num_tokens.typed_data();
  p->out_in = out_in.element_count() ? out_in.untyped_data() : nullptr;
  p->out_in_kind = kind_of(out_in.element_type());
  p->out = out->untyped_data();
  p->out_kind = kind_of(out->element_type());
  p->pairs = pairs->element_count() ? pairs->typed_data() : nullptr;
  return cudaSuccess;
}

}  // namespace a2a::ffi_gpu

// The bindings of the four halves (same operands for every GPU backend).
#define A2A_GPU_BIND_DISPATCH_SEND                                                                                  \
  ::xla::ffi::Ffi::Bind()                                                                                           \
      .Ctx<::xla::ffi::PlatformStream<cudaStream_t>>()                                                              \
      .Ctx<::xla::ffi::DeviceOrdinal>()                                                                             \
      .Arg<::xla::ffi::AnyBuffer>()                                                                                 \
      .Arg<::xla::ffi::Buffer<::xla::ffi::F32>>()                                                                   \
      .Arg<::xla::ffi::Buffer<::xla::ffi::S32>>()                                                                   \
      .Arg<::xla::ffi::Buffer<::xla::ffi::F32>>()                                                                   \
      .Arg<::xla::ffi::Buffer<::xla::ffi::S32>>()                                                                   \
      .Arg<::xla::ffi::AnyBuffer>()                                                                                 \
      .Ret<::xla::ffi::Buffer<::xla::ffi::S32>>()                                                                   \
      .Ret<::xla::ffi::Buffer<::xla::ffi::S32>>()                                                                   \
      .Ret<::xla::ffi::Buffer<::xla::ffi::S32>>()                                                                   \
      .Ret<::xla::ffi::Buffer<::xla::ffi::S32>>()                                                                   \
      .Attr<int64_t>("comm_id")                                                                                     \
      .Attr<int32_t>("slot")                                                                                        \
      .Attr<int64_t>("call_id")

#define A2A_GPU_BIND_DISPATCH_RECV                                                                                  \
  ::xla::ffi::Ffi::Bind()                                                                                           \
      .Ctx<::xla::ffi::PlatformStream<cudaStream_t>>()                                                              \
      .Ctx<::xla::ffi::DeviceOrdinal>()                                                                             \
      .Arg<::xla::ffi::Buffer<::xla::ffi::S32>>()                                                                   \
      .Ret<::xla::ffi::AnyBuffer>()                                                                                 \
      .Ret<::xla::ffi::Buffer<::xla::ffi::F32>>()                                                                   \
      .Ret<::xla::ffi::Buffer<::xla::ffi::S32>>()                                                                   \
      .Ret<::xla::ffi::Buffer<::xla::ffi::F32>>()                                                                   \
      .Ret<::xla::ffi::Buffer<::xla::ffi::S32>>()                                                                   \
      .Ret<::xla::ffi::Buffer<::xla::ffi::S32>>()                                                                   \
      .Ret<::xla::ffi::Buffer<::xla::ffi::S32>>()                                                                   \
      .Ret<::xla::ffi::Buffer<::xla::ffi::S32>>()                                                                   \
      .Attr<int64_t>("comm_id")                                                                                     \
      .Attr<int32_t>("slot")

#define A2A_GPU_BIND_COMBINE_SEND                                                                                   \
  ::xla::ffi::Ffi::Bind()                                                                                           \
      .Ctx<::xla::ffi::PlatformStream<cudaStream_t>>()                                                              \
      .Ctx<::xla::ffi::DeviceOrdinal>()                                                                             \
      .Arg<::xla::ffi::AnyBuffer>()                                                                                 \
      .Arg<::xla::ffi::Buffer<::xla::ffi::S32>>()                                                                   \
      .Arg<::xla::ffi::AnyBuffer>()                                                                                 \
      .Ret<::xla::ffi::Buffer<::xla::ffi::S32>>()                                                                   \
      .Attr<int64_t>("comm_id")                                                                                     \
      .Attr<int32_t>("slot")                                                                                        \
      .Attr<int64_t>("call_id")

#define A2A_GPU_BIND_COMBINE_RECV                                                                                   \
  ::xla::ffi::Ffi::Bind()                                                                                           \
      .Ctx<::xla::ffi::PlatformStream<cudaStream_t>>()                                                              \
      .Ctx<::xla::ffi::DeviceOrdinal>()                                                                             \
      .Arg<::xla::ffi::Buffer<::xla::ffi::S32>>()                                                                   \
      .Arg<::xla::ffi::Buffer<::xla::ffi::S32>>()                                                                   \
      .Arg<::xla::ffi::Buffer<::xla::ffi::S32>>()                                                                   \
      .Arg<::xla::ffi::Buffer<::xla::ffi::F32>>()                                                                   \
      .Arg<::xla::ffi::Buffer<::xla::ffi::S32>>()                                                                   \
      .Arg<::xla::ffi::AnyBuffer>()                                                                                 \
      .Ret<::xla::ffi::AnyBuffer>()                                                                                 \
      .Ret<::xla::ffi::Buffer<::xla::ffi::F32>>()                                                                   \
      .Attr<int64_t>("comm_id")                                                                                     \
      .Attr<int32_t>("slot")                                                                                        \
      .Attr<int32_t>("y_kind")
