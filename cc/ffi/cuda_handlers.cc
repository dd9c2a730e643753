// FFI handlers of the `cuda` backend: decode, validate, fill the kernels' parameter structs,
// launch on XLA's stream. They only launch device work with pointers that stay fixed (library
// buffers; XLA buffers passed per call), so they are command-buffer compatible.
#include <cuda_runtime_api.h>

#include <exception>
#include <string>

#include "cuda/comm.h"
#include "cuda/kernels.h"
#include "ffi/gpu_handlers.h"
#include "ffi/handlers.h"

namespace ffi = xla::ffi;
namespace cu = a2a::cuda;
using a2a::ffi_gpu::decode;

namespace {

// Launches through the rank's timer (CUDA events when JAX_MOE_A2A_KERNEL_TIMING=1).
template <typename Params, cudaError_t (*Launch)(const Params&, int, cudaStream_t)>
cudaError_t launch(cu::RankState& st, int op, cudaStream_t stream, const Params& p) {
  return st.launch_timed(
      op, stream, [](const void* q, int blocks, cudaStream_t s) { return Launch(*static_cast<const Params*>(q), blocks, s); },
      &p);
}

// Finds the rank's state by device: operands live in device memory (unreadable here, and a host
// copy is impossible inside a graph), and a device holds at most one rank of a communicator, so
// (comm id, device) names the EP group and the rank within it. `dev` is XLA's device ordinal for
// this call (no stream queries: they are not allowed while XLA captures a command buffer).
template <typename F>
ffi::Error run(const char* op, int64_t comm_id, int32_t dev, F&& f) {
  try {
    auto comm = cu::find_on_device(comm_id, dev);
    cudaError_t rc = cudaSuccess;
    cu::RankState* st = comm ? comm->on_device(dev) : nullptr;
    if (!st)
      return ffi::Error(ffi::ErrorCode::kInternal, "jax_moe_a2a cuda: communicator " + std::to_string(comm_id) +
                                                       " has no local rank on device " + std::to_string(dev) +
                                                       " (unknown id, or closed)");
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
    if (cudaError_t rc = decode(&p, x, x_scale, ids, weights, num_tokens, handle, dest, pair_slot, dropped)) return rc;
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
    decode(&p, handle, x, scale, group_sizes, weights, src, recv_slot, recv_counts, overflow);
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
    if (cudaError_t rc = decode(&p, y, recv_counts, handle)) return rc;
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
    decode(&p, handle, dest, pair_slot, weights, num_tokens, out_in, out, pairs, y_kind);
    return launch<cu::CombineRecvParams, cu::launch_combine_recv>(st, 3, stream, p);
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(A2aCudaDispatchSend, DispatchSend, A2A_GPU_BIND_DISPATCH_SEND, {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(A2aCudaDispatchRecv, DispatchRecv, A2A_GPU_BIND_DISPATCH_RECV, {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(A2aCudaCombineSend, CombineSend, A2A_GPU_BIND_COMBINE_SEND, {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(A2aCudaCombineRecv, CombineRecv, A2A_GPU_BIND_COMBINE_RECV, {ffi::Traits::kCmdBufferCompatible});
