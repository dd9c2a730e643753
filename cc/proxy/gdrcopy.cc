#include "proxy/gdrcopy.h"
#include "core/env.h"

#include <dlfcn.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <stdexcept>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace a2a::proxy::gdr {

namespace {

// The few GDRCopy entry points we call, declared from the documented C API (gdrapi.h of
// GDRCopy 2.x): gdr_t is an opaque pointer, gdr_mh_t a struct of one unsigned long passed by
// value, and gdr_get_info (a macro for gdr_get_info_v2 since 2.1) fills a struct whose first
// two fields are the pinned range's aligned start (va) and length (mapped_size).
struct MemHandle {
  unsigned long h;
};
struct Info {
  uint64_t va;
  uint64_t mapped_size;
  uint32_t page_size;
  uint64_t tm_cycles;
  uint32_t cycles_per_ms;
  unsigned mapped : 1;
  unsigned wc_mapping : 1;
  int mapping_type;
  unsigned char spare[64];  // room for fields a newer library may add
};
using OpenFn = void* (*)();
using CloseFn = int (*)(void*);
using PinFn = int (*)(void*, unsigned long, size_t, uint64_t, uint32_t, MemHandle*);
using UnpinFn = int (*)(void*, MemHandle);
using GetInfoFn = int (*)(void*, MemHandle, Info*);
using MapFn = int (*)(void*, MemHandle, void**, size_t);
using UnmapFn = int (*)(void*, MemHandle, void*, size_t);
using CopyToFn = int (*)(MemHandle, void*, const void*, size_t);

struct Api {
  OpenFn open;
  CloseFn close;
  PinFn pin;
  UnpinFn unpin;
  GetInfoFn get_info;
  MapFn map;
  UnmapFn unmap;
  CopyToFn copy_to;
};

// Loaded once per library path and kept for the process (never dlclose'd: mappings may outlive
// any one user). Failures are not cached, so a later call with another path can succeed.
const Api* load(const std::string& library, std::string* why) {
  static std::mutex mu;
  static std::map<std::string, Api>* loaded = new std::map<std::string, Api>();
  std::lock_guard<std::mutex> lock(mu);
  auto it = loaded->find(library);
  if (it != loaded->end()) return &it->second;
  void* h = dlopen(library.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    const char* e = dlerror();
    *why = library + " not found (" + (e ? e : "dlopen failed") + ")";
    return nullptr;
  }
  Api a{};
  std::string missing;
  auto sym = [&](const char* name, const char* fallback = nullptr) -> void* {
    void* p = dlsym(h, name);
    if (!p && fallback) p = dlsym(h, fallback);
    if (!p) missing += (missing.empty() ? "" : ", ") + std::string(name);
    return p;
  };
  a.open = reinterpret_cast<OpenFn>(sym("gdr_open"));
  a.close = reinterpret_cast<CloseFn>(sym("gdr_close"));
  a.pin = reinterpret_cast<PinFn>(sym("gdr_pin_buffer"));
  a.unpin = reinterpret_cast<UnpinFn>(sym("gdr_unpin_buffer"));
  a.get_info = reinterpret_cast<GetInfoFn>(sym("gdr_get_info_v2", "gdr_get_info"));
  a.map = reinterpret_cast<MapFn>(sym("gdr_map"));
  a.unmap = reinterpret_cast<UnmapFn>(sym("gdr_unmap"));
  a.copy_to = reinterpret_cast<CopyToFn>(sym("gdr_copy_to_mapping"));
  if (!missing.empty()) {
    dlclose(h);
    *why = library + " lacks " + missing;
    return nullptr;
  }
  return &loaded->emplace(library, a).first->second;
}

}  // namespace

Mode parse_mode(const std::string& text) {
  if (text.empty() || text == "auto") return Mode::kAuto;
  if (text == "0" || text == "off" || text == "false" || text == "no") return Mode::kOff;
  if (text == "1" || text == "on" || text == "true" || text == "yes" || text == "require") return Mode::kRequire;
  throw std::invalid_argument("jax_moe_a2a: JAX_MOE_A2A_GDRCOPY must be 0, 1 or auto, got '" + text + "'");
}

Mode mode_from_env() {
  const char* v = env::get("JAX_MOE_A2A_GDRCOPY");
  return parse_mode(v ? v : "");
}

std::string default_library() { return env::get_or("JAX_MOE_A2A_GDRCOPY_LIB", "libgdrapi.so.2"); }
std::string default_device() { return env::get_or("JAX_MOE_A2A_GDRCOPY_DEV", "/dev/gdrdrv"); }

