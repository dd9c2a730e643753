// The grid every kernel of the GPU backends runs on (kThreads per block, one block per SM: see
// grid_blocks in gpu/comm.h): the calling thread's position, the two launchers, and the
// last-block-done count that closes a kernel without a grid barrier.
#pragma once

#include <cooperative_groups.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace a2a::gpu {

namespace cg = cooperative_groups;

constexpr int kThreads = 512;

// Where the calling thread sits in a 1-D grid: lane, global warp, global thread, strides.
struct GridIdx {
  int lane, gwarp, nwarps;
  int64_t gtid, gstride;
  __device__ GridIdx()
      : lane(threadIdx.x & 31),
        gwarp(static_cast<int>((blockIdx.x * blockDim.x + threadIdx.x) >> 5)),
        nwarps(static_cast<int>((gridDim.x * blockDim.x) >> 5)),
        gtid(int64_t(blockIdx.x) * blockDim.x + threadIdx.x),
        gstride(int64_t(gridDim.x) * blockDim.x) {}
};

// The calling warp's index when work items are dealt warp w of every block before warp w + 1 of
// any (a bijection onto [0, nwarps)): a grid with more warps than items then leaves a few warps of
// every SM idle rather than whole SMs (with GridIdx::gwarp, 1,024 items on 132 x 16 warps load 64
// SMs with 16 items each and leave 68 idle).
__device__ __forceinline__ int64_t warp_across_blocks() {
  return int64_t(threadIdx.x >> 5) * gridDim.x + blockIdx.x;
}

// Launches `kernel` on `stream` as `blocks` x kThreads with `smem` bytes of dynamic shared memory
// and the given parameter structs: cooperatively (every block co-resident, for kernels that call
// grid.sync) or as a plain launch (kernels whose blocks never wait for each other).
template <typename... Params>
cudaError_t launch_cooperative(void (*kernel)(Params...), int blocks, size_t smem, cudaStream_t stream,
                               const Params&... params) {
  void* args[] = {const_cast<Params*>(&params)...};
  return cudaLaunchCooperativeKernel(reinterpret_cast<void*>(kernel), blocks, kThreads, args, smem, stream);
}
template <typename... Params>
cudaError_t launch_plain(void (*kernel)(Params...), int blocks, size_t smem, cudaStream_t stream,
                         const Params&... params) {
  void* args[] = {const_cast<Params*>(&params)...};
  return cudaLaunchKernel(reinterpret_cast<void*>(kernel), blocks, kThreads, args, smem, stream);
}

// Every thread of every block calls this once, after its block's work: true in exactly one block,
// the last to get here, which then sees every other block's earlier writes (the fence-and-count
// pattern of a grid barrier, without the waiting). `counter` is zero at kernel entry and the last
// block resets it for the next launch. A block that returns early must not call it, so the
// kernel's closing step (flags, epochs) runs only when every block finished.
__device__ __forceinline__ bool last_block_done(uint32_t* counter) {
  __shared__ bool last;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    last = atomicAdd(counter, 1u) == gridDim.x - 1;
    if (last) {
      *reinterpret_cast<volatile uint32_t*>(counter) = 0;
      __threadfence();
    }
  }
  __syncthreads();
  return last;
}

}  // namespace a2a::gpu
