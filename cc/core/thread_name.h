// Names the calling thread (Linux: 15 characters at most, as top, gdb and /proc/<pid>/task/*/comm show
// it): the library's own threads carry a name, so a debugger and benchmarks/benchlib/sched.py
// can tell them from JAX's and XLA's. Best effort: a failure changes nothing.
#pragma once

#if defined(__linux__)
#include <pthread.h>
#endif

namespace a2a {

inline void set_thread_name(const char* name) {
#if defined(__linux__)
  (void)pthread_setname_np(pthread_self(), name);
#else
  (void)name;
#endif
}

// The names (benchmarks/benchlib/sched.py reads them).
inline constexpr const char kProxyThreadName[] = "a2a-proxy";
inline constexpr const char kProgressThreadName[] = "a2a-progress";

}  // namespace a2a
