// The cuda backend's communicator: library-owned device memory per local rank, shared with the
// other ranks of the node through CUDA IPC (other processes) or plain pointers (this process),
// plus the registry the FFI handlers use to find it.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "core/config.h"
#include "gpu/comm.h"
#include "gpu/kernel_timer.h"
#include "gpu/params.h"

namespace a2a::cuda {
using namespace ::a2a::gpu;  // the shared device library (cc/gpu)

class RemotePath;

// Bytes per rank of each region the cuda backend allocates for `c` (all slots), in allocation
// order: device memory (shared_*: peers write it; private_*), then, with peers on other nodes
// (node_size < N, a build with libfabric), the pinned host buffers of the inter-node path
// (remote_*). The one place these sizes are computed; device_bytes is the device memory's total.
std::vector<std::pair<std::string, int64_t>> buffer_regions(const Config& c);
int64_t device_bytes(const Config& c);

class RankState {
 public:
  RankState(const GpuOptions& o, int rank, int device, int local_index = 0);
  ~RankState();
  RankState(const RankState&) = delete;
  RankState& operator=(const RankState&) = delete;

  // 64-byte cudaIpcMemHandle_t of our shared allocation, then our process token (8 bytes).
  std::string bootstrap_info() const;
  // peers[r] = bootstrap_info of rank r; `local` maps ranks of this process to their states.
  // Ranks on other nodes are skipped (their IPC handles are not opened).
  void connect(const std::vector<std::string>& peers, const std::map<int, RankState*>& local);
  bool on_my_node(int r) const { return o_.node_size <= 0 || r / o_.node_size == rank_ / o_.node_size; }
  // The inter-node path (null when every peer is on our node).
  RemotePath* remote() const { return remote_.get(); }

  SlotPtrs slot(int z) const;
  const Geometry& geometry() const { return o_.g; }
  int device() const { return device_; }
  int blocks() const { return blocks_; }
  int rank() const { return rank_; }
  // Throws std::runtime_error describing a kernel timeout recorded earlier, if any.
  void check_error() const;
  // The same description, or "" (reads mapped host memory: works after the context died).
  std::string error_text() const;
  uint8_t* shared_base() const { return shared_; }

  // Kernel timing (JAX_MOE_A2A_KERNEL_TIMING=1 or nosync at creation, gpu/kernel_timer.h): CUDA
  // events around each launch (with 1, after a GPU-side barrier of the node-local ranks), op
  // 0..3 = dispatch_send, dispatch_recv, combine_send, combine_recv. Not recorded while XLA
  // captures a command buffer (events there would time graph construction, not the kernel).
  cudaError_t launch_timed(Half op, cudaStream_t stream, cudaError_t (*launch)(const void*, int, cudaStream_t),
                           const void* params);
  // Milliseconds of op's last timed launch (waits for it); negative when none was recorded.
  float kernel_ms(int op);

 private:
  GpuOptions o_;
  int rank_, device_, blocks_;
  int64_t shared_bytes_, private_bytes_;
  uint8_t* shared_ = nullptr;
  uint8_t* private_ = nullptr;
  ErrorRecord* err_ = nullptr;  // cudaHostAlloc(mapped)
  ErrorRecord* err_dev_ = nullptr;
  std::vector<uint8_t*> peers_;     // shared base of every rank, as mapped here
  std::vector<uint8_t*> opened_;    // IPC mappings to close
  std::unique_ptr<RemotePath> remote_;
  KernelTimer timer_;
  uint64_t timing_barriers_ = 0;  // timing barriers passed (every rank counts the same launches)
};

class CudaComm {
 public:
  // ranks[i] (within the EP group) on devices[i]; its proxy (if any) is the process's local rank
  // first_local_index + i (the index counts this process's ranks over all groups).
  CudaComm(const GpuOptions& o, const std::vector<int>& ranks, const std::vector<int>& devices,
           int first_local_index = 0);
  RankState& rank(int r);
  std::map<int, RankState*> locals();
  // The local rank on CUDA device `device`, or null (the handlers' per-call lookup: no allocation).
  RankState* on_device(int device);

 private:
  std::map<int, std::unique_ptr<RankState>> ranks_;
};

// Process-wide table: (communicator id, EP group) -> CudaComm. A communicator over one axis of a
// larger mesh has one CudaComm per EP group this process holds ranks of (its own peers, buffers
// and IPC exchange); a device holds at most one rank of a communicator, so the handlers find
// their group by device (find_on_device), never by an operand (device memory, unreadable here).
void register_comm(int64_t id, std::shared_ptr<CudaComm> comm, int group = 0);
std::shared_ptr<CudaComm> find_comm(int64_t id, int group = 0);  // throws std::invalid_argument if unknown
// The group of `id` with a local rank on CUDA device `device`, or null (no allocation).
std::shared_ptr<CudaComm> find_on_device(int64_t id, int device);
std::vector<std::shared_ptr<CudaComm>> find_groups(int64_t id);  // every local group, ascending
void unregister_comm(int64_t id);  // every group of `id`

// Process token: distinguishes this process from others in bootstrap data.
uint64_t process_token();

}  // namespace a2a::cuda
