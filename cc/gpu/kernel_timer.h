// CUDA-event times of the four halves' kernels, shared by the cuda and nvshmem backends
// (JAX_MOE_A2A_KERNEL_TIMING at communicator creation; read by the benchmarks):
//   1       a GPU-side barrier of the EP group on the stream, then the start event, the kernel,
//           the end event: pplx-kernels' benchmark method. With N processes time-slicing one
//           GPU, a host barrier leaves each process's events around other processes' work too
//           (the bimodal times of 2026-12-02, notes/benchmarks.md); the barrier on the stream
//           lines every rank's kernel up behind the same point.
//   nosync  the events alone (no barrier): what the benchmarks measured before 2026-12-03.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdlib>
#include <cstring>

#include "core/half.h"
#include "gpu/check.h"
#include "core/env.h"

namespace a2a::gpu {

// One pair of events per op (0..3 = dispatch_send, dispatch_recv, combine_send, combine_recv)
// around that op's last launch on one device. Launches captured into a command buffer are not
// timed: events there would time graph construction, not the kernel.
class KernelTimer {
 public:
  static constexpr int kOps = kNumHalves;
  KernelTimer() = default;
  ~KernelTimer() {
    if (on_)
      for (auto& pair : events_)
        for (auto& e : pair) cudaEventDestroy(e);
  }
  KernelTimer(const KernelTimer&) = delete;
  KernelTimer& operator=(const KernelTimer&) = delete;

  // With the communicator's device current: creates the events when JAX_MOE_A2A_KERNEL_TIMING
  // is 1 or nosync. Returns whether timing is on.
  bool init(const char* who) {
    const char* mode = env::get("JAX_MOE_A2A_KERNEL_TIMING");
    if (on_ || !mode) return on_;
    const bool sync = std::strcmp(mode, "1") == 0, nosync = std::strcmp(mode, "nosync") == 0;
    if (!sync && !nosync) return on_;
    for (auto& pair : events_)
      for (auto& e : pair) check_cuda(cudaEventCreate(&e), who, "cudaEventCreate");
    on_ = true;
    sync_ = sync;
    return on_;
  }
  bool enabled() const { return on_; }

  // When timing is on and the stream is not capturing: `barrier(stream)` (the backend's GPU-side
  // barrier of the EP group, returning a cudaError_t; in mode 1 only), then op's start event.
  // Returns whether the launch is timed (then call end() after it).
  template <typename Barrier>
  bool begin(Half op, cudaStream_t stream, Barrier&& barrier) {
    if (!on_) return false;
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(stream, &capture) != cudaSuccess || capture != cudaStreamCaptureStatusNone) return false;
    if (sync_ && barrier(stream) != cudaSuccess) return false;
    return cudaEventRecord(events_[i(op)][0], stream) == cudaSuccess;
  }
  cudaError_t end(Half op, cudaStream_t stream) {
    const cudaError_t e = cudaEventRecord(events_[i(op)][1], stream);
    recorded_[i(op)] = e == cudaSuccess;
    return e;
  }

  // Milliseconds of op's last timed launch (waits for it; its device must be current); negative
  // when none was recorded.
  float ms(Half op, const char* who) const {
    if (!recorded_[i(op)]) return -1.f;
    check_cuda(cudaEventSynchronize(events_[i(op)][1]), who, "cudaEventSynchronize");
    float ms = -1.f;
    check_cuda(cudaEventElapsedTime(&ms, events_[i(op)][0], events_[i(op)][1]), who, "cudaEventElapsedTime");
    return ms;
  }

 private:
  static int i(Half op) { return static_cast<int>(op); }
  bool on_ = false;
  bool sync_ = false;
  cudaEvent_t events_[kOps][2] = {};
  bool recorded_[kOps] = {};
};

}  // namespace a2a::gpu
