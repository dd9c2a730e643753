#include "cuda/comm.h"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <stdexcept>

#include "core/registry.h"
#include "cuda/kernels.h"
#include "cuda/preload.h"
#include "gpu/check.h"
#ifdef JAX_MOE_A2A_WITH_LIBFABRIC
#include "cuda/remote_path.h"
#else
namespace a2a::cuda {
using namespace ::a2a::gpu;  // the shared device library (cc/gpu)
class RemotePath {};  // never constructed: node_size with remote peers raises without libfabric
}  // namespace a2a::cuda
#endif

namespace a2a::cuda {
using namespace ::a2a::gpu;  // the shared device library (cc/gpu)

namespace {

void check(cudaError_t rc, const char* what) { check_cuda(rc, "jax_moe_a2a cuda", what); }


}  // namespace

uint64_t process_token() {
  static const uint64_t token = [] {
    std::random_device rd;
    return (uint64_t(rd()) << 32) ^ rd() ^ uint64_t(getpid());
  }();
  return token;
}

namespace {
#ifdef JAX_MOE_A2A_WITH_LIBFABRIC
protocol::ExchangeOptions exchange_options(const GpuOptions& o) {
  protocol::ExchangeOptions xo;
  static_cast<TransportOptions&>(xo) = o;
  xo.shape = o.g;  // the MoeShape part
  return xo;
}
#endif
[[maybe_unused]] bool any_remote(const GpuOptions& o) {
  return o.node_size > 0 && o.node_size < o.g.N;
}
}  // namespace

std::vector<std::pair<std::string, int64_t>> buffer_regions(const Config& c) {
  const GpuOptions o = gpu_options(c);
  const Geometry& g = o.g;
  const int64_t z = o.slots;
  std::vector<std::pair<std::string, int64_t>> r = {
      {"shared_flags", z * g.off_counts},
      {"shared_counts", z * (g.off_rows - g.off_counts)},
      {"shared_dispatch_rows", z * (g.off_c_rows - g.off_rows)},
      {"shared_combine_rows", z * (g.shared_slot_bytes - g.off_c_rows)},
      {"private_staging", z * (g.off_scratch - g.off_staging)},
      {"private_scratch", z * (g.off_epochs - g.off_scratch)},
      {"private_epochs", z * (g.private_slot_bytes - g.off_epochs)},  // Epochs and the owed FREE values
  };
#ifdef JAX_MOE_A2A_WITH_LIBFABRIC
  if (any_remote(o)) {
    const protocol::SlotLayout lay(exchange_options(o));
    r.push_back({"remote_counts", z * (lay.counts_send_bytes + lay.counts_bytes)});
    r.push_back({"remote_dispatch_send", z * lay.d_send_bytes});
    r.push_back({"remote_dispatch_recv", z * lay.d_recv_bytes});
    r.push_back({"remote_combine_send", z * lay.c_send_bytes});
    r.push_back({"remote_combine_recv", z * lay.c_recv_bytes});
  }
#endif
  return r;
}

int64_t device_bytes(const Config& c) {
  const GpuOptions o = gpu_options(c);
  return int64_t(o.slots) * (o.g.shared_slot_bytes + o.g.private_slot_bytes);
}

RankState::RankState(const GpuOptions& o, int rank, int device, int local_index) : o_(o), rank_(rank), device_(device) {
  if (o_.g.N > kMaxRanks) throw std::invalid_argument("jax_moe_a2a cuda: at most 64 ranks");
  if (o_.node_size < 0) throw std::invalid_argument("jax_moe_a2a cuda: node_size must be >= 0");
  bool remote = false;
  for (int r = 0; r < o_.g.N; ++r) remote = remote || !on_my_node(r);
  shared_bytes_ = o_.g.shared_slot_bytes * o_.slots;
  private_bytes_ = o_.g.private_slot_bytes * o_.slots;
  check(cudaSetDevice(device_), "cudaSetDevice");
  check(cudaMalloc(reinterpret_cast<void**>(&shared_), shared_bytes_), "cudaMalloc (shared buffers)");
  check(cudaMemset(shared_, 0, shared_bytes_), "cudaMemset");
  check(cudaMalloc(reinterpret_cast<void**>(&private_), private_bytes_), "cudaMalloc (private buffers)");
  check(cudaMemset(private_, 0, private_bytes_), "cudaMemset");
  check(cudaHostAlloc(reinterpret_cast<void**>(&err_), sizeof(ErrorRecord), cudaHostAllocMapped), "cudaHostAlloc (error record)");
  std::memset(err_, 0, sizeof(ErrorRecord));
  check(cudaHostGetDevicePointer(reinterpret_cast<void**>(&err_dev_), err_, 0), "cudaHostGetDevicePointer");
  check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  blocks_ = grid_blocks(device_);
  // Every kernel loaded now, not at its first launch inside a step (cuda/preload.h: a lazy load
  // there can wait for a peer's spinning kernel, which waits for us).
  const bool preloaded = preload_kernels(device_, o_.g);
  const std::string report = launch_report(device_, rank_, blocks_, o_.g, preloaded);
  if (!report.empty()) std::fprintf(stderr, "%s", report.c_str());
  peers_.assign(o_.g.N, nullptr);
  if (timer_.init("jax_moe_a2a cuda")) {
    // Benchmarks record the launch geometry next to the kernel times.
    std::fprintf(stderr, "jax_moe_a2a cuda (rank %d, device %d): grid of %d blocks\n", rank_, device_,
                 blocks_);
  }
  if (remote) {
#ifdef JAX_MOE_A2A_WITH_LIBFABRIC
    remote_ = std::make_unique<RemotePath>(exchange_options(o_), rank_, o_.provider, local_index);
#else
    throw std::invalid_argument("jax_moe_a2a cuda: node_size " + std::to_string(o_.node_size) +
                                " puts peers on other nodes, which needs the TransferEngine: rebuild with libfabric");
#endif
  }
}

cudaError_t RankState::launch_timed(Half op, cudaStream_t stream, cudaError_t (*launch)(const void*, int, cudaStream_t),
                                    const void* params) {
  const bool timed = timer_.begin(op, stream, [this](cudaStream_t s) {
    return launch_timing_barrier(slot(0), o_.g.N, ++timing_barriers_, s);
  });
#ifdef JAX_MOE_A2A_WITH_LIBFABRIC
  if (remote_) remote_->wake();  // the proxy polls from now on rather than after its idle sleep
#endif
  cudaError_t rc = launch(params, blocks_, stream);
  while (rc == cudaErrorCooperativeLaunchTooLarge && blocks_ > 1) {
    // Fewer SMs than the device reports (an MPS client limited by CUDA_MPS_ACTIVE_THREAD_PERCENTAGE):
    // the kernels loop over any grid size, so use a smaller co-resident grid from now on.
    cudaGetLastError();
    std::fprintf(stderr, "jax_moe_a2a cuda (rank %d): a cooperative launch of %d blocks is too large here; using %d\n",
                 rank_, blocks_, blocks_ / 2);
    blocks_ = blocks_ / 2;
    rc = launch(params, blocks_, stream);
  }
  if (rc != cudaSuccess) return rc;
  return timed ? timer_.end(op, stream) : cudaSuccess;
}

float RankState::kernel_ms(int op) {
  Half h;
  if (!half_of(op, &h)) return -1.f;
  check(cudaSetDevice(device_), "cudaSetDevice");
  return timer_.ms(h, "jax_moe_a2a cuda");
}

RankState::~RankState() {
  cudaSetDevice(device_);
  cudaDeviceSynchronize();
  remote_.reset();  // proxy thread, engine, pinned buffers
  for (uint8_t* p : opened_) cudaIpcCloseMemHandle(p);
  if (shared_) cudaFree(shared_);
  if (private_) cudaFree(private_);
  if (err_) cudaFreeHost(err_);
}

std::string RankState::bootstrap_info() const {
  cudaIpcMemHandle_t h;
  check(cudaSetDevice(device_), "cudaSetDevice");
  check(cudaIpcGetMemHandle(&h, shared_), "cudaIpcGetMemHandle");
  std::string out(reinterpret_cast<const char*>(&h), sizeof(h));
  const uint64_t tok = process_token();
  out.append(reinterpret_cast<const char*>(&tok), 8);
  return out;
}

void RankState::connect(const std::vector<std::string>& peers, const std::map<int, RankState*>& local) {
  if (int(peers.size()) != o_.g.N) throw std::invalid_argument("jax_moe_a2a cuda connect: one entry per rank");
  check(cudaSetDevice(device_), "cudaSetDevice");
  for (int r = 0; r < o_.g.N; ++r) {
    const std::string& info = peers[r];
    if (info.size() != sizeof(cudaIpcMemHandle_t) + 8)
      throw std::invalid_argument("jax_moe_a2a cuda connect: bad bootstrap info for rank " + std::to_string(r));
    uint64_t tok;
    std::memcpy(&tok, info.data() + sizeof(cudaIpcMemHandle_t), 8);
    auto it = local.find(r);
    if (!on_my_node(r)) continue;  // through the proxy
    if (tok == process_token()) {
      if (it == local.end()) throw std::invalid_argument("jax_moe_a2a cuda connect: rank " + std::to_string(r) + " claims this process");
      peers_[r] = it->second->shared_base();
      if (it->second->device() != device_) {
        cudaError_t rc = cudaDeviceEnablePeerAccess(it->second->device(), 0);
        if (rc != cudaSuccess && rc != cudaErrorPeerAccessAlreadyEnabled) check(rc, "cudaDeviceEnablePeerAccess");
        cudaGetLastError();
      }
      continue;
    }
    cudaIpcMemHandle_t h;
    std::memcpy(&h, info.data(), sizeof(h));
    void* p = nullptr;
    check(cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess),
          ("cudaIpcOpenMemHandle (rank " + std::to_string(r) + ")").c_str());
    peers_[r] = static_cast<uint8_t*>(p);
    opened_.push_back(peers_[r]);
  }
}

