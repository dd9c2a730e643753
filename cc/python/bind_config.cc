// jax_moe_a2a._C.Config (core/config.h): the one struct Python hands every backend's create(),
// with the wire-dtype and layout enums (_C.Dtype, _C.Layout; jax_moe_a2a.config has the same
// codes). Built by jax_moe_a2a.config.Config.native(); fields named as in C++.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include "core/config.h"
#include "python/config.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace a2a::python {

nb::dict regions_dict(const std::vector<std::pair<std::string, int64_t>>& regions) {
  nb::dict d;
  for (const auto& [name, bytes] : regions) d[name.c_str()] = bytes;
  return d;
}

void bind_config(nb::module_& m) {
  nb::enum_<ElemKind>(m, "Dtype", nb::is_arithmetic(), "Wire / storage element dtype (core/dtype.h ElemKind).")
      .value("F32", ElemKind::kF32)
      .value("BF16", ElemKind::kBF16)
      .value("F16", ElemKind::kF16)
      .value("F8_E4M3FN", ElemKind::kF8E4M3);
  nb::enum_<Layout>(m, "Layout", nb::is_arithmetic(), "Receive layout (core/shape.h).")
      .value("RAGGED", Layout::kRagged)
      .value("EXPERT_MAJOR", Layout::kExpertMajor);
  nb::class_<Config>(m, "Config", "One communicator's configuration (core/config.h), built by jax_moe_a2a.config.")
      .def(nb::init<>())
      .def_rw("num_ranks", &Config::num_ranks)
      .def_rw("num_experts", &Config::num_experts)
      .def_rw("experts_per_token", &Config::experts_per_token)
      .def_rw("hidden", &Config::hidden)
      .def_rw("max_tokens_per_rank", &Config::max_tokens_per_rank)
      .def_rw("tp_size", &Config::tp_size)
      .def_rw("num_scales", &Config::num_scales)
      .def_rw("scale_block", &Config::scale_block)
      .def_rw("dispatch_dtype", &Config::dispatch_dtype)
      .def_rw("combine_dtype", &Config::combine_dtype)
      .def_rw("layout", &Config::layout)
      .def_rw("recv_rows", &Config::recv_rows)
      .def_rw("pow2_scale", &Config::pow2_scale)
      .def_rw("slots", &Config::slots)
      .def_rw("timeout_s", &Config::timeout_s)
      .def_rw("node_size", &Config::node_size)
      .def_rw("max_private_tokens", &Config::max_private_tokens)
      .def_rw("provider", &Config::provider)
      .def_rw("engine", &Config::engine)
      .def_rw("proxied", &Config::proxied)
      .def(
          "shape",
          [](const Config& c) {
            const MoeShape s = shape_of(c);
            nb::dict d;
            d["N"] = s.N; d["E"] = s.E; d["L"] = s.L; d["K"] = s.K; d["H"] = s.H; d["T"] = s.T;
            d["tp"] = s.tp; d["S"] = s.S; d["scale_block"] = s.scale_block; d["P"] = s.P;
            d["wire_kind"] = static_cast<int>(s.wire_kind); d["layout"] = static_cast<int>(s.layout); d["capacity"] = s.capacity;
            d["pow2"] = s.pow2; d["row"] = s.row; d["payload"] = s.payload; d["c_row"] = s.c_row;
            return d;
          },
          "The shape C++ derives from this config (core/shape.h MoeShape, shape_of), as a dict.");
}

}  // namespace a2a::python
