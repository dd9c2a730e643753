// The environment variables the C++ side reads, in one place: the only getenv of the library's
// C++ (tests/test_env.py checks). Every JAX_MOE_A2A_* name here is one of jax_moe_a2a/env.py's
// table with scope "native" (that table is the one list of variables; the test keeps kNative
// equal to it). A value is read when asked, at engine, proxy or communicator creation, and parsed
// there into that object's options struct (EngineOptions::resolved, ProgressOptions::from_env,
// ProxyOptions::from_env, ...), so each creation sees the environment of its time, as the Python
// accessors do.
#pragma once

#include <string>

namespace a2a::env {

// The native variables, without the JAX_MOE_A2A_ prefix.
extern const char* const kNative[];
extern const int kNumNative;

// The value of JAX_MOE_A2A_<name> (name with or without the prefix), or null when unset. Throws
// std::invalid_argument for a name that is not in kNative.
const char* get(const char* name);
// The value, or `fallback` when unset or empty.
std::string get_or(const char* name, const std::string& fallback);
// The value as a non-negative number (durations, sizes), or `fallback` when unset or empty. Throws
// std::invalid_argument naming the variable for anything else ("20us", "-1", "nan").
double get_double(const char* name, double fallback);

// A launcher's variable (Open MPI's, Slurm's, torchrun's: kLauncher), or null when unset.
extern const char* const kLauncher[];
extern const int kNumLauncher;
const char* launcher(const char* name);

}  // namespace a2a::env
