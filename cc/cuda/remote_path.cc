#include "cuda/remote_path.h"

#include <cuda_runtime_api.h>

#include <cstring>
#include <map>
#include <stdexcept>

#include "cuda/preload.h"
#include "gpu/check.h"
#include "transfer/connect_order.h"
#include "core/env.h"

namespace a2a::cuda {
using namespace ::a2a::gpu;  // the shared device library (cc/gpu)

namespace {

void check(cudaError_t rc, const char* what) { check_cuda(rc, "jax_moe_a2a cuda (inter-node path)", what); }

// JAX_MOE_A2A_STAGING's values, in RemotePath::RowPath order (also proxy_stats()["row_path"]).
constexpr const char* kRowPathNames[] = {"host", "copy", "device"};

// JAX_MOE_A2A_STAGING: auto (the default), host, copy or device. auto is copy where CUDA loads
// modules eagerly (copy's precondition: open_engine) and host otherwise. In the layer loop under MPS
// copy rows took 0.97-1.02x host rows' time at 2 ranks and 0.70-0.72x at 4 (one H100, 2026-12-07;
// 0.85-1.05x on other machines; docs/performance.md): the kernels read and write GPU memory and the
// copy engines, not the kernels' loads and stores across PCIe, move the rows to and from the NIC's.
RemotePath::RowPath row_path_from_env() {
  const char* v = env::get("JAX_MOE_A2A_STAGING");
  const std::string t = v && *v ? v : "auto";
  if (t == "auto") return lazy_loading().empty() ? RemotePath::RowPath::kCopy : RemotePath::RowPath::kHost;
  for (int i = 0; i < 3; ++i)
    if (t == kRowPathNames[i]) return static_cast<RemotePath::RowPath>(i);
  throw std::invalid_argument("jax_moe_a2a: JAX_MOE_A2A_STAGING must be auto, host, copy or device, got '" + t + "'");
}

// The rails (engine domains) where JAX_MOE_A2A_RAILS is unset: two with copy rows, one otherwise.
// Two endpoints, each with its own progress thread, take the pieces' posts in parallel instead of
// queueing them behind one endpoint's work (over shm the provider's copies run inside the posts).
// Measured in the layer loop under MPS with copy rows (decode, shm, one GPU, interleaved with one
// rail in the same processes; docs/performance.md): one H100, 0.65-0.81x one rail's time at 2 ranks
// and 0.65-0.72x at 4. Host rows were not compared, so they keep one. A node with one NIC gets two
// domains on it (fabric.cc wraps); `JAX_MOE_A2A_RAILS` decides where set, alike on every process.
int rails_default(RemotePath::RowPath path) { return path == RemotePath::RowPath::kCopy ? 2 : 1; }

// Rows in GPU memory need a transport that moves them without the GPU's help: a NIC reading and
// writing GPU memory (GPUDirect RDMA: efa, verbs). Providers that copy GPU memory themselves (shm,
// tcp: cudaMemcpy on the thread that progresses the engine) stalled on one H200 with a CUDA-enabled
// libfabric 1.22 over shm (2026-12-03): the proxy thread blocked inside the provider while the
// receive kernels, one block on every SM, spun waiting for those very rows, until their timeout
// (most likely the lazy-loading lock described below; over shm / tcp take `copy` instead).
bool moves_gpu_memory_without_the_gpu(const std::string& provider) {
  const std::string first = provider.substr(0, provider.find(';'));
  return first == "efa" || first == "verbs";
}

}  // namespace

uint8_t* RemotePath::pinned(int64_t bytes) {
  bytes = bytes > 0 ? bytes : 16;
  void* p = nullptr;
  check(cudaHostAlloc(&p, bytes, cudaHostAllocMapped | cudaHostAllocPortable), "cudaHostAlloc");
  void* d = nullptr;
  const cudaError_t rc = cudaHostGetDevicePointer(&d, p, 0);
  if (rc != cudaSuccess) cudaFreeHost(p);
  check(rc, "cudaHostGetDevicePointer");
  allocations_.push_back({static_cast<uint8_t*>(p), static_cast<uint8_t*>(d), bytes, true});
  std::memset(p, 0, bytes);
  return static_cast<uint8_t*>(p);
}

uint8_t* RemotePath::device(int64_t bytes) {
  bytes = bytes > 0 ? bytes : 16;
  void* p = nullptr;
  check(cudaMalloc(&p, bytes), "cudaMalloc");
  allocations_.push_back({static_cast<uint8_t*>(p), static_cast<uint8_t*>(p), bytes, false});
  check(cudaMemset(p, 0, bytes), "cudaMemset");
  return static_cast<uint8_t*>(p);
}

void RemotePath::free_all() {
  for (const Allocation& a : allocations_) a.pinned ? cudaFreeHost(a.host) : cudaFree(a.device);
  allocations_.clear();
}

void RemotePath::open_engine(transfer::EngineOptions eo, int device_id) {
  row_path_ = row_path_from_env();
  eo.num_domains = transfer::rails_from_env(rails_default(row_path_));
  auto refuse = [this](const std::string& why) {
    return std::runtime_error(std::string("jax_moe_a2a: JAX_MOE_A2A_STAGING=") +
                              kRowPathNames[static_cast<int>(row_path_)] + " (rows in GPU memory), but " +
                              why + "; JAX_MOE_A2A_STAGING=host keeps them in pinned host memory (auto, the default, "
                              "takes copy only where CUDA loads modules eagerly)");
  };
  if (row_path_ != RowPath::kHost) {
    // Rows in GPU memory put CUDA calls on the proxy's thread (copy: its own copies; device: a
    // provider's). Under lazy loading (CUDA_MODULE_LOADING=LAZY, the default since CUDA 12.2) the first
    // launch of any kernel in the process (XLA's or ours) loads it while holding a driver lock and
    // waiting for the context's running kernels; a receive kernel of ours may be running, spinning
    // until the proxy's next copy, which waits for that lock. One H200, 2026-12-03: test_ops' first op
    // under copy stalled so (cuda-gdb: the proxy in cuMemcpyHtoDAsync on a rwlock, the main thread in
    // cuLaunchKernel, dispatch_recv spinning). Our own kernels are loaded at creation
    // (cuda/preload.h), but XLA's are not: lazy_loading() (cuda/preload.h) says whether CUDA is eager.
    const std::string lazy = lazy_loading();
    if (!lazy.empty())
      throw refuse(lazy + ": the proxy's CUDA calls could wait behind a kernel launch that waits for our spinning "
                   "receive kernels; set CUDA_MODULE_LOADING=EAGER in the environment before the process starts");
  }
  if (row_path_ != RowPath::kDevice) {
    engine_ = transfer::make_fabric_engine(eo);
    return;
  }
  const std::string provider = eo.resolved().provider;
  if (!moves_gpu_memory_without_the_gpu(provider))
    throw refuse("provider '" + provider + "' copies GPU memory with CUDA calls that wait behind the spinning "
                 "receive kernels (GPU rows need efa or verbs: GPUDirect RDMA)");
  eo.hmem = true;
  engine_ = transfer::make_fabric_engine(eo);  // throws where the provider offers no FI_HMEM
  // FI_HMEM does not promise CUDA: register a small GPU buffer to find out.
  uint8_t* probe = device(4096);
  try {
    engine_->register_memory(probe, 4096, transfer::MemoryKind::kCuda, device_id)->close();
  } catch (const std::exception& e) {
    throw refuse(std::string("the engine registers no CUDA memory: ") + e.what());
  }
}

void RemotePath::setup_flags(int device) {
  namespace gdr = proxy::gdr;
  const gdr::Mode mode = gdr::mode_from_env();
  const std::string library = gdr::default_library();
  gdr::Probe pr = gdr::probe(mode, library, gdr::default_device());
  if (pr.available) {
    int supported = 0, ordering = 0;
    if (device < 0 || cudaDeviceGetAttribute(&supported, cudaDevAttrGPUDirectRDMASupported, device) != cudaSuccess ||
        !supported) {
      pr = {false, "the GPU does not support GPUDirect RDMA"};
    } else if (cudaDeviceGetAttribute(&ordering, cudaDevAttrGPUDirectRDMAWritesOrdering, device) != cudaSuccess ||
               ordering < cudaGPUDirectRDMAWritesOrderingOwner) {
      // Running kernels would not see our BAR writes in the order we made them (data before flag).
      pr = {false, "the GPU does not order BAR writes for running kernels (cudaDevAttrGPUDirectRDMAWritesOrdering)"};
    }
  }
  if (pr.available) {
    const uint64_t page = gdr::kGpuPage;
    const uint64_t bytes = (sizeof(ctrl::Ctrl) + page - 1) / page * page;
    void* d = nullptr;
    cudaError_t rc = cudaMalloc(&d, bytes + page);  // one page of slack to align to a GPU page
    if (rc != cudaSuccess) {
      cudaGetLastError();
      pr = {false, std::string("cudaMalloc failed: ") + cudaGetErrorString(rc)};
    } else {
      gdr_alloc_ = d;
      const uint64_t base = (reinterpret_cast<uintptr_t>(d) + page - 1) / page * page;
      rc = cudaMemset(reinterpret_cast<void*>(base), 0, bytes);
      if (rc == cudaSuccess) rc = cudaDeviceSynchronize();  // zeroed before the proxy's first store
      std::string why;
      if (rc != cudaSuccess) {
        cudaGetLastError();
        pr = {false, std::string("cudaMemset failed: ") + cudaGetErrorString(rc)};
      } else if (!(gdr_map_ = gdr::Mapping::create(library, base, bytes, &why))) {
        pr = {false, why};
      } else {
        gdr_ctrl_ = reinterpret_cast<ctrl::Ctrl*>(base);
        flags_.mirror = static_cast<ctrl::Ctrl*>(gdr_map_->host());
      }
      if (!pr.available) release_flags();
    }
  }
  flags_.name = gdr::describe(mode, pr);  // throws under JAX_MOE_A2A_GDRCOPY=1 when unavailable
}

void RemotePath::release_flags() {
  flags_.mirror = nullptr;
  gdr_ctrl_ = nullptr;
  gdr_map_.reset();  // unmap, unpin: before the memory goes
  if (gdr_alloc_) cudaFree(gdr_alloc_);  // errors ignored: the context may be gone
  gdr_alloc_ = nullptr;
}

proxy::ProxyStats RemotePath::stats() const {
  proxy::ProxyStats s = proxy_ ? proxy_->stats() : proxy::ProxyStats{};
  s.flag_path = flags_.name;
  s.row_path = kRowPathNames[static_cast<int>(row_path_)];
  return s;
}

template <typename T>
T* RemotePath::device_ptr(T* p) const {  // the allocation's device base plus the offset
  const uint8_t* h = reinterpret_cast<const uint8_t*>(p);
  for (const Allocation& a : allocations_)
    if (h >= a.host && h < a.host + a.bytes) return reinterpret_cast<T*>(a.device + (h - a.host));
  throw std::logic_error("RemotePath: pointer outside the path's buffers");
}

namespace {

// The writes' pieces where JAX_MOE_A2A_WRITE_CHUNK_KIB / COMB_PIECES are unset: copy rows with one
// remote peer a rank (2 ranks, or 2 nodes of 1) post PRIV in 512 KiB pieces and COMB in 4, each
// piece's copy overlapping the previous piece's wire; everything else one write a peer, split only
// by the rails (one piece a rail for COMB and PRIV / OVER >= 64 KiB; rails_default above). Measured
// in the layer loop under MPS (decode, shm, one GPU; notes/benchmarks.md, 2026-12-07): at 2 ranks the
// pieces took 0.80-0.86x the one-write loop's time on machine A, 0.79-0.80x on C, 0.64-0.77x on B;
// at 4 ranks (three remote peers a rank) 1.08-1.27x (four processes' copies queue on one GPU's copy
// engines); with host rows pieces did not help (B). Every process must cut alike (checked at
// connection), so the rule reads only what is alike everywhere: the row path's settings and the ranks.
void pieces_default(RemotePath::RowPath path, protocol::ExchangeOptions& xo) {
  if (path == RemotePath::RowPath::kCopy && protocol::most_remote_peers(xo, xo.shape.N) == 1) {
    xo.chunk_kib_default = 512;
    xo.comb_pieces_default = 4;
  }
}

}  // namespace

RemotePath::RemotePath(const protocol::ExchangeOptions& xo_in, int rank, const std::string& provider, int local_index)
    : rank_(rank), local_index_(local_index) {
  protocol::ExchangeOptions xo = xo_in;
  if (xo.node_size <= 0) throw std::invalid_argument("RemotePath: node_size must be > 0");
  int dev = -1;
  char bus[32] = {0};
  if (cudaGetDevice(&dev) == cudaSuccess && cudaDeviceGetPCIBusId(bus, sizeof(bus), dev) == cudaSuccess) bus_id_ = bus;
  if (xo.slots > ctrl::kMaxSlots || xo.shape.N > ctrl::kMaxRanks)
    throw std::invalid_argument("jax_moe_a2a cuda: the inter-node path supports at most 8 slots and 64 ranks");
  proxy_opts_ = proxy::ProxyOptions::from_env(local_index_, bus_id_);
  try {
    const protocol::SlotLayout lay(xo);
    transfer::EngineOptions eo;
    eo.provider = provider;
    eo.rank = rank;
    eo.world_size = xo.shape.N;
    open_engine(eo, dev);  // the row path, then the rails by it
    ctrl_ = reinterpret_cast<ctrl::Ctrl*>(pinned(sizeof(ctrl::Ctrl)));
    setup_flags(dev);
    const bool registered_on_gpu = row_path_ == RowPath::kDevice;
    auto rows = [&](int64_t bytes) { return registered_on_gpu ? device(bytes) : pinned(bytes); };
    std::vector<proxy::StagedSlot> copies;
    for (int z = 0; z < xo.slots; ++z) {
      protocol::SlotBuffers b{};
      b.counts_send = pinned(lay.counts_send_bytes);
      b.counts_recv = pinned(lay.counts_bytes);
      b.d_send = rows(lay.d_send_bytes);
      b.d_recv = rows(lay.d_recv_bytes);
      b.c_send = rows(lay.c_send_bytes);
      b.c_recv = rows(lay.c_recv_bytes);
      b.rows_memory = registered_on_gpu ? transfer::MemoryKind::kCuda : transfer::MemoryKind::kHost;
      b.device = dev;
      bufs_.push_back(b);
      proxy::StagedSlot c = proxy::staged_slot(b, lay);
      if (row_path_ == RowPath::kCopy)  // the kernels' own rows in GPU memory
        for (int i = 0; i < proxy::kRowBuffers; ++i) c.packer[i] = device(c.bytes[i]);
      copies.push_back(c);
    }
    if (row_path_ != RowPath::kHost) check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");  // the zeroing is done
    for (const proxy::StagedSlot& c : copies) kernel_rows_.push_back(c.packer);
    if (row_path_ == RowPath::kCopy) copies_ = std::make_unique<RowCopies>(dev, std::move(copies));
    pieces_default(row_path_, xo);
    ex_ = std::make_unique<protocol::Exchange>(xo, rank, engine_, bufs_);
  } catch (...) {
    ex_.reset();
    if (engine_) engine_->close();
    copies_.reset();
    release_flags();
    free_all();
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
  copies_.reset();  // after the proxy stopped: no copy starts any more (one in flight ends with its stream)
  release_flags();
  free_all();
}

void RemotePath::connect(const std::vector<std::tuple<int, transfer::Bytes, std::vector<transfer::Bytes>>>& peers) {
  std::vector<transfer::PeerAddress> addrs;
  std::map<int, std::vector<transfer::Bytes>> descs;
  for (const auto& [r, addr, ds] : peers) {
    if (r != rank_) addrs.push_back({r, addr});
    descs[r] = ds;
  }
  ex_->check_peers(descs);  // before the engines exchange anything: a refusal then leaves nobody waiting
  engine_->add_peers(addrs);
  transfer::connect_in_order(*engine_, ex_->options().timeout_s);  // tcp;ofi_rxm: one connect per pair
  ex_->connect(descs);
  for (int z = 0; z < ex_->options().slots; ++z) ptrs_.push_back(slot_ptrs(z));
  if (row_path_ == RowPath::kDevice) {
    // A provider may finish a write into GPU memory with a cudaMemcpy on the legacy stream that
    // returns before the copy is done (host to device, device to device): wait for it before the
    // kernels read the rows. XLA's streams are non-blocking, so this never waits for our kernels.
    flags_.landing_fence = [] {
      const cudaError_t rc = cudaStreamSynchronize(cudaStreamLegacy);
      if (rc != cudaSuccess)
        throw std::runtime_error(std::string("jax_moe_a2a cuda (inter-node path): cudaStreamSynchronize(legacy) "
                                             "before raising a landed flag: ") + cudaGetErrorString(rc));
    };
  }
  proxy_ = std::make_unique<proxy::Proxy>(*ex_, ctrl_, proxy_opts_, flags_, copies_.get());
}

RemotePtrs RemotePath::slot_ptrs(int z) const {
  const protocol::SlotLayout& lay = ex_->layout();
  RemotePtrs p{};
  for (int r : ex_->remote_ranks()) p.mask |= 1ull << r;
  p.ctrl = device_ptr(&ctrl_->slot[z]);
  // The proxy's flags: in GPU memory under GDRCopy (the kernels poll locally), else beside ours.
  p.in = gdr_ctrl_ ? &gdr_ctrl_->slot[z] : device_ptr(&ctrl_->slot[z]);
  p.error = gdr_ctrl_ ? &gdr_ctrl_->error : device_ptr(&ctrl_->error);
  p.counts_send = reinterpret_cast<int32_t*>(device_ptr(bufs_[z].counts_send));
  p.counts_recv = reinterpret_cast<const int32_t*>(device_ptr(bufs_[z].counts_recv));
  p.d_send = device_ptr(kernel_rows_[z][0]);  // proxy::RowBuffer order
  p.d_recv = device_ptr(kernel_rows_[z][1]);
  p.c_send = device_ptr(kernel_rows_[z][2]);
  p.c_recv = device_ptr(kernel_rows_[z][3]);
  p.over_off = lay.over_off;
  p.priv = lay.priv;
  return p;
}

}  // namespace a2a::cuda
