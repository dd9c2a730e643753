// Host side of the cuda backend's inter-node path for one rank (device side: cuda/remote.cuh):
// pinned host memory (cudaHostAlloc, mapped) for every slot's protocol buffers and the flag block,
// registered with a libfabric TransferEngine of its own; the protocol::Exchange over it for the
// peers on other nodes; and the rank's proxy thread. The RDMA-facing buffers are host memory
// because the provider on our GPU machine has no FI_HMEM (docs/transfer_engine.md); kernels read
// and write them through their mapped device pointers. Built only with libfabric.
#pragma once

#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "cuda/params.h"
#include "protocol/exchange.h"
#include "proxy/proxy.h"
#include "transfer/engine.h"

namespace a2a::cuda {

class RemotePath {
 public:
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
  proxy::ProxyStats stats() const { return proxy_ ? proxy_->stats() : proxy::ProxyStats{}; }

 private:
  RemotePtrs slot_ptrs(int z) const;
  uint8_t* pinned(int64_t bytes);  // zeroed, mapped; freed by the destructor
  template <typename T>
  T* device_ptr(T* host) const;

  int rank_, local_index_;
  std::string bus_id_;  // our GPU's PCI address (the proxy thread runs on a CPU near it)
  struct Allocation {
    uint8_t* host;
    uint8_t* device;  // cudaHostGetDevicePointer of host
    int64_t bytes;
  };
  std::vector<Allocation> allocations_;
  proxy::Ctrl* ctrl_ = nullptr;
  std::vector<protocol::SlotBuffers> bufs_;
  std::shared_ptr<transfer::Engine> engine_;
  std::unique_ptr<protocol::Exchange> ex_;
  std::unique_ptr<proxy::Proxy> proxy_;
  std::vector<RemotePtrs> ptrs_;  // per slot, filled by connect
};

}  // namespace a2a::cuda
