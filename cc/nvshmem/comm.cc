#include "nvshmem/comm.h"

#include <nvshmem_host.h>

#include <cstdio>
#include <cstring>
#include <stdexcept>

#include "core/align.h"
#include "core/registry.h"
#include "gpu/check.h"
#include "gpu/comm.h"
#include "nvshmem/runtime.h"

namespace a2a::nvshmem {

namespace {

void check(cudaError_t rc, const char* what) { gpu::check_cuda(rc, "jax_moe_a2a nvshmem", what); }


}  // namespace

Layout make_layout(const gpu::Geometry& g) {
  Layout l{};
  l.meta_stride = pad16(4 * meta_words(g));
  l.off_meta = pad16(sizeof(Signals));
  l.off_rows = l.off_meta + int64_t(g.N) * l.meta_stride;
  l.off_c_rows = l.off_rows + int64_t(g.N) * g.P * g.row;
  l.off_priv = pad16(l.off_c_rows + int64_t(g.tp) * g.Q * g.c_stride_max);
  l.off_meta_stage = g.private_slot_bytes;
  l.off_seen = l.off_meta_stage + int64_t(g.N) * l.meta_stride;
  l.off_zero = l.off_seen + pad16(2 * 8 * int64_t(g.N));
  l.slot_bytes = (l.off_priv + pad16(l.off_zero + g.c_stride_max) + 255) / 256 * 256;
  l.bounce_slot_bytes = g.N > 1 ? (int64_t(kBounceWarps) * g.c_stride_max + 255) / 256 * 256 : 0;
  return l;
}

std::vector<std::pair<std::string, int64_t>> buffer_regions(const Config& c) {
  const gpu::GpuOptions o = gpu::gpu_options(c);
  const gpu::Geometry& g = o.g;
  const Layout l = make_layout(g);
  const int64_t z = o.slots, priv = l.off_priv;  // private offsets count from off_priv
  return {{"shared_signals", z * l.off_meta},
          {"shared_meta", z * (l.off_rows - l.off_meta)},
          {"shared_dispatch_rows", z * (l.off_c_rows - l.off_rows)},
          {"shared_combine_rows", z * (priv - l.off_c_rows)},
          {"private_staging", z * (g.off_scratch - g.off_staging)},
          {"private_scratch", z * (g.off_epochs - g.off_scratch)},
          {"private_epochs", z * (g.private_slot_bytes - g.off_epochs)},
          {"private_meta_stage", z * (l.off_seen - l.off_meta_stage)},
          {"private_seen", z * (l.off_zero - l.off_seen)},
          {"private_zero_row", z * (l.slot_bytes - priv - l.off_zero)},  // with the 256-byte padding
          // apart from the block, taken at connect only when a peer is remote (NvComm::bounce_bytes)
          {"private_combine_bounce", z * l.bounce_slot_bytes}};
}

NvComm::NvComm(const Config& c, int rank, int device, int64_t arena_bytes, bool all_remote)
    : o_(gpu::gpu_options(c)), rank_(rank), device_(device), all_remote_(all_remote) {
  if (o_.g.N > kMaxRanks) throw std::invalid_argument("jax_moe_a2a nvshmem: at most 64 ranks");
  nv_.lay = make_layout(o_.g);
  check(cudaSetDevice(device_), "cudaSetDevice");
  barrier_all();
  uint8_t* arena_base = arena(arena_bytes);
  offset_ = arena_alloc(block_bytes());
  if (offset_ < 0)
    throw std::runtime_error("jax_moe_a2a nvshmem: this communicator needs " + std::to_string(block_bytes() >> 20) +
                             " MiB of the NVSHMEM arena (" + std::to_string(arena_size() >> 20) +
                             " MiB, fixed by the first communicator of the process): set JAX_MOE_A2A_NVSHMEM_ARENA "
                             "(bytes) and NVSHMEM_SYMMETRIC_SIZE larger before the first one, or close() others");
  base_ = arena_base + offset_;
  check(cudaMemset(base_, 0, block_bytes()), "cudaMemset");
  check(cudaHostAlloc(reinterpret_cast<void**>(&err_), sizeof(gpu::ErrorRecord), cudaHostAllocMapped),
        "cudaHostAlloc (error record)");
  std::memset(err_, 0, sizeof(gpu::ErrorRecord));
  check(cudaHostGetDevicePointer(reinterpret_cast<void**>(&err_dev_), err_, 0), "cudaHostGetDevicePointer");
  check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  blocks_ = gpu::grid_blocks(device_);
  peer_base_.assign(o_.g.N, nullptr);
  if (timer_.init("jax_moe_a2a nvshmem"))  // benchmarks record the launch geometry next to the kernel times
    std::fprintf(stderr, "jax_moe_a2a nvshmem (rank %d, device %d): cooperative grid of %d blocks\n", rank_, device_,
                 blocks_);
}

float NvComm::kernel_ms(int op) {
  Half h;
  if (!half_of(op, &h)) return -1.f;
  check(cudaSetDevice(device_), "cudaSetDevice");
  return timer_.ms(h, "jax_moe_a2a nvshmem");
}

NvComm::~NvComm() {
  cudaSetDevice(device_);
  cudaDeviceSynchronize();
  if (offset_ >= 0) arena_free(offset_);  // reused only after the barrier of a later NvComm
  if (bounce_offset_ >= 0) arena_free(bounce_offset_);  // private: no peer writes it
  if (err_) cudaFreeHost(err_);
}

std::string NvComm::bootstrap_info() const {
  const int32_t pe = my_pe();
  std::string out(reinterpret_cast<const char*>(&pe), 4);
  out.append(reinterpret_cast<const char*>(&offset_), 8);
  return out;
}

void NvComm::connect(const std::vector<std::string>& peers) {
  if (int(peers.size()) != o_.g.N) throw std::invalid_argument("jax_moe_a2a nvshmem connect: one entry per rank");
  uint8_t* arena_base = base_ - offset_;
  for (int r = 0; r < o_.g.N; ++r) {
    if (peers[r].size() != 12)
      throw std::invalid_argument("jax_moe_a2a nvshmem connect: bad bootstrap info for rank " + std::to_string(r));
    int32_t pe;
    int64_t off;
    std::memcpy(&pe, peers[r].data(), 4);
    std::memcpy(&off, peers[r].data() + 4, 8);
    if (off < 0 || off + block_bytes() > arena_size())
      throw std::invalid_argument("jax_moe_a2a nvshmem connect: rank " + std::to_string(r) + "'s block lies outside the arena");
    nv_.pe[r] = pe;
    peer_base_[r] = arena_base + off;
  }
  if (peer_base_[rank_] != base_) throw std::invalid_argument("jax_moe_a2a nvshmem connect: our own entry does not match");
  // The path of each peer: peers that loads and stores reach (NVLink, the same GPU) take combine
  // rows straight from y; the others (a remote transport), or every other rank when forced, take
  // them through the bounce rows (params.h). Every other put already reads symmetric memory.
  nv_.remote = 0;
  for (int r = 0; r < o_.g.N; ++r)
    if (r != rank_ && (all_remote_ || nvshmem_ptr(peer_base_[r], nv_.pe[r]) == nullptr)) nv_.remote |= 1ull << r;
  if (nv_.remote && bounce_offset_ < 0) {  // the bounce rows, private: only this rank reads or writes them
    if (nv_.lay.bounce_slot_bytes == 0)  // cannot happen: N > 1 whenever a peer exists
      throw std::logic_error("jax_moe_a2a nvshmem connect: remote peers but no bounce rows");
    bounce_offset_ = arena_alloc(bounce_bytes_needed());
    if (bounce_offset_ < 0)
      throw std::runtime_error("jax_moe_a2a nvshmem connect: the bounce rows for remote peers need " +
                               std::to_string(bounce_bytes_needed() >> 20) + " MiB more of the NVSHMEM arena (" +
                               std::to_string(arena_size() >> 20) +
                               " MiB): set JAX_MOE_A2A_NVSHMEM_ARENA (bytes) larger before the first communicator");
    nv_.bounce = arena_base + bounce_offset_;
  }
}

gpu::SlotPtrs NvComm::slot(int z) const {
  gpu::SlotPtrs p{};
  const int64_t at = nv_.lay.slot_bytes * z;
  for (int r = 0; r < o_.g.N; ++r) p.peer_shared[r] = peer_base_[r] ? peer_base_[r] + at : nullptr;
  p.priv = base_ + at + nv_.lay.off_priv;
  p.err = err_dev_;
  p.rank = rank_;
  p.slot = z;
  p.timeout_ns = static_cast<int64_t>(o_.timeout_s * 1e9);
  return p;
}

void NvComm::check_error() const {
  const std::string text = error_text();
  if (!text.empty()) throw std::runtime_error(text);
}

std::string NvComm::error_text() const {
  return gpu::describe_error(*err_, o_.timeout_s, "nvshmem");
}

namespace {
Registry<NvComm>& registry() {
  static Registry<NvComm> r("nvshmem");
  return r;
}
}  // namespace

void register_comm(int64_t id, std::shared_ptr<NvComm> comm) { registry().add(id, std::move(comm)); }
std::shared_ptr<NvComm> find_comm(int64_t id) { return registry().find(id); }
void unregister_comm(int64_t id) { registry().remove(id); }

}  // namespace a2a::nvshmem
