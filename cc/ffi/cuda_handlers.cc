// FFI handlers of the `cuda` backend: the GPU handlers of cc/ffi/gpu_handlers.h over this
// backend's rank lookup and launches.
#include <cuda_runtime_api.h>

#include <memory>
#include <string>

#include "cuda/comm.h"
#include "cuda/kernels.h"
#include "ffi/gpu_handlers.h"
#include "ffi/handlers.h"
#include "gpu/local/local.h"

namespace {

namespace cu = a2a::cuda;

struct CudaBackend {
  static constexpr const char* kName = "cuda";
  using Rank = cu::RankState;

  // By device: operands live in device memory (unreadable here, and a host copy is impossible
  // inside a graph), and a device holds at most one rank of a communicator, so (comm id, device)
  // names the EP group and the rank within it. `dev` is XLA's device ordinal for this call (no
  // stream queries: they are not allowed while XLA captures a command buffer).
  static Rank* find(int64_t comm_id, int32_t dev, std::shared_ptr<void>* keep, std::string* why) {
    auto comm = cu::find_on_device(comm_id, dev);
    Rank* rank = comm ? comm->on_device(dev) : nullptr;
    if (!rank)
      *why = "jax_moe_a2a cuda: communicator " + std::to_string(comm_id) + " has no local rank on device " +
             std::to_string(dev) + " (unknown id, or closed)";
    *keep = std::move(comm);
    return rank;
  }

  // Through the rank's timer (CUDA events when JAX_MOE_A2A_KERNEL_TIMING=1).
  template <typename P, cudaError_t (*Launch)(const P&, int, cudaStream_t)>
  static cudaError_t timed(Rank& st, a2a::Half op, cudaStream_t stream, const P& p) {
    return st.launch_timed(
        op, stream, [](const void* q, int blocks, cudaStream_t s) { return Launch(*static_cast<const P*>(q), blocks, s); },
        &p);
  }
  static cudaError_t launch(Rank& st, a2a::Half op, cudaStream_t s, const cu::DispatchSendParams& p) {
    return timed<cu::DispatchSendParams, cu::launch_dispatch_send>(st, op, s, p);
  }
  static cudaError_t launch(Rank& st, a2a::Half op, cudaStream_t s, const cu::DispatchRecvParams& p) {
    return timed<cu::DispatchRecvParams, cu::launch_dispatch_recv>(st, op, s, p);
  }
  static cudaError_t launch(Rank& st, a2a::Half op, cudaStream_t s, const cu::CombineSendParams& p) {
    return timed<cu::CombineSendParams, cu::launch_combine_send>(st, op, s, p);
  }
  static cudaError_t launch(Rank& st, a2a::Half op, cudaStream_t s, const cu::CombineRecvParams& p) {
    return timed<cu::CombineRecvParams, cu::launch_combine_recv>(st, op, s, p);
  }
  // EP = 1 (gpu/local/local.h)
  struct LocalDispatch {
    cu::LocalDispatchParams p;
    cu::ChunkKind kind;
  };
  static cudaError_t launch_local_dispatch(const LocalDispatch& l, int blocks, cudaStream_t s) {
    return cu::launch_local_dispatch(l.p, l.kind, blocks, s);
  }
  static cudaError_t launch(Rank& st, a2a::Half op, cudaStream_t s, const cu::LocalDispatchParams& p, cu::ChunkKind kind) {
    return timed<LocalDispatch, launch_local_dispatch>(st, op, s, LocalDispatch{p, kind});
  }
  static cudaError_t launch(Rank& st, a2a::Half op, cudaStream_t s, const cu::LocalCombineParams& p) {
    return timed<cu::LocalCombineParams, cu::launch_local_combine>(st, op, s, p);
  }
};

}  // namespace

A2A_GPU_HANDLERS(A2aCuda, CudaBackend)
