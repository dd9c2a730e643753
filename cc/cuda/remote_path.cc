#include "cuda/remote_path.h"

#include <cuda_runtime_api.h>

#include <cstring>
#include <map>
#include <stdexcept>

#include "cuda/check.h"
#include "transfer/connect_order.h"

namespace a2a::cuda {

namespace {

void check(cudaError_t rc, const char* what) { check_cuda(rc, "jax_moe_a2a cuda (inter-node path)", what); }

}  // namespace

uint8_t* RemotePath::pinned(int64_t bytes) {
  bytes = bytes > 0 ? bytes : 16;
  void* p = nullptr;
  check(cudaHostAlloc(&p, bytes, cudaHostAllocMapped | cudaHostAllocPortable), "cudaHostAlloc");
  void* d = nullptr;
  const cudaError_t rc = cudaHostGetDevicePointer(&d, p, 0);
  if (rc != cudaSuccess) cudaFreeHost(p);
  check(rc, "cudaHostGetDevicePointer");
  allocations_.push_back({static_cast<uint8_t*>(p), static_cast<uint8_t*>(d), bytes});
  std::memset(p, 0, bytes);
  return static_cast<uint8_t*>(p);
}

template <typename T>
T* RemotePath::device_ptr(T* host) const {  // the allocation's device base plus the offset
  const uint8_t* h = reinterpret_cast<const uint8_t*>(host);
  for (const Allocation& a : allocations_)
    if (h >= a.host && h < a.host + a.bytes) return reinterpret_cast<T*>(a.device + (h - a.host));
  throw std::logic_error("RemotePath: pointer outside the pinned buffers");
}

RemotePath::RemotePath(const protocol::ExchangeOptions& xo, int rank, const std::string& provider, int local_index)
    : rank_(rank), local_index_(local_index) {
  if (xo.node_size <= 0) throw std::invalid_argument("RemotePath: node_size must be > 0");
  int dev = -1;
  char bus[32] = {0};
  if (cudaGetDevice(&dev) == cudaSuccess && cudaDeviceGetPCIBusId(bus, sizeof(bus), dev) == cudaSuccess) bus_id_ = bus;
  if (xo.slots > proxy::kMaxSlots || xo.shape.num_ranks > proxy::kMaxRanks)
    throw std::invalid_argument("jax_moe_a2a cuda: the inter-node path supports at most 8 slots and 64 ranks");
  try {
    const protocol::SlotLayout lay(xo);
    ctrl_ = reinterpret_cast<proxy::Ctrl*>(pinned(sizeof(proxy::Ctrl)));
    for (int z = 0; z < xo.slots; ++z)
      bufs_.push_back({pinned(lay.d_send_bytes), pinned(lay.d_recv_bytes), pinned(lay.c_send_bytes),
                       pinned(lay.c_recv_bytes)});
    transfer::EngineOptions eo;
    eo.provider = provider;
    eo.rank = rank;
    eo.world_size = xo.shape.num_ranks;
    engine_ = transfer::make_fabric_engine(eo);
    ex_ = std::make_unique<protocol::Exchange>(xo, rank, engine_, bufs_);
  } catch (...) {
    ex_.reset();
    if (engine_) engine_->close();
    for (const Allocation& a : allocations_) cudaFreeHost(a.host);
    allocations_.clear();
    throw;
  }
}

RemotePath::~RemotePath() {
  if (proxy_) proxy_->stop();
  // The engine first: close() lets our posted writes finish (bounded) and only then deregisters
  // every region; closing the regions first (~Exchange) would pull the registrations from under
  // writes still in flight (the last COMB / FREE writes are never awaited by a kernel).
  if (engine_) engine_->close();
  ex_.reset();  // its regions are already closed: no-op
  for (const Allocation& a : allocations_) cudaFreeHost(a.host);  // errors ignored: the context may be gone
}

void RemotePath::connect(const std::vector<std::tuple<int, transfer::Bytes, std::vector<transfer::Bytes>>>& peers) {
  std::vector<transfer::PeerAddress> addrs;
  std::map<int, std::vector<transfer::Bytes>> descs;
  for (const auto& [r, addr, ds] : peers) {
    if (r != rank_) addrs.push_back({r, addr});
    descs[r] = ds;
  }
  engine_->add_peers(addrs);
  transfer::connect_in_order(*engine_, ex_->options().timeout_s);  // tcp;ofi_rxm: one connect per pair
  ex_->connect(descs);
  for (int z = 0; z < ex_->options().slots; ++z) ptrs_.push_back(slot_ptrs(z));
  proxy_ = std::make_unique<proxy::Proxy>(*ex_, ctrl_, proxy::ProxyOptions::from_env(local_index_, bus_id_));
}

RemotePtrs RemotePath::slot_ptrs(int z) const {
  const protocol::SlotLayout& lay = ex_->layout();
  RemotePtrs p{};
  for (int r : ex_->remote_ranks()) p.mask |= 1ull << r;
  p.ctrl = device_ptr(&ctrl_->slot[z]);
  p.error = device_ptr(&ctrl_->error);
  p.d_send = device_ptr(bufs_[z].d_send);
  p.d_recv = device_ptr(bufs_[z].d_recv);
  p.c_send = device_ptr(bufs_[z].c_send);
  p.c_recv = device_ptr(bufs_[z].c_recv);
  p.d_send_rows_off = lay.d_send_rows_off;
  p.priv_off = lay.priv_off;
  p.over_off = lay.over_off;
  p.priv = lay.priv;
  return p;
}

}  // namespace a2a::cuda
