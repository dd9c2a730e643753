#include "core/env.h"

#include <cctype>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

namespace a2a::env {

namespace {

constexpr const char kPrefix[] = "JAX_MOE_A2A_";

const char* in(const char* name, const char* const* names, int n, const char* what) {
  for (int i = 0; i < n; ++i)
    if (std::strcmp(name, names[i]) == 0) return names[i];
  throw std::invalid_argument(std::string("jax_moe_a2a: ") + name + " is not in the " + what +
                              " variables of cc/core/env.cc");
}

}  // namespace

// The rows of jax_moe_a2a/env.py's table that cc/ reads (their read_by names a cc/ file).
const char* const kNative[] = {
    "PROVIDER",  // read by the Python library too (scope "library")
    "IFACE", "HMEM", "POST_TIMEOUT_S", "RX_CQ_SIZE", "FI_THREADING", "PROGRESS", "PROGRESS_SPIN_US",
    "PROGRESS_MAX_SLEEP_US", "WAIT_SPIN_US", "WAIT_YIELD_US", "POLL_PROGRESS", "PROXY", "PROXY_CPUS", "PROXY_SPIN_US",
    "PROXY_PIPELINE",
    "PROXY_MAX_SLEEP_US", "PROXY_IDLE_MS", "PROXY_IDLE_SLEEP_US", "KERNEL_TIMING", "DISPATCH_SEND",
    "GDRCOPY", "STAGING", "GDRCOPY_LIB", "GDRCOPY_DEV", "HOST_FLAG_MIRROR", "HOST_STAGED",
    "HOST_RECV_PAUSE_S", "HOST_PACK_PAUSE_S", "HOST_COPY_PAUSE_S", "PRELOAD_KERNELS", "LAUNCH_INFO", "PROXY_REPORT_S",
    "PROXY_TIMELINE", "WRITE_CHUNK_KIB", "COMB_PIECES", "RAILS", "COPY_DEPTH",
};
const int kNumNative = sizeof(kNative) / sizeof(kNative[0]);

const char* const kLauncher[] = {"OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID", "LOCAL_RANK"};
const int kNumLauncher = sizeof(kLauncher) / sizeof(kLauncher[0]);

const char* get(const char* name) {
  const size_t n = sizeof(kPrefix) - 1;
  const char* bare = std::strncmp(name, kPrefix, n) == 0 ? name + n : name;
  in(bare, kNative, kNumNative, "native");
  return std::getenv((std::string(kPrefix) + bare).c_str());
}

std::string get_or(const char* name, const std::string& fallback) {
  const char* v = get(name);
  return v && *v ? std::string(v) : fallback;
}

double get_double(const char* name, double fallback) {
  const char* v = get(name);
  if (!v || !*v) return fallback;
  char* end = nullptr;
  const double d = std::strtod(v, &end);
  while (end && std::isspace(static_cast<unsigned char>(*end))) ++end;
  if (end == v || *end || !(d >= 0) || std::isinf(d)) {
    const size_t n = sizeof(kPrefix) - 1;
    const char* bare = std::strncmp(name, kPrefix, n) == 0 ? name + n : name;
    throw std::invalid_argument(std::string("jax_moe_a2a: ") + kPrefix + bare + "='" + v +
                                "': expected a non-negative number");
  }
  return d;
}

const char* launcher(const char* name) { return std::getenv(in(name, kLauncher, kNumLauncher, "launcher")); }

}  // namespace a2a::env
