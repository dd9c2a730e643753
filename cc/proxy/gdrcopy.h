// GDRCopy, loaded at run time: the fast path for the proxy's host -> GPU flags (cc/core/ctrl.h).
//
// Without it the proxy raises its flags (d_send_ok, d_landed, c_send_ok, c_landed, over_base, c_off, the
// error record) in mapped pinned host memory and the kernels poll them across PCIe. With it a
// copy of the Ctrl block lives in GPU memory (cudaMalloc, 64 KiB aligned), pinned by the gdrdrv
// kernel module (gdr_pin_buffer) and mapped into the process through the GPU's BAR (gdr_map): the
// proxy's stores go to GPU memory and the kernels poll locally. The kernel -> proxy flags stay in
// host memory, where the proxy polls them locally (reads through the BAR would be uncached PCIe
// round trips).
//
// Nothing links against libgdrapi: it is dlopen'ed (JAX_MOE_A2A_GDRCOPY_LIB, default
// "libgdrapi.so.2") only when the driver node exists (JAX_MOE_A2A_GDRCOPY_DEV, default
// "/dev/gdrdrv"), so a machine without GDRCopy loses nothing. JAX_MOE_A2A_GDRCOPY: "auto" (default)
// uses it where it works and says why not otherwise; "0" never uses it; "1" requires it (the
// inter-node path fails to start, naming the reason). This file has no CUDA: the device memory is
// allocated by the caller (cc/cuda/remote_path.cc) and passed as an address; the selection logic is
// tested on CPUs (tests/test_gdrcopy.py through _C.proxy.gdrcopy_status / gdrcopy_select).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace a2a::proxy::gdr {

constexpr uint64_t kGpuPage = uint64_t(1) << 16;  // GDRCopy's GPU page (GPU_PAGE_SIZE, 64 KiB)

enum class Mode { kOff, kAuto, kRequire };
// JAX_MOE_A2A_GDRCOPY: ""/"auto" -> kAuto, "0"/"off"/"false"/"no" -> kOff, "1"/"on"/"true"/"yes"/
// "require" -> kRequire; anything else throws std::invalid_argument.
Mode parse_mode(const std::string& text);
Mode mode_from_env();
std::string default_library();  // JAX_MOE_A2A_GDRCOPY_LIB, else "libgdrapi.so.2"
std::string default_device();   // JAX_MOE_A2A_GDRCOPY_DEV, else "/dev/gdrdrv"

// Whether GDRCopy can be used here, and why not: checks the mode, that the driver node exists,
// that the library loads with every function we need, and that gdr_open succeeds (then closes it).
// Touches no GPU. reason: "gdrcopy" when available, else e.g. "/dev/gdrdrv not found",
// "libgdrapi.so.2 not found (<dlerror>)", "gdr_open failed", "disabled by JAX_MOE_A2A_GDRCOPY=0".
struct Probe {
  bool available = false;
  std::string reason;
};
Probe probe(Mode mode, const std::string& library, const std::string& device);
Probe probe_from_env();  // probe(mode_from_env(), default_library(), default_device())

// The flag path's description from a probe, as proxy_stats() reports it: "gdrcopy" or
// "mapped-host: <reason>". With Mode::kRequire and an unavailable probe this throws
// std::runtime_error naming the reason (JAX_MOE_A2A_GDRCOPY=1 asked for it).
std::string describe(Mode mode, const Probe& p);
std::string mapped_host(const std::string& reason);  // "mapped-host: <reason>"

// One range of GPU memory pinned and mapped into this process through the BAR. `device_addr`
// (a cudaMalloc'd address, aligned to kGpuPage) and `bytes` (a multiple of kGpuPage) must stay
// allocated until the Mapping is destroyed (unmap, unpin, gdr_close, in that order).
class Mapping {
 public:
  // nullptr on failure, with *why set ("gdr_pin_buffer failed (rc -22)", ...).
  static std::unique_ptr<Mapping> create(const std::string& library, uint64_t device_addr, uint64_t bytes,
                                         std::string* why);
  ~Mapping();
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;

  void* host() const { return host_; }  // where device_addr appears in our address space
  uint64_t bytes() const { return bytes_; }
  // gdr_copy_to_mapping into the mapping at `offset` (the library's WC-friendly copy).
  void copy_to(uint64_t offset, const void* src, size_t n) const;

 private:
  Mapping() = default;
  struct Impl;
  std::unique_ptr<Impl> impl_;
  void* host_ = nullptr;
  uint64_t bytes_ = 0;
};

// Stores through the BAR mapping are write-combined: weakly ordered and buffered in the CPU until
// flushed. A store fence orders the stores before it ahead of those after it and drains the WC
// buffers, so: data, wc_fence(), flag, wc_fence() (the second one sends the flag now).
void wc_fence();

}  // namespace a2a::proxy::gdr
