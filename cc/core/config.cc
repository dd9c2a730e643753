#include "core/config.h"

#include <stdexcept>
#include <string>

#include "core/align.h"

namespace a2a {

TransportOptions transport_options(const Config& c) {
  TransportOptions t;
  t.slots = c.slots;
  t.timeout_s = c.timeout_s;
  t.node_size = c.node_size;
  t.priv_rows = c.max_private_tokens;
  t.provider = c.provider;
  return t;
}

MoeShape shape_of(const Config& c) {
  auto need = [](bool ok, const char* what) {
    if (!ok) throw std::invalid_argument(std::string("jax_moe_a2a Config: ") + what);
  };
  need(c.num_ranks >= 1 && c.num_experts >= 1 && c.num_experts % c.num_ranks == 0,
       "num_experts must be a positive multiple of num_ranks");
  need(c.experts_per_token >= 1 && c.hidden >= 1 && c.max_tokens_per_rank >= 1, "K, H and T must be positive");
  need(c.tp_size >= 1 && c.num_ranks % c.tp_size == 0, "tp_size must divide num_ranks");
  need(c.num_scales >= 0 && c.slots >= 1, "num_scales must be >= 0 and slots >= 1");
  MoeShape s{};
  s.N = c.num_ranks;
  s.E = c.num_experts;
  s.L = c.num_experts / c.num_ranks;
  s.K = c.experts_per_token;
  s.H = c.hidden;
  s.T = c.max_tokens_per_rank;
  s.tp = c.tp_size;
  s.S = c.num_scales;
  s.scale_block = c.scale_block;
  s.P = s.tokens_per_member() * (s.K < s.L ? s.K : s.L);
  s.Q = s.tokens_per_member() * s.K;
  s.wire_kind = c.dispatch_dtype;
  s.layout = c.layout;
  s.capacity = c.recv_rows;
  s.pow2 = c.pow2_scale ? 1 : 0;
  s.payload = int64_t(s.H) * elem_bytes(c.dispatch_dtype);
  s.row = pad16(s.payload + 4 * int64_t(s.S) + 8);
  s.c_row = int64_t(s.H) * elem_bytes(c.combine_dtype);
  return s;
}

}  // namespace a2a