Probe probe(Mode mode, const std::string& library, const std::string& device) {
  if (mode == Mode::kOff) return {false, "disabled by JAX_MOE_A2A_GDRCOPY=0"};
  struct stat st {};
  if (stat(device.c_str(), &st) != 0) return {false, device + " not found"};
  if (access(device.c_str(), R_OK | W_OK) != 0) return {false, device + " not accessible (" + std::strerror(errno) + ")"};
  std::string why;
  const Api* api = load(library, &why);
  if (!api) return {false, why};
  void* g = api->open();
  if (!g) return {false, "gdr_open failed"};
  api->close(g);
  return {true, "gdrcopy"};
}

Probe probe_from_env() { return probe(mode_from_env(), default_library(), default_device()); }

std::string mapped_host(const std::string& reason) { return "mapped-host: " + reason; }

std::string describe(Mode mode, const Probe& p) {
  if (p.available) return "gdrcopy";
  if (mode == Mode::kRequire)
    throw std::runtime_error("jax_moe_a2a: JAX_MOE_A2A_GDRCOPY=1 requires GDRCopy for the proxy's flags, but " +
                             p.reason + " (JAX_MOE_A2A_GDRCOPY=auto falls back to mapped host memory)");
  return mapped_host(p.reason);
}

struct Mapping::Impl {
  const Api* api = nullptr;
  void* g = nullptr;
  MemHandle mh{};
  bool pinned = false;
  void* va = nullptr;  // the mapping's start (the pinned range's aligned start)
  uint64_t map_bytes = 0;
};

std::unique_ptr<Mapping> Mapping::create(const std::string& library, uint64_t device_addr, uint64_t bytes,
                                         std::string* why) {
  const Api* api = load(library, why);
  if (!api) return nullptr;
  if (bytes == 0 || device_addr % kGpuPage != 0 || bytes % kGpuPage != 0) {
    *why = "the flag block is not aligned to 64 KiB GPU pages";
    return nullptr;
  }
  std::unique_ptr<Mapping> m(new Mapping());
  m->impl_ = std::make_unique<Impl>();
  Impl& im = *m->impl_;
  im.api = api;
  im.g = api->open();
  if (!im.g) {
    *why = "gdr_open failed";
    return nullptr;
  }
  // p2p_token 0 and va_space 0: no CUDA P2P tokens; the address is one of this process's
  // cudaMalloc'd device addresses.
  int rc = api->pin(im.g, static_cast<unsigned long>(device_addr), bytes, 0, 0, &im.mh);
  if (rc != 0) {
    *why = "gdr_pin_buffer failed (rc " + std::to_string(rc) + ")";
    return nullptr;  // ~Mapping closes the handle
  }
  im.pinned = true;
  Info info{};
  rc = api->get_info(im.g, im.mh, &info);
  if (rc != 0) {
    *why = "gdr_get_info failed (rc " + std::to_string(rc) + ")";
    return nullptr;
  }
  if (device_addr < info.va || device_addr + bytes > info.va + info.mapped_size) {
    *why = "gdr_get_info: the pinned range does not cover the flag block";
    return nullptr;
  }
  im.map_bytes = info.mapped_size;
  rc = api->map(im.g, im.mh, &im.va, im.map_bytes);
  if (rc != 0 || !im.va) {
    im.va = nullptr;
    *why = "gdr_map failed (rc " + std::to_string(rc) + ")";
    return nullptr;
  }
  m->host_ = static_cast<uint8_t*>(im.va) + (device_addr - info.va);
  m->bytes_ = bytes;
  return m;
}

Mapping::~Mapping() {
  if (!impl_ || !impl_->g) return;
  Impl& im = *impl_;
  if (im.va) im.api->unmap(im.g, im.mh, im.va, im.map_bytes);
  if (im.pinned) im.api->unpin(im.g, im.mh);
  im.api->close(im.g);
}

void Mapping::copy_to(uint64_t offset, const void* src, size_t n) const {
  if (offset + n > bytes_) throw std::out_of_range("gdr::Mapping::copy_to: outside the mapping");
  impl_->api->copy_to(impl_->mh, static_cast<uint8_t*>(host_) + offset, src, n);
}

void wc_fence() {
  std::atomic_signal_fence(std::memory_order_seq_cst);  // no compiler reordering across it either
#if defined(__x86_64__) || defined(__i386__)
  _mm_sfence();
#else
  std::atomic_thread_fence(std::memory_order_seq_cst);
#endif
  std::atomic_signal_fence(std::memory_order_seq_cst);
}

}  // namespace a2a::proxy::gdr
