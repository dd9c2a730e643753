// The GPU-side barrier that kernel timing (JAX_MOE_A2A_KERNEL_TIMING=1) puts on the stream before
// each timed launch, so that every rank's kernel starts from the same point and the CUDA events
// around it time the kernel alone: the method of pplx-kernels' own benchmark
// (nvshmemx_barrier_all_on_stream before each half), which a host barrier cannot replace when N
// processes time-slice one GPU (each process's events then also hold other processes' work).
// One block; thread r < N raises our count in rank r's flags and waits for rank r's in ours
// (slot 0's SyncFlags::timing). Ranks on other nodes are skipped (no mapping: the proxy's).
#include <cstdio>

#include "cuda/device.cuh"
#include "cuda/kernels.h"
#include "gpu/ptx.cuh"

namespace a2a::cuda {
using namespace ::a2a::gpu;  // the shared device library (cc/gpu)
namespace {

__global__ void timing_barrier_kernel(SlotPtrs p, int N, uint64_t count) {
  const int r = threadIdx.x;
  if (r >= N || p.peer_shared[r] == nullptr) return;
  ptx::st_release_sys(&flags_of(p, r)->timing[p.rank], count);
  const uint64_t* mine = &flags_of(p, p.rank)->timing[r];
  const uint64_t start = ptx::globaltimer();
  while (ptx::ld_acquire_sys(mine) < count) {
    if (ptx::globaltimer() - start > static_cast<uint64_t>(p.timeout_ns)) {
      printf("jax_moe_a2a cuda (rank %d): timing barrier %llu: rank %d never arrived; timing goes on unsynchronised\n",
             p.rank, static_cast<unsigned long long>(count), r);
      return;
    }
    __nanosleep(100);
  }
}

}  // namespace

cudaError_t launch_timing_barrier(const SlotPtrs& slot0, int num_ranks, uint64_t count, cudaStream_t stream) {
  timing_barrier_kernel<<<1, 64, 0, stream>>>(slot0, num_ranks, count);
  return cudaGetLastError();
}

void timing_barrier_kernels(std::vector<KernelRef>* out) {
  out->push_back({"timing_barrier", reinterpret_cast<const void*>(&timing_barrier_kernel), 0, 64, false});
}

}  // namespace a2a::cuda
