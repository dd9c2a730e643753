#include "cuda/preload.h"

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <cstdio>
#include <mutex>
#include <set>
#include <stdexcept>
#include <vector>

#include "core/env.h"
#include "cuda/kernels.h"

namespace a2a::cuda {

namespace {

std::vector<KernelRef> backend_kernels(const Geometry& g) {
  std::vector<KernelRef> k;
  dispatch_send_kernels(g, &k);  // grid-routed, then the block-routed ones
  dispatch_recv_kernels(g, &k);
  combine_send_kernels(g, &k);
  combine_recv_kernels(g, &k);
  timing_barrier_kernels(&k);
  return k;
}

bool preload_enabled() { return env::get_or("PRELOAD_KERNELS", "1") != "0"; }

// The context's SM limit (cuCtxGetExecAffinity, CU_EXEC_AFFINITY_TYPE_SM_COUNT), or -1.
int context_sm_limit() {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult status{};
  if (cudaGetDriverEntryPointByVersion("cuCtxGetExecAffinity", &fn, 11040, cudaEnableDefault, &status) != cudaSuccess ||
      status != cudaDriverEntryPointSuccess || !fn) {
    cudaGetLastError();
    return -1;
  }
  CUexecAffinityParam p{};
  if (reinterpret_cast<CUresult (*)(CUexecAffinityParam*, CUexecAffinityType)>(fn)(&p, CU_EXEC_AFFINITY_TYPE_SM_COUNT) !=
      CUDA_SUCCESS)
    return -1;
  return static_cast<int>(p.param.smCount.val);
}

int attribute(cudaDeviceAttr a, int device) {
  int v = -1;
  if (cudaDeviceGetAttribute(&v, a, device) != cudaSuccess) {
    cudaGetLastError();
    return -1;
  }
  return v;
}

}  // namespace

std::string lazy_loading() {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult status{};
  if (cudaGetDriverEntryPointByVersion("cuModuleGetLoadingMode", &fn, 12000, cudaEnableDefault, &status) != cudaSuccess ||
      status != cudaDriverEntryPointSuccess || !fn) {
    cudaGetLastError();
    return "the driver does not say whether it loads kernels lazily (cuModuleGetLoadingMode)";
  }
  int mode = 0;  // CUmoduleLoadingMode: 1 eager, 2 lazy
  if (reinterpret_cast<int (*)(int*)>(fn)(&mode) != 0) return "cuModuleGetLoadingMode failed";
  return mode == 1 ? "" : "the driver loads kernels lazily (CUDA_MODULE_LOADING=LAZY, the default)";
}

bool preload_kernels(int device, const Geometry& g) {
  if (!preload_enabled()) return false;
  static std::mutex mu;
  static std::set<int> done;  // devices whose context holds every kernel
  std::lock_guard<std::mutex> lock(mu);
  if (done.count(device)) return true;
  for (const KernelRef& k : backend_kernels(g)) {
    cudaFuncAttributes a{};
    const cudaError_t rc = cudaFuncGetAttributes(&a, k.fn);  // loads the kernel (lazy loading)
    if (rc != cudaSuccess) {
      cudaGetLastError();
      throw std::runtime_error(std::string("jax_moe_a2a cuda: loading kernel ") + k.name + " on device " +
                               std::to_string(device) + ": " + cudaGetErrorString(rc));
    }
  }
  done.insert(device);
  return true;
}

std::string launch_report(int device, int rank, int blocks, const Geometry& g, bool preloaded) {
  if (env::get_or("LAUNCH_INFO", "0") == "0") return "";
  const int sms = attribute(cudaDevAttrMultiProcessorCount, device);
  const std::string lazy = lazy_loading();
  char line[512];
  std::snprintf(line, sizeof(line),
                "jax_moe_a2a cuda (rank %d, device %d): launch report: cudaDevAttrMultiProcessorCount %d, context SM "
                "limit %d (cuCtxGetExecAffinity; -1: unknown), cooperative launch %d, module loading %s, kernels "
                "preloaded %s; every half runs %d blocks x threads below\n",
                rank, device, sms, context_sm_limit(), attribute(cudaDevAttrCooperativeLaunch, device),
                lazy.empty() ? "eager" : "lazy (or unknown)", preloaded ? "yes" : "no (JAX_MOE_A2A_PRELOAD_KERNELS=0)",
                blocks);
  std::string out = line;
  if (!preloaded) return out + "  (per-kernel figures left out: querying a kernel would load it)\n";
  for (const KernelRef& k : backend_kernels(g)) {
    cudaFuncAttributes a{};
    int per_sm = -1;
    if (cudaFuncGetAttributes(&a, k.fn) != cudaSuccess ||
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, k.fn, k.threads, k.smem) != cudaSuccess) {
      cudaGetLastError();
      per_sm = -1;
    }
    std::snprintf(line, sizeof(line),
                  "  %s%s: %d threads, %d registers, shared %zu static + %zu dynamic bytes; occupancy %d blocks/SM, "
                  "%d co-resident on %d SMs against a grid of %d%s\n",
                  k.name, k.cooperative ? " [cooperative: every block must be co-resident]" : "", k.threads,
                  a.numRegs, a.sharedSizeBytes, k.smem, per_sm, per_sm * sms, sms, k.threads == 64 ? 1 : blocks,
                  k.cooperative && per_sm >= 0 && per_sm * sms < blocks ? " (TOO LARGE)" : "");
    out += line;
  }
  return out;
}

}  // namespace a2a::cuda
