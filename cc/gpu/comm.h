// The host side that both GPU backends' communicators share (cc/cuda/comm.h, cc/nvshmem/comm.h):
// their options read from the Config, the one way a slot's Geometry is made, the launch grid, and
// the text of a kernel timeout recorded in an ErrorRecord.
#pragma once

#include <cstdint>
#include <string>

#include "core/config.h"
#include "gpu/params.h"

namespace a2a::gpu {

// What a GPU communicator reads of its Config (gpu_options(config)). node_size, priv_rows and
// provider concern the cuda backend's inter-node path only (the nvshmem backend ignores them).
// Transport: node_size 0 puts every rank in one node; peers on other nodes go through the proxy
// and a TransferEngine over `provider` (cuda/remote_path.h).
struct GpuOptions : TransportOptions {
  Geometry g{};          // make_geometry(shape_of(config))
};

// The shape plus every byte offset of one slot (the one way a Geometry is made).
Geometry make_geometry(const MoeShape& s);
GpuOptions gpu_options(const Config& c);

// Private scratch bytes per slot (routing and arrangement tables) for a geometry.
int64_t scratch_bytes(const Geometry& g);

// Blocks per kernel launch for this device (one per SM: co-resident, as a cooperative launch needs).
int grid_blocks(int device);

// Text of a kernel timeout recorded in `e` ("" when none), naming the backend.
std::string describe_error(const ErrorRecord& e, double timeout_s, const char* backend);

}  // namespace a2a::gpu