SlotPtrs RankState::slot(int z) const {
  SlotPtrs p{};
  for (int r = 0; r < o_.g.N; ++r) p.peer_shared[r] = peers_[r] ? peers_[r] + o_.g.shared_slot_bytes * z : nullptr;
  p.priv = private_ + o_.g.private_slot_bytes * z;
  p.err = err_dev_;
  p.rank = rank_;
  p.slot = z;
  p.timeout_ns = static_cast<int64_t>(o_.timeout_s * 1e9);
#ifdef JAX_MOE_A2A_WITH_LIBFABRIC
  if (remote_) p.remote = remote_->ptrs(z);
#endif
  return p;
}

void RankState::check_error() const {
  const std::string text = error_text();
  if (!text.empty()) throw std::runtime_error(text);
}

std::string RankState::error_text() const {
#ifdef JAX_MOE_A2A_WITH_LIBFABRIC
  if (remote_) {  // the proxy names what the kernel could not see (missing remote ranks, transport errors)
    const std::string text = remote_->error_text();
    if (!text.empty())
      return text + (err_->code ? "; this communicator is unusable (create a new one)" : "");
  }
#endif
  return describe_error(*err_, o_.timeout_s, "cuda");
}

CudaComm::CudaComm(const GpuOptions& o, const std::vector<int>& ranks, const std::vector<int>& devices,
                   int first_local_index) {
  if (ranks.size() != devices.size()) throw std::invalid_argument("CudaComm: one device per local rank");
  for (size_t i = 0; i < ranks.size(); ++i)
    ranks_[ranks[i]] = std::make_unique<RankState>(o, ranks[i], devices[i], first_local_index + static_cast<int>(i));
}

