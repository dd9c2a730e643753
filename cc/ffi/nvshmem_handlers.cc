// FFI handlers of the `nvshmem` backend: decode (cc/ffi/gpu_handlers.h), find the communicator
// of this process's rank, launch on XLA's stream. They only launch device work with pointers that
// stay fixed (the symmetric arena; XLA buffers passed per call), so they are command-buffer
// compatible.
#include <exception>
#include <string>

#include "ffi/gpu_handlers.h"
#include "ffi/handlers.h"
#include "nvshmem/comm.h"
#include "nvshmem/kernels.h"

namespace ffi = xla::ffi;
namespace nv = a2a::nvshmem;
using a2a::ffi_gpu::decode;

namespace {

// Decodes into P (geometry and slot pointers of the rank) with `fill`, then launches `launch`
// (between CUDA events when kernel timing is on; op_index 0..3 as in cuda::KernelTimer).
template <typename P, typename Fill>
ffi::Error run(const char* op, int op_index, int64_t comm_id, int32_t dev, int32_t slot, cudaStream_t stream, Fill&& fill,
               cudaError_t (*launch)(const P&, const nv::NvSlot&, int, cudaStream_t)) {
  try {
    auto comm = nv::find_comm(comm_id);
    if (comm->device() != dev)
      return ffi::Error(ffi::ErrorCode::kInternal, "jax_moe_a2a nvshmem: the communicator's rank is on device " +
                                                       std::to_string(comm->device()) + ", not " + std::to_string(dev));
    comm->check_error();
    P p{};
    p.g = comm->geometry();
    p.p = comm->slot(slot);
    cudaError_t rc = fill(&p);
    int cur = -1;
    if (rc == cudaSuccess && (cudaGetDevice(&cur) != cudaSuccess || cur != dev)) rc = cudaSetDevice(dev);
    if (rc == cudaSuccess) {
      const bool timed = comm->timer().begin(op_index, stream);
      rc = launch(p, comm->nv(), comm->blocks(), stream);
      if (rc == cudaSuccess && timed) rc = comm->timer().end(op_index, stream);
    }
    if (rc != cudaSuccess)
      return ffi::Error(ffi::ErrorCode::kInternal, std::string("jax_moe_a2a nvshmem ") + op + ": " + cudaGetErrorString(rc));
    return ffi::Error::Success();
  } catch (const std::exception& e) {
    return ffi::Error(ffi::ErrorCode::kInternal, std::string("jax_moe_a2a nvshmem ") + op + ": " + e.what());
  }
}

ffi::Error DispatchSend(cudaStream_t stream, int32_t dev, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> x_scale, ffi::Buffer<ffi::S32> ids,
                        ffi::Buffer<ffi::F32> weights, ffi::Buffer<ffi::S32> num_tokens, ffi::AnyBuffer /*after*/,
                        ffi::Result<ffi::Buffer<ffi::S32>> handle, ffi::Result<ffi::Buffer<ffi::S32>> dest,
                        ffi::Result<ffi::Buffer<ffi::S32>> pair_slot, ffi::Result<ffi::Buffer<ffi::S32>> dropped,
                        int64_t comm_id, int32_t slot, int64_t /*call_id*/) {
  return run<a2a::cuda::DispatchSendParams>(
      "dispatch_send", 0, comm_id, dev, slot, stream,
      [&](a2a::cuda::DispatchSendParams* p) { return decode(p, x, x_scale, ids, weights, num_tokens, handle, dest, pair_slot, dropped); },
      nv::launch_dispatch_send);
}

ffi::Error DispatchRecv(cudaStream_t stream, int32_t dev, ffi::Buffer<ffi::S32> handle, ffi::Result<ffi::AnyBuffer> x,
                        ffi::Result<ffi::Buffer<ffi::F32>> scale, ffi::Result<ffi::Buffer<ffi::S32>> group_sizes,
                        ffi::Result<ffi::Buffer<ffi::F32>> weights, ffi::Result<ffi::Buffer<ffi::S32>> src,
                        ffi::Result<ffi::Buffer<ffi::S32>> recv_slot, ffi::Result<ffi::Buffer<ffi::S32>> recv_counts,
                        ffi::Result<ffi::Buffer<ffi::S32>> overflow, int64_t comm_id, int32_t slot) {
  return run<a2a::cuda::DispatchRecvParams>(
      "dispatch_recv", 1, comm_id, dev, slot, stream,
      [&](a2a::cuda::DispatchRecvParams* p) { return decode(p, handle, x, scale, group_sizes, weights, src, recv_slot, recv_counts, overflow); },
      nv::launch_dispatch_recv);
}

ffi::Error CombineSend(cudaStream_t stream, int32_t dev, ffi::AnyBuffer y, ffi::Buffer<ffi::S32> recv_counts, ffi::AnyBuffer /*after*/,
                       ffi::Result<ffi::Buffer<ffi::S32>> handle, int64_t comm_id, int32_t slot, int64_t /*call_id*/) {
  return run<a2a::cuda::CombineSendParams>(
      "combine_send", 2, comm_id, dev, slot, stream,
      [&](a2a::cuda::CombineSendParams* p) { return decode(p, y, recv_counts, handle); }, nv::launch_combine_send);
}

ffi::Error CombineRecv(cudaStream_t stream, int32_t dev, ffi::Buffer<ffi::S32> handle, ffi::Buffer<ffi::S32> dest,
                       ffi::Buffer<ffi::S32> pair_slot, ffi::Buffer<ffi::F32> weights, ffi::Buffer<ffi::S32> num_tokens,
                       ffi::AnyBuffer out_in, ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::Buffer<ffi::F32>> pairs,
                       int64_t comm_id, int32_t slot, int32_t y_kind) {
  return run<a2a::cuda::CombineRecvParams>(
      "combine_recv", 3, comm_id, dev, slot, stream,
      [&](a2a::cuda::CombineRecvParams* p) { return decode(p, handle, dest, pair_slot, weights, num_tokens, out_in, out, pairs, y_kind); },
      nv::launch_combine_recv);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(A2aNvshmemDispatchSend, DispatchSend, A2A_GPU_BIND_DISPATCH_SEND, {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(A2aNvshmemDispatchRecv, DispatchRecv, A2A_GPU_BIND_DISPATCH_RECV, {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(A2aNvshmemCombineSend, CombineSend, A2A_GPU_BIND_COMBINE_SEND, {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(A2aNvshmemCombineRecv, CombineRecv, A2A_GPU_BIND_COMBINE_RECV, {ffi::Traits::kCmdBufferCompatible});
