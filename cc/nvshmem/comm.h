// The nvshmem backend's communicator: one EP rank per process (one process drives one GPU), its
// buffers a block of the process's NVSHMEM arena (cc/nvshmem/runtime.h), its peers reached with
// NVSHMEM puts and signals at their blocks' symmetric addresses; plus the registry the FFI
// handlers use to find it.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "gpu/comm.h"
#include "gpu/kernel_timer.h"
#include "nvshmem/params.h"

namespace a2a::nvshmem {

// This backend's slot layout around the cuda geometry (gpu::make_geometry, cc/gpu/comm.h).
Layout make_layout(const gpu::Geometry& g);
// Bytes per rank of each region for `c` (all slots), in layout order: the one place these sizes
// are computed. All but the last make the symmetric block; the last, private_combine_bounce, is
// taken apart from it at connect, only when a peer is remote. Their sum (buffer_bytes) is what a
// communicator may take: it sizes the arena.
std::vector<std::pair<std::string, int64_t>> buffer_regions(const Config& c);

class NvComm {
 public:
  // Collective over every PE: waits until every PE's earlier device work is done (so a freed
  // arena block that peers may still have been signalling is safe to reuse), then takes and
  // zeroes this rank's block. `arena_bytes` sizes the arena when this is the first communicator.
  // all_remote: every other rank takes the remote path, also when loads and stores reach it
  // ($JAX_MOE_A2A_NVSHMEM_REMOTE=all: how the remote path runs on one machine).
  NvComm(const Config& c, int rank, int device, int64_t arena_bytes, bool all_remote = false);
  ~NvComm();
  NvComm(const NvComm&) = delete;
  NvComm& operator=(const NvComm&) = delete;

  // Our PE (int32) and block offset in the arena (int64): 12 bytes.
  std::string bootstrap_info() const;
  // peers[r] = bootstrap_info of rank r. Chooses each peer's path (nv().remote): remote when
  // nvshmem_ptr cannot reach its block, or for every other rank with all_remote.
  void connect(const std::vector<std::string>& peers);
  // Bit r: rank r takes the remote path (after connect).
  uint64_t remote_mask() const { return nv_.remote; }

  gpu::SlotPtrs slot(int z) const;
  const NvSlot& nv() const { return nv_; }
  const gpu::Geometry& geometry() const { return o_.g; }
  int device() const { return device_; }
  int blocks() const { return blocks_; }
  int rank() const { return rank_; }
  int64_t block_bytes() const { return int64_t(o_.slots) * nv_.lay.slot_bytes; }
  // Bytes of the bounce rows (all slots): taken at connect when a peer is remote, else 0.
  int64_t bounce_bytes() const { return bounce_offset_ >= 0 ? bounce_bytes_needed() : 0; }
  void check_error() const;
  std::string error_text() const;
  // CUDA events around each half's launch (JAX_MOE_A2A_KERNEL_TIMING=1 at creation), as in the
  // cuda backend: one pair per Half (core/half.h).
  gpu::KernelTimer& timer() { return timer_; }
  // Milliseconds of op's last timed launch (waits for it); negative when none was recorded.
  float kernel_ms(int op);

 private:
  gpu::GpuOptions o_;
  int rank_, device_, blocks_;
  bool all_remote_;
  NvSlot nv_{};
  int64_t bounce_bytes_needed() const { return int64_t(o_.slots) * nv_.lay.bounce_slot_bytes; }
  int64_t offset_ = -1;
  int64_t bounce_offset_ = -1;        // the bounce rows' arena block (connect, remote peers only)
  uint8_t* base_ = nullptr;           // our block (local address)
  std::vector<uint8_t*> peer_base_;   // every rank's block, as a symmetric address valid here
  gpu::ErrorRecord* err_ = nullptr;  // cudaHostAlloc(mapped)
  gpu::ErrorRecord* err_dev_ = nullptr;
  gpu::KernelTimer timer_;
};

void register_comm(int64_t id, std::shared_ptr<NvComm> comm);
std::shared_ptr<NvComm> find_comm(int64_t id);
void unregister_comm(int64_t id);

}  // namespace a2a::nvshmem
