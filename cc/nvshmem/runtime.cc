#include "nvshmem/runtime.h"

#include <cuda_runtime_api.h>
#include <nvshmem_host.h>

#include <cstring>
#include <map>
#include <mutex>
#include <stdexcept>

namespace a2a::nvshmem {

namespace {

std::mutex& mu() {
  static std::mutex m;
  return m;
}

struct Arena {
  uint8_t* base = nullptr;
  int64_t bytes = 0;
  std::map<int64_t, int64_t> free_;  // offset -> size
  std::map<int64_t, int64_t> used_;  // offset -> size
};

Arena& the_arena() {
  static Arena a;
  return a;
}

bool attached = false;  // this library's device state is registered with the runtime

void fail(const std::string& what) { throw std::runtime_error("jax_moe_a2a nvshmem: " + what); }

}  // namespace

int init_status() { return nvshmemx_init_status(); }

const char* status_name(int s) {
  switch (s) {
    case NVSHMEM_STATUS_NOT_INITIALIZED: return "not initialized";
    case NVSHMEM_STATUS_IS_BOOTSTRAPPED: return "bootstrapped";
    case NVSHMEM_STATUS_IS_INITIALIZED: return "initialized";
    case NVSHMEM_STATUS_LIMITED_MPG: return "initialized (limited MPG: several PEs per GPU)";
    case NVSHMEM_STATUS_FULL_MPG: return "initialized (full MPG: several PEs per GPU under MPS)";
    default: return "invalid";
  }
}

std::string unique_id() {
  nvshmemx_uniqueid_t id = NVSHMEMX_UNIQUEID_INITIALIZER;
  if (nvshmemx_get_uniqueid(&id) != 0) fail("nvshmemx_get_uniqueid failed");
  return std::string(reinterpret_cast<const char*>(&id), sizeof(id));
}

int ensure_initialized(int pe, int npes, const std::string& uid, int device) {
  std::lock_guard<std::mutex> lock(mu());
  if (cudaSetDevice(device) != cudaSuccess) fail("cudaSetDevice(" + std::to_string(device) + ") failed");
  if (attached) return init_status();
  nvshmemi_version_t version = {NVSHMEM_VENDOR_MAJOR_VERSION, NVSHMEM_VENDOR_MINOR_VERSION, NVSHMEM_VENDOR_PATCH_VERSION};
  int provided = 0;
  int rc;
  if (init_status() >= NVSHMEM_STATUS_IS_BOOTSTRAPPED) {
    // Someone (another library, JAX) bootstrapped or initialised NVSHMEM: no second bootstrap;
    // this finishes the initialisation if needed and registers our device code with it.
    rc = nvshmemi_init_thread(NVSHMEM_THREAD_SERIALIZED, &provided, 0, nullptr, version);
    if (rc != 0) fail("attaching to the NVSHMEM runtime already initialised in this process failed (" + std::to_string(rc) + ")");
  } else {
    if (uid.size() != sizeof(nvshmemx_uniqueid_t)) fail("unique id must be " + std::to_string(sizeof(nvshmemx_uniqueid_t)) + " bytes");
    nvshmemx_uniqueid_t id;
    std::memcpy(&id, uid.data(), sizeof(id));
    nvshmemx_init_attr_t attr = NVSHMEMX_INIT_ATTR_INITIALIZER;
    if (nvshmemx_set_attr_uniqueid_args(pe, npes, &id, &attr) != 0) fail("nvshmemx_set_attr_uniqueid_args failed");
    nvshmemx_init_init_attr_ver_only(attr);
    // nvshmemx_init_attr() would exit() the process on failure; this entry point returns instead.
    rc = nvshmemi_init_thread(NVSHMEM_THREAD_SERIALIZED, &provided, NVSHMEMX_INIT_WITH_UNIQUEID, &attr, version);
    if (rc != 0) fail("initialisation by unique id failed (" + std::to_string(rc) + "): see NVSHMEM's messages above");
  }
  attached = true;
  return init_status();
}

int my_pe() { return nvshmem_my_pe(); }
int n_pes() { return nvshmem_n_pes(); }

uint8_t* arena(int64_t bytes) {
  std::lock_guard<std::mutex> lock(mu());
  Arena& a = the_arena();
  if (a.base) return a.base;
  void* p = nvshmem_malloc(static_cast<size_t>(bytes));
  if (!p)
    fail("nvshmem_malloc of a " + std::to_string(bytes >> 20) + " MiB arena failed: raise NVSHMEM_SYMMETRIC_SIZE "
         "(before the first communicator) or lower JAX_MOE_A2A_NVSHMEM_ARENA");
  if (cudaMemset(p, 0, static_cast<size_t>(bytes)) != cudaSuccess || cudaDeviceSynchronize() != cudaSuccess)
    fail("zeroing the arena failed");
  a.base = static_cast<uint8_t*>(p);
  a.bytes = bytes;
  a.free_[0] = bytes;
  return a.base;
}

int64_t arena_size() {
  std::lock_guard<std::mutex> lock(mu());
  return the_arena().bytes;
}

int64_t arena_alloc(int64_t bytes) {
  std::lock_guard<std::mutex> lock(mu());
  Arena& a = the_arena();
  bytes = (bytes + 255) / 256 * 256;
  for (auto it = a.free_.begin(); it != a.free_.end(); ++it) {
    if (it->second < bytes) continue;
    const int64_t off = it->first, left = it->second - bytes;
    a.free_.erase(it);
    if (left) a.free_[off + bytes] = left;
    a.used_[off] = bytes;
    return off;
  }
  return -1;
}

void arena_free(int64_t offset) {
  std::lock_guard<std::mutex> lock(mu());
  Arena& a = the_arena();
  auto u = a.used_.find(offset);
  if (u == a.used_.end()) return;
  int64_t off = offset, size = u->second;
  a.used_.erase(u);
  auto next = a.free_.find(off + size);  // merge with the free neighbours
  if (next != a.free_.end()) {
    size += next->second;
    a.free_.erase(next);
  }
  auto prev = a.free_.lower_bound(off);
  if (prev != a.free_.begin()) {
    --prev;
    if (prev->first + prev->second == off) {
      off = prev->first;
      size += prev->second;
      a.free_.erase(prev);
    }
  }
  a.free_[off] = size;
}

void barrier_all() {
  if (cudaDeviceSynchronize() != cudaSuccess) fail("cudaDeviceSynchronize before the barrier failed");
  nvshmem_barrier_all();
}

cudaError_t barrier_all_on_stream(cudaStream_t stream) {
  nvshmemx_barrier_all_on_stream(stream);
  return cudaGetLastError();
}

}  // namespace a2a::nvshmem
