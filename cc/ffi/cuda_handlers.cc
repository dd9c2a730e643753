// FFI handlers of the `cuda` backend: decode, validate, fill the kernels' parameter structs,
// launch on XLA's stream. They only launch device work with pointers that stay fixed (library
// buffers; XLA buffers passed per call), so they are command-buffer compatible.
#include <cuda_runtime_api.h>

#include <exception>
#include <string>

#include "cuda/comm.h"
#include "cuda/kernels.h"
#include "ffi/common.h"
#include "ffi/handlers.h"

namespace ffi = xla::ffi;
namespace cu = a2a::cuda;

namespace {

int kind_of(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return 0;
    case ffi::DataType::BF16: return 1;
    case ffi::DataType::F16: return 2;
    case ffi::DataType::F8E4M3FN: return 3;
    default: return -1;
  }
}

// Finds the rank's state (rank read from a host copy is impossible inside a graph, so the rank
// comes as an attribute-free operand only for validation; the communicator maps one local rank
// per device).
// `dev` is XLA's device ordinal for this call (no stream queries: they are not allowed while XLA
// captures a command buffer).
// Launches through the rank's timer (CUDA events when JAX_MOE_A2A_KERNEL_TIMING=1).
template <typename Params, cudaError_t (*Launch)(const Params&, int, cudaStream_t)>
cudaError_t launch(cu::RankState& st, int op, cudaStream_t stream, const Params& p) {
  return st.launch_timed(
      op, stream, [](const void* q, int blocks, cudaStream_t s) { return Launch(*static_cast<const Params*>(q), blocks, s); },
      &p);
}

template <typename F>
ffi::Error run(const char* op, int64_t comm_id, int32_t dev, F&& f) {
  try {
    auto comm = cu::find_comm(comm_id);
    cudaError_t rc = cudaSuccess;
    cu::RankState* st = nullptr;
    for (auto& [r, s] : comm->locals())
      if (s->device() == dev) st = s;
    if (!st) return ffi::Error(ffi::ErrorCode::kInternal, "jax_moe_a2a cuda: no local rank on this stream's device");
    st->check_error();
    int cur = -1;
    if (cudaGetDevice(&cur) != cudaSuccess || cur != dev) rc = cudaSetDevice(dev);
    if (rc == cudaSuccess) rc = f(*st);
    if (rc != cudaSuccess)
      return ffi::Error(ffi::ErrorCode::kInternal, std::string("jax_moe_a2a cuda ") + op + ": " + cudaGetErrorString(rc));
    return ffi::Error::Success();
  } catch (const std::exception& e) {
    return ffi::Error(ffi::ErrorCode::kInternal, std::string("jax_moe_a2a cuda ") + op + ": " + e.what());
  }
}

ffi::Error DispatchSend(cudaStream_t stream, int32_t dev, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> x_scale, ffi::Buffer<ffi::S32> ids,
                        ffi::Buffer<ffi::F32> weights, ffi::Buffer<ffi::S32> num_tokens, ffi::AnyBuffer after,
                        ffi::Result<ffi::Buffer<ffi::S32>> handle, ffi::Result<ffi::Buffer<ffi::S32>> dest,
                        ffi::Result<ffi::Buffer<ffi::S32>> pair_slot, ffi::Result<ffi::Buffer<ffi::S32>> dropped,
                        int64_t comm_id, int32_t slot, int64_t call_id) {
  (void)after;
  (void)call_id;
  return run("dispatch_send", comm_id, dev, [&](cu::RankState& st) {
    cu::DispatchSendParams p{};
    p.g = st.geometry();
    p.p = st.slot(slot);
    p.x = x.untyped_data();
    p.x_kind = kind_of(x.element_type());
    p.x_scale = x_scale.element_count() ? x_scale.typed_data() : nullptr;
    p.ids = ids.typed_data();
    p.weights = weights.typed_data();
    p.num_tokens = num_tokens.typed_data();
    p.handle = handle->typed_data();
    p.dest = dest->typed_data();
    p.pair_slot = pair_slot->typed_data();
    p.dropped = dropped->typed_data();
    if (p.x_kind < 0) return cudaErrorInvalidValue;
    return launch<cu::DispatchSendParams, cu::launch_dispatch_send>(st, 0, stream, p);
  });
}

