// Config: one communicator's configuration, built once in Python (jax_moe_a2a/config.py: from the
// Spec, the EP group's rank count and the backend's options) and handed to C++ as this one named
// struct (_C.Config); every backend's create() takes it. shape_of() derives the one shape struct
// (MoeShape) from it; buffer sizes are computed from it in C++ only (each backend's
// buffer_regions) and reported back to Python.
#pragma once

#include <cstdint>
#include <string>

#include "core/dtype.h"
#include "core/shape.h"

namespace a2a {

struct Config {
  // ---- shape: the Spec on an EP group of num_ranks ranks --------------------------------------
  int num_ranks = 1;
  int num_experts = 1;
  int experts_per_token = 1;
  int hidden = 1;
  int max_tokens_per_rank = 1;
  int tp_size = 1;
  int num_scales = 0;                          // fp8: hidden / scale_block, else 0
  int scale_block = 128;
  ElemKind dispatch_dtype = ElemKind::kBF16;   // the wire
  ElemKind combine_dtype = ElemKind::kBF16;    // combine_recv's output
  Layout layout = Layout::kRagged;
  int recv_rows = 0;                           // R (ragged) or C per local expert, capacity applied
  bool pow2_scale = false;
  int slots = 2;
  double timeout_s = 60.0;
  // ---- transport (each backend reads its own; Python validated them) ------------------------
  int node_size = 0;            // ranks r, s share a node iff r / node_size == s / node_size
                                // (cuda: 0 = one node; host proxied: 0 = none share one)
  int max_private_tokens = -1;  // rows per remote sender before the counts arrive (-1: all)
  std::string provider;         // libfabric provider ("" -> $JAX_MOE_A2A_PROVIDER -> shm)
  std::string engine;           // host: "local" or "fabric"
  bool proxied = false;         // host: the protocol on a proxy thread per rank
};

// The shape of `c`, derived fields filled; throws std::invalid_argument on an inconsistent one.
MoeShape shape_of(const Config& c);

// The transport fields of a Config that every backend's communicator reads (the host backend's
// HostOptions, the GPU backends' GpuOptions and the protocol's ExchangeOptions derive from it, so
// the fields are declared and copied from the Config in one place: transport_options).
struct TransportOptions {
  int slots = 2;           // buffer sets, one op in flight on each
  double timeout_s = 60.0;  // a peer that does not arrive within this ends the op with an error
  int node_size = 0;       // ranks a, b share a node iff a / node_size == b / node_size (0: see Config)
  int priv_rows = -1;      // private rows per remote sender before the counts arrive (-1: all)
  std::string provider;    // libfabric provider ("" -> $JAX_MOE_A2A_PROVIDER -> shm)
};
TransportOptions transport_options(const Config& c);

}  // namespace a2a
