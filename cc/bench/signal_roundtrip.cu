// GPU -> host -> GPU signalling round trip through mapped pinned memory, the path every
// kernel <-> proxy flag takes (cc/core/ctrl.h): one GPU thread raises a flag with st.release.sys
// and waits with ld.acquire.sys for the echo; a host thread polls with the proxy's acquire load and
// answers with its release store. The kernel times each round trip with %globaltimer.
#include <cuda_runtime_api.h>

#include <atomic>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "bench/signal_roundtrip.h"
#include "gpu/check.h"
#include "gpu/ptx.cuh"
#include "core/ctrl.h"

namespace a2a::bench {
namespace {

struct Flags {
  alignas(64) uint64_t to_host;
  alignas(64) uint64_t to_gpu;
};

// ns[i]: round trip i in nanoseconds. One thread.
__global__ void pingpong_kernel(Flags* f, int iters, uint64_t* ns, int64_t timeout_ns) {
  for (int i = 0; i < iters; ++i) {
    const uint64_t t0 = gpu::ptx::globaltimer();
    gpu::ptx::st_release_sys(&f->to_host, uint64_t(i) + 1);
    while (gpu::ptx::ld_acquire_sys(&f->to_gpu) < uint64_t(i) + 1) {
      if (gpu::ptx::globaltimer() - t0 > static_cast<uint64_t>(timeout_ns)) {
        ns[i] = ~0ull;
        return;
      }
    }
    ns[i] = gpu::ptx::globaltimer() - t0;
  }
}

void check(cudaError_t rc, const char* what) { gpu::check_cuda(rc, "signal_roundtrip", what); }

}  // namespace

std::vector<double> signal_roundtrip(int device, int iters) {
  if (iters < 1) throw std::invalid_argument("signal_roundtrip: iters must be >= 1");
  check(cudaSetDevice(device), "cudaSetDevice");
  Flags* f = nullptr;
  uint64_t* ns = nullptr;
  check(cudaHostAlloc(reinterpret_cast<void**>(&f), sizeof(Flags), cudaHostAllocMapped), "cudaHostAlloc");
  f->to_host = f->to_gpu = 0;
  check(cudaHostAlloc(reinterpret_cast<void**>(&ns), sizeof(uint64_t) * iters, cudaHostAllocMapped), "cudaHostAlloc");
  Flags* fd = nullptr;
  uint64_t* nsd = nullptr;
  check(cudaHostGetDevicePointer(reinterpret_cast<void**>(&fd), f, 0), "cudaHostGetDevicePointer");
  check(cudaHostGetDevicePointer(reinterpret_cast<void**>(&nsd), ns, 0), "cudaHostGetDevicePointer");
  std::atomic<bool> stop{false};
  std::thread echo([&] {  // answers each flag at once (a proxy spinning on its flags)
    uint64_t seen = 0;
    while (!stop.load(std::memory_order_relaxed) && seen < uint64_t(iters)) {
      const uint64_t v = ctrl::load_acquire(&f->to_host);
      if (v > seen) {
        seen = v;
        ctrl::store_release(&f->to_gpu, v);
      }
    }
  });
  pingpong_kernel<<<1, 1>>>(fd, iters, nsd, 5000000000ll);
  const cudaError_t rc = cudaDeviceSynchronize();
  stop.store(true);
  echo.join();
  std::vector<double> out;
  for (int i = 0; i < iters && rc == cudaSuccess; ++i) {
    if (ns[i] == ~0ull) break;
    out.push_back(double(ns[i]));
  }
  cudaFreeHost(f);
  cudaFreeHost(ns);
  check(rc, "kernel");
  if (int(out.size()) != iters) throw std::runtime_error("signal_roundtrip: the host echo did not answer within 5 s");
  return out;
}

}  // namespace a2a::bench