ffi::Error DispatchRecv(cudaStream_t stream, int32_t dev, ffi::Buffer<ffi::S32> handle, ffi::Result<ffi::AnyBuffer> x,
                        ffi::Result<ffi::Buffer<ffi::F32>> scale, ffi::Result<ffi::Buffer<ffi::S32>> group_sizes,
                        ffi::Result<ffi::Buffer<ffi::F32>> weights, ffi::Result<ffi::Buffer<ffi::S32>> src,
                        ffi::Result<ffi::Buffer<ffi::S32>> recv_slot, ffi::Result<ffi::Buffer<ffi::S32>> recv_counts,
                        ffi::Result<ffi::Buffer<ffi::S32>> overflow, int64_t comm_id, int32_t slot) {
  return run("dispatch_recv", comm_id, dev, [&](cu::RankState& st) {
    cu::DispatchRecvParams p{};
    p.g = st.geometry();
    p.p = st.slot(slot);
    p.handle = handle.typed_data();
    p.x = x->untyped_data();
    p.scale = scale->element_count() ? scale->typed_data() : nullptr;
    p.group_sizes = group_sizes->typed_data();
    p.weights = weights->typed_data();
    p.src = src->typed_data();
    p.recv_slot = recv_slot->typed_data();
    p.recv_counts = recv_counts->typed_data();
    p.overflow = overflow->typed_data();
    return launch<cu::DispatchRecvParams, cu::launch_dispatch_recv>(st, 1, stream, p);
  });
}

ffi::Error CombineSend(cudaStream_t stream, int32_t dev, ffi::AnyBuffer y, ffi::Buffer<ffi::S32> recv_counts, ffi::AnyBuffer after,
                       ffi::Result<ffi::Buffer<ffi::S32>> handle, int64_t comm_id, int32_t slot, int64_t call_id) {
  (void)after;
  (void)call_id;
  return run("combine_send", comm_id, dev, [&](cu::RankState& st) {
    cu::CombineSendParams p{};
    p.g = st.geometry();
    p.p = st.slot(slot);
    p.y = y.untyped_data();
    p.y_kind = kind_of(y.element_type());
    p.recv_counts = recv_counts.typed_data();
    p.handle = handle->typed_data();
    if (p.y_kind < 0 || p.y_kind == 3) return cudaErrorInvalidValue;
    return launch<cu::CombineSendParams, cu::launch_combine_send>(st, 2, stream, p);
  });
}

ffi::Error CombineRecv(cudaStream_t stream, int32_t dev, ffi::Buffer<ffi::S32> handle, ffi::Buffer<ffi::S32> dest,
                       ffi::Buffer<ffi::S32> pair_slot, ffi::Buffer<ffi::F32> weights, ffi::Buffer<ffi::S32> num_tokens,
                       ffi::AnyBuffer out_in, ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::Buffer<ffi::F32>> pairs,
                       int64_t comm_id, int32_t slot, int32_t y_kind) {
  return run("combine_recv", comm_id, dev, [&](cu::RankState& st) {
    cu::CombineRecvParams p{};
    p.g = st.geometry();
    p.p = st.slot(slot);
    p.handle = handle.typed_data();
    p.y_kind = y_kind;
    p.dest = dest.typed_data();
    p.pair_slot = pair_slot.typed_data();
    p.weights = weights.typed_data();
    p.num_tokens = num_tokens.typed_data();
    p.out_in = out_in.element_count() ? out_in.untyped_data() : nullptr;
    p.out_in_kind = kind_of(out_in.element_type());
    p.out = out->untyped_data();
    p.out_kind = kind_of(out->element_type());
    p.pairs = pairs->element_count() ? pairs->typed_data() : nullptr;
    return launch<cu::CombineRecvParams, cu::launch_combine_recv>(st, 3, stream, p);
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(A2aCudaDispatchSend, DispatchSend,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("comm_id")
                                  .Attr<int32_t>("slot")
                                  .Attr<int64_t>("call_id"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(A2aCudaDispatchRecv, DispatchRecv,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("comm_id")
                                  .Attr<int32_t>("slot"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(A2aCudaCombineSend, CombineSend,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("comm_id")
                                  .Attr<int32_t>("slot")
                                  .Attr<int64_t>("call_id"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(A2aCudaCombineRecv, CombineRecv,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("comm_id")
                                  .Attr<int32_t>("slot")
                                  .Attr<int32_t>("y_kind"),
                              {ffi::Traits::kCmdBufferCompatible});