RankState& CudaComm::rank(int r) {
  auto it = ranks_.find(r);
  if (it == ranks_.end()) throw std::invalid_argument("jax_moe_a2a cuda: rank " + std::to_string(r) + " is not local");
  return *it->second;
}

RankState* CudaComm::on_device(int device) {
  for (auto& [r, s] : ranks_)
    if (s->device() == device) return s.get();
  return nullptr;
}

std::map<int, RankState*> CudaComm::locals() {
  std::map<int, RankState*> m;
  for (auto& [r, s] : ranks_) m[r] = s.get();
  return m;
}

namespace {
Registry<CudaComm>& registry() {
  static Registry<CudaComm> r("cuda");
  return r;
}
}  // namespace

void register_comm(int64_t id, std::shared_ptr<CudaComm> comm, int group) {
  registry().add(id, std::move(comm), group);
}
std::shared_ptr<CudaComm> find_comm(int64_t id, int group) { return registry().find(id, group); }
std::shared_ptr<CudaComm> find_on_device(int64_t id, int device) {
  return registry().find_if(id, [device](CudaComm& c) { return c.on_device(device) != nullptr; });
}
std::vector<std::shared_ptr<CudaComm>> find_groups(int64_t id) { return registry().all(id); }
void unregister_comm(int64_t id) { registry().remove(id); }  // freed when the last user lets go

}  // namespace a2a::cuda
