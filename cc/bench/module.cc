// The nanobind module jax_moe_a2a_bench: the benchmark programs' timing loops (benchmarks/engine.py,
// benchmarks/proxy.py), kept out of the library's module jax_moe_a2a._C. It is installed next to
// the package by the same build, and the library never imports it.
//
// The TransferEngine loops take the Engine, Region, RemoteRegion and PeerGroup objects that
// jax_moe_a2a._C.transfer makes: nanobind extensions of one ABI share their type registry, so this
// module imports _C first (its types are registered) and accepts them. The loops call the engine
// through its virtual methods, implemented in _C. What was built shows in what is there: the
// TransferEngine loops with libfabric, signal_roundtrip with nvcc.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#if defined(JAX_MOE_A2A_WITH_LIBFABRIC)
#include "bench/loops.h"
#include "bench/raw_exchange.h"
#include "bench/raw_pingpong.h"
#endif
#if defined(JAX_MOE_A2A_WITH_CUDA)
#include "bench/signal_roundtrip.h"
#endif

namespace nb = nanobind;
using namespace nb::literals;

namespace {

constexpr double kDefaultTimeout = 60.0;

#if defined(JAX_MOE_A2A_WITH_LIBFABRIC)
void bind_transfer_loops(nb::module_& m) {
  using namespace a2a::bench;
  using a2a::transfer::Bytes;
  using Release = nb::call_guard<nb::gil_scoped_release>;
  auto to_bytes = [](const nb::bytes& b) {
    const auto* p = static_cast<const uint8_t*>(b.data());
    return Bytes(p, p + b.size());
  };
  m.def("pingpong", &pingpong, "engine"_a, "peer"_a, "src"_a, "dst"_a, "size"_a, "iters"_a,
        "warmup"_a, "initiator"_a, "imm"_a, "timeout_s"_a = kDefaultTimeout, Release(),
        "Seconds of `iters` write + wait round trips with `peer` (after `warmup`).");
  m.def("stream", &stream, "engine"_a, "peer"_a, "src"_a, "dst"_a, "size"_a, "count"_a, "sender"_a,
        "imm"_a, "ack_imm"_a, "timeout_s"_a = kDefaultTimeout, Release(),
        "Sender: seconds from the first of `count` writes to the receiver's ack (0 on the receiver).");
  m.def("scatter",
        [](Engine& e, const PeerGroup& g, const Region& src, const std::vector<const RemoteRegion*>& dsts,
           uint64_t size, int my_slot, int iters, int warmup, uint32_t imm, double timeout_s) {
          if (dsts.size() != g.size()) throw std::invalid_argument("scatter: one dst per member");
          nb::gil_scoped_release release;
          return scatter_loop(e, g, src, dsts, size, my_slot, iters, warmup, imm, timeout_s);
        },
        "engine"_a, "group"_a, "src"_a, "dsts"_a, "size"_a, "my_slot"_a, "iters"_a, "warmup"_a,
        "imm"_a, "timeout_s"_a = kDefaultTimeout,
        "Seconds of `iters` rounds of scatter to every member + wait for every member's.");
  m.def("barrier", &barrier_loop, "engine"_a, "group"_a, "iters"_a, "warmup"_a, "imm"_a,
        "timeout_s"_a = kDefaultTimeout, Release(), "Seconds of `iters` barriers over the group.");
  nb::class_<RawPingPong>(m, "RawPingPong",
                          "Raw fi_writedata ping-pong (no engine): the latency baseline.")
      .def(nb::init<const std::string&, const std::string&, uint64_t>(), "provider"_a = "",
           "iface"_a = "", "max_size"_a = 1 << 22)
      .def("blob", [](const RawPingPong& r) {
        const Bytes b = r.blob();
        return nb::bytes(reinterpret_cast<const char*>(b.data()), b.size());
      })
      .def("connect", [to_bytes](RawPingPong& r, const nb::bytes& b) { r.connect(to_bytes(b)); })
      .def("run", &RawPingPong::run, "size"_a, "iters"_a, "initiator"_a,
           "timeout_s"_a = kDefaultTimeout, Release());
  nb::class_<RawExchange>(m, "RawExchange",
                          "Raw fi_writedata all-to-all (no engine): every rank writes every other rank at once.")
      .def(nb::init<const std::string&, const std::string&, uint64_t, int, int>(), "provider"_a, "iface"_a,
           "max_size"_a, "world"_a, "rank"_a)
      .def("blob", [](const RawExchange& r) {
        const Bytes b = r.blob();
        return nb::bytes(reinterpret_cast<const char*>(b.data()), b.size());
      })
      .def("connect",
           [to_bytes](RawExchange& r, const std::vector<nb::bytes>& blobs) {
             std::vector<Bytes> v;
             for (const auto& b : blobs) v.push_back(to_bytes(b));
             r.connect(v);
           },
           "blobs"_a, "Every rank's blob in rank order (collective through the caller's key-value store).")
      .def("run", &RawExchange::run, "sizes"_a, "iters"_a, "timeout_s"_a = kDefaultTimeout, Release(),
           "Seconds of `iters` exchanges back to back: sizes[d] bytes to every rank d != ours, then wait for "
           "our writes' completions and every peer's message.");
}
#endif

}  // namespace

NB_MODULE(jax_moe_a2a_bench, m) {
  m.doc() = "Timing loops of the benchmark programs in benchmarks/ (not part of jax_moe_a2a).";
  // The engine's classes (and its exception translators) come from the library's module.
  nb::module_::import_("jax_moe_a2a._C");
#if defined(JAX_MOE_A2A_WITH_LIBFABRIC)
  bind_transfer_loops(m);
#endif
#if defined(JAX_MOE_A2A_WITH_CUDA)
  m.def(
      "signal_roundtrip",
      [](int device, int iters) {
        nb::gil_scoped_release release;
        return a2a::bench::signal_roundtrip(device, iters);
      },
      "device"_a, "iters"_a,
      "Nanoseconds of each GPU -> host -> GPU flag round trip through mapped pinned memory (the kernel <-> "
      "proxy signalling path), timed by the GPU.");
#endif
}
