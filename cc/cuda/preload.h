// The cuda backend's kernels loaded before their first launch, and the launch report.
//
// Why load them early: under lazy loading (CUDA_MODULE_LOADING=LAZY, CUDA's default since 12.2)
// a kernel is loaded at its first launch, and loading it may synchronise the context, i.e. wait
// for the kernels already running (CUDA Programming Guide, "Lazy Loading", "Potential Hazards").
// Our kernels spin until a peer's half arrives, so a peer whose half is a kernel launched for the
// first time can wait for our spinning kernel, which waits for that half: a deadlock that only
// our timeout ends. In one process the proxy thread's CUDA calls met it (cuda/remote_path.cc,
// `copy` rows); under CUDA MPS the clients share the MPS server's GPU context
// (nvidia-cuda-mps-control(1)), so one process's first launch may wait for another process's
// spinning kernel (open item 5: the sixth proxy test under MPS, the first to use the
// grid-routed dispatch_send, hung on the rank that launched it last). Loading every kernel of the
// backend when a communicator is created (cudaFuncGetAttributes loads a kernel) takes the loads
// out of the steps; JAX_MOE_A2A_PRELOAD_KERNELS=0 leaves them to CUDA (the reproducer).
#pragma once

#include <string>

#include "gpu/params.h"

namespace a2a::cuda {
using namespace ::a2a::gpu;  // the shared device library (cc/gpu)

// Loads every kernel the backend may launch for geometry g into `device`'s context (current
// device: `device`), once per device and process, unless JAX_MOE_A2A_PRELOAD_KERNELS=0. Returns
// whether they are loaded now (false: disabled). Throws std::runtime_error when one fails to load.
bool preload_kernels(int device, const Geometry& g);

// "" under eager loading, else why not (lazy, or the driver does not say).
std::string lazy_loading();

// JAX_MOE_A2A_LAUNCH_INFO=1: what the communicator's launches will be, one line per item: the SM
// count the device reports (cudaDevAttrMultiProcessorCount: under MPS the client's share), the
// context's SM limit (cuCtxGetExecAffinity), cooperative launch support, module loading, the grid
// of every half (`blocks` x kThreads), and per kernel its registers, shared memory and
// occupancy (blocks per SM, and how many blocks can be co-resident against the grid). The
// per-kernel figures are left out when the kernels were not preloaded (querying them would load
// them). "" when the variable is unset.
std::string launch_report(int device, int rank, int blocks, const Geometry& g, bool preloaded);

}  // namespace a2a::cuda
