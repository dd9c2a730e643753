// The host side that both GPU backends' communicators share (cc/cuda/comm.h, cc/nvshmem/comm.h):
// their options, the completion of a slot's Geometry, the launch grid, and the text of a kernel
// timeout recorded in an ErrorRecord.
#pragma once

#include <cstdint>
#include <string>

#include "gpu/params.h"

namespace a2a::cuda {

// Options of a GPU communicator. node_size, priv_rows and provider concern the cuda backend's
// inter-node path only (the nvshmem backend ignores them).
struct CudaOptions {
  Geometry g;            // N, E, L, K, H, T, tp, S, scale_block, wire_kind, layout, capacity, pow2 set
  int slots = 2;
  double timeout_s = 60.0;
  // Ranks a, b share a node iff a / node_size == b / node_size (0: every rank in one node). Peers
  // on other nodes go through the proxy and a TransferEngine over `provider` (cuda/remote_path.h).
  int node_size = 0;
  int priv_rows = -1;    // private rows per remote sender (-1: all; protocol::ExchangeOptions)
  std::string provider;  // "" -> $JAX_MOE_A2A_PROVIDER -> shm
};

// Fills P, row, payload and every offset of g (the shape fields must be set).
void finish_geometry(Geometry* g, int slots, int64_t* shared_bytes, int64_t* private_bytes);

// Private scratch bytes per slot (routing and arrangement tables) for a geometry.
int64_t scratch_bytes(const Geometry& g);

// Blocks per kernel launch for this device (one per SM: co-resident, as a cooperative launch needs).
int grid_blocks(int device);

// Text of a kernel timeout recorded in `e` ("" when none), naming the backend.
std::string describe_error(const ErrorRecord& e, double timeout_s, const char* backend);

}  // namespace a2a::cuda
