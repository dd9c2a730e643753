// JAX_MOE_A2A_STAGING=copy: the inter-node path's rows live in GPU memory for the kernels (they pack
// and unpack at GPU memory speed, as on the NVLink path) and in pinned host memory for the engine;
// the proxy thread moves each step's rows between the two with the GPU's copy engines
// (cudaMemcpyAsync on two non-blocking streams of its own, one per direction, each copy's completion
// polled with an event of its own, kCopyDepth per buffer in turn): no SM takes part, and no call waits for the kernels (which may be spinning on
// every SM for those very rows). The proxy's side of it: proxy/staging.h.
#pragma once

#include <cuda_runtime_api.h>

#include <array>
#include <cstdint>
#include <vector>

#include "proxy/staging.h"

namespace a2a::cuda {

class RowCopies final : public proxy::RowStaging {
 public:
  // One slot's row buffers: `packer` in GPU memory (the kernels'), `registered` pinned host memory.
  using Slot = proxy::StagedSlot;
  RowCopies(int device, std::vector<Slot> slots);  // creates the streams and events
  ~RowCopies() override;                           // destroys them (errors ignored)
  RowCopies(const RowCopies&) = delete;
  RowCopies& operator=(const RowCopies&) = delete;

  // On the proxy's thread at its start: the thread's device, then one small copy each way and an
  // event on each stream, waited for, so that nothing the runtime sets up lazily is left for a copy
  // made while our receive kernels spin (such a call can wait for them: proxy/staging.h).
  void prepare() override;
  uint64_t start(int z, proxy::RowBuffer b, const std::vector<protocol::ByteRange>& ranges) override;
  bool done(int z, proxy::RowBuffer b, uint64_t ticket) override;

 private:
  void on_thread();  // the calling thread's current device is ours (the proxy thread's first call)
  void release();    // destroys the events and streams made so far (errors ignored)

  int device_;
  std::vector<Slot> slots_;
  cudaStream_t to_host_ = nullptr, to_gpu_ = nullptr;
  void* scratch_gpu_ = nullptr;   // prepare()'s 64 bytes
  void* scratch_host_ = nullptr;  // pinned
  // [slot][buffer][ticket % kCopyDepth]: the event recorded after that copy
  using Events = std::array<std::array<cudaEvent_t, proxy::kCopyDepth>, proxy::kRowBuffers>;
  std::vector<Events> events_;
  std::vector<std::array<uint64_t, proxy::kRowBuffers>> tickets_;  // [slot][buffer]: the last ticket given
};

}  // namespace a2a::cuda
