// Host side of the cuda backend's inter-node path for one rank (device side: cuda/remote.cuh): a
// libfabric TransferEngine of its own, every slot's protocol buffers registered with it, the
// protocol::Exchange over it for the peers on other nodes, and the rank's proxy thread.
// Where the rows live (JAX_MOE_A2A_STAGING): in pinned host memory (cudaHostAlloc, mapped) that the
// kernels read and write over PCIe (host, the default); in GPU memory for the kernels and pinned
// host memory for the engine, the proxy copying between them with the copy engines (copy:
// cuda/row_copies.h); or in GPU memory the engine registers (device: only over a NIC with
// GPUDirect RDMA, efa or verbs; not yet run end to end, docs/protocol.md).
// The count matrices and the flag block are always pinned host memory (the proxy reads them).
// The proxy's flags for the kernels go to a GPU-memory copy of the flag block through GDRCopy
// where it works (proxy/gdrcopy.h; else they stay in the mapped host block): flag_path() /
// stats().flag_path say which and why. Built only with libfabric.
#pragma once

#include <array>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "gpu/params.h"
#include "protocol/exchange.h"
#include "proxy/gdrcopy.h"
#include "cuda/row_copies.h"
#include "proxy/proxy.h"
#include "transfer/engine.h"

namespace a2a::cuda {
using namespace ::a2a::gpu;  // the shared device library (cc/gpu)

class RemotePath {
 public:
  enum class RowPath { kHost, kCopy, kDevice };  // JAX_MOE_A2A_STAGING
  // xo.node_size > 0; `local_index` picks the proxy's CPU from JAX_MOE_A2A_PROXY_CPUS.
  RemotePath(const protocol::ExchangeOptions& xo, int rank, const std::string& provider, int local_index);
  ~RemotePath();  // stops the proxy, closes the engine (drains, deregisters), frees the pinned memory
  RemotePath(const RemotePath&) = delete;
  RemotePath& operator=(const RemotePath&) = delete;

  transfer::Bytes address() const { return engine_->address(); }
  std::vector<transfer::Bytes> descriptors() const { return ex_->descriptors(); }
  std::string provider() const { return engine_->provider(); }
  // peers: (rank, engine address, descriptors) of every rank, ours included. Starts the proxy.
  void connect(const std::vector<std::tuple<int, transfer::Bytes, std::vector<transfer::Bytes>>>& peers);
  // Device pointers and flags of slot z for the kernels (mask of the ranks on other nodes).
  RemotePtrs ptrs(int z) const { return ptrs_[z]; }
  // The proxy's failure ("" while healthy) and counters.
  std::string error_text() const { return proxy_ ? proxy_->error_text() : ""; }
  // A half is being enqueued: the proxy polls again (proxy::Proxy::wake). Not called when XLA
  // replays a command buffer, which launches without our handlers.
  void wake() {
    if (proxy_) proxy_->wake();
  }
  proxy::ProxyStats stats() const;
  // "gdrcopy" or "mapped-host: <why not>" (chosen at construction, JAX_MOE_A2A_GDRCOPY).
  const std::string& flag_path() const { return flags_.name; }

 private:
  RemotePtrs slot_ptrs(int z) const;
  uint8_t* pinned(int64_t bytes);  // zeroed, mapped; freed by the destructor
  uint8_t* device(int64_t bytes);  // zeroed GPU memory; freed by the destructor
  // The engine; sets row_path_ from JAX_MOE_A2A_STAGING and its rails from JAX_MOE_A2A_RAILS (unset:
  // two with copy rows, one otherwise; rails_default in remote_path.cc). Under device opened with FI_HMEM, after
  // checking the provider and that it registers CUDA memory of `device_id` (throws otherwise).
  void open_engine(transfer::EngineOptions eo, int device_id);
  void free_all();  // every allocation (errors ignored: the context may be gone)
  template <typename T>
  T* device_ptr(T* p) const;  // a pinned buffer's mapped device address; device buffers as they are
  // GDRCopy: a zeroed copy of the ctrl::Ctrl block in GPU memory mapped through the BAR (flags_.mirror),
  // or the reason it is not used in flags_.name; throws under JAX_MOE_A2A_GDRCOPY=1 without it.
  void setup_flags(int device);
  void release_flags();  // unmaps, unpins and frees the GPU copy (after the proxy stopped)

  int rank_, local_index_;
  std::string bus_id_;  // our GPU's PCI address (the proxy thread runs on a CPU near it)
  // Read at creation: a bad setting is refused there, not in connect() after the engines began to
  // connect (a peer would then wait for us until its timeout).
  proxy::ProxyOptions proxy_opts_;
  struct Allocation {
    uint8_t* host;    // what the host side holds: the pinned pointer, or the GPU address
    uint8_t* device;  // cudaHostGetDevicePointer of host, or the GPU address
    int64_t bytes;
    bool pinned;
  };
  RowPath row_path_ = RowPath::kHost;
  std::vector<std::array<uint8_t*, proxy::kRowBuffers>> kernel_rows_;  // [slot]: the kernels' rows (host address)
  std::unique_ptr<RowCopies> copies_;  // copy: the proxy's row staging
  std::vector<Allocation> allocations_;
  ctrl::Ctrl* ctrl_ = nullptr;
  proxy::FlagPath flags_;                        // where the proxy raises the kernels' flags
  void* gdr_alloc_ = nullptr;                    // cudaMalloc'd; the GPU copy starts at its first 64 KiB page
  ctrl::Ctrl* gdr_ctrl_ = nullptr;              // the GPU copy's device address (null: mapped-host path)
  std::unique_ptr<proxy::gdr::Mapping> gdr_map_;  // its BAR mapping (flags_.mirror)
  std::vector<protocol::SlotBuffers> bufs_;
  std::shared_ptr<transfer::Engine> engine_;
  std::unique_ptr<protocol::Exchange> ex_;
  std::unique_ptr<proxy::Proxy> proxy_;
  std::vector<RemotePtrs> ptrs_;  // per slot, filled by connect
};

}  // namespace a2a::cuda
