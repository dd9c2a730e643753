// FFI handlers of the `nvshmem` backend: the GPU handlers of cc/ffi/gpu_handlers.h over this
// process's one rank (the communicator) and this backend's launches. Unlike the cuda backend's,
// its dispatch_send writes dest_counts [N] and its combine_recv requires it (the rows each expert
// rank owes us). The elastic EP rank mask reaches the kernels as there (Handlers::set_alive:
// SlotPtrs::alive, null without a mask; this backend's slots have no remote peers, so it is never
// refused here).
#include <cuda_runtime_api.h>

#include <memory>
#include <stdexcept>
#include <string>

#include "ffi/gpu_handlers.h"
#include "ffi/handlers.h"
#include "gpu/local/local.h"
#include "nvshmem/comm.h"
#include "nvshmem/kernels.h"
#include "nvshmem/runtime.h"

namespace {

namespace cu = a2a::gpu;  // the shared device library
namespace nv = a2a::nvshmem;

struct NvshmemBackend {
  static constexpr const char* kName = "nvshmem";
  using Rank = nv::NvComm;

  // One rank per process: the communicator is it (find_comm throws for an unknown id).
  static Rank* find(int64_t comm_id, int32_t dev, std::shared_ptr<void>* keep, std::string* why) {
    auto comm = nv::find_comm(comm_id);
    if (comm->device() != dev) {
      *why = "jax_moe_a2a nvshmem: the communicator's rank is on device " + std::to_string(comm->device()) +
             ", not " + std::to_string(dev);
      return nullptr;
    }
    Rank* rank = comm.get();
    *keep = std::move(comm);
    return rank;
  }

  // Between CUDA events when kernel timing is on (one pair per Half, gpu::KernelTimer), after a
  // barrier of every PE on the stream in mode 1.
  template <typename P, typename... Extra>
  static cudaError_t launch(Rank& c, a2a::Half op, cudaStream_t stream, const P& p, Extra... extra) {
    const bool timed = c.timer().begin(op, stream, nv::barrier_all_on_stream);
    cudaError_t rc = launch_kernel(c, stream, p, extra...);
    if (rc == cudaSuccess && timed) rc = c.timer().end(op, stream);
    return rc;
  }
  static cudaError_t launch_kernel(Rank& c, cudaStream_t s, const cu::DispatchSendParams& p) {
    return nv::launch_dispatch_send(p, c.nv(), c.blocks(), s);
  }
  static cudaError_t launch_kernel(Rank& c, cudaStream_t s, const cu::DispatchRecvParams& p) {
    return nv::launch_dispatch_recv(p, c.nv(), c.blocks(), s);
  }
  static cudaError_t launch_kernel(Rank& c, cudaStream_t s, const cu::CombineSendParams& p) {
    return nv::launch_combine_send(p, c.nv(), c.blocks(), s);
  }
  static cudaError_t launch_kernel(Rank& c, cudaStream_t s, const cu::CombineRecvParams& p) {
    // it waits for the rows dispatch_send counted (which only the EP = 1 path, not here, leaves out)
    if (!p.dest_counts) throw std::invalid_argument("combine_recv needs dispatch_send's dest_counts [N]");
    return nv::launch_combine_recv(p, c.nv(), c.blocks(), s);
  }
  // EP = 1 (gpu/local/local.h): no NVSHMEM memory involved
  static cudaError_t launch_kernel(Rank& c, cudaStream_t s, const cu::LocalDispatchParams& p, cu::ChunkKind kind) {
    return cu::launch_local_dispatch(p, kind, c.blocks(), s);
  }
  static cudaError_t launch_kernel(Rank& c, cudaStream_t s, const cu::LocalCombineParams& p) {
    return cu::launch_local_combine(p, c.blocks(), s);
  }
};

}  // namespace

A2A_GPU_HANDLERS(A2aNvshmem, NvshmemBackend)
