// jax_moe_a2a._C.cuda: creating and connecting the cuda backend's communicators from Python.
// IPC handles travel through Python (the JAX key-value store between processes).
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "cuda/comm.h"
#include "python/gpu_options.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace a2a::python {

void bind_cuda(nb::module_& m) {
  nb::module_ c = m.def_submodule("cuda", "cuda backend communicators (cc/cuda)");
  c.def(
      "create",
      [](int64_t comm_id, int N, int E, int K, int H, int T, int tp, int S, int scale_block, int wire_kind, int layout,
         int capacity, bool pow2, int slots, double timeout_s, std::vector<int> ranks, std::vector<int> devices) {
        const cuda::CudaOptions o =
            gpu_options(N, E, K, H, T, tp, S, scale_block, wire_kind, layout, capacity, pow2, slots, timeout_s);
        cuda::register_comm(comm_id, std::make_shared<cuda::CudaComm>(o, ranks, devices));
      },
      "comm_id"_a, "N"_a, "E"_a, "K"_a, "H"_a, "T"_a, "tp"_a, "S"_a, "scale_block"_a, "wire_kind"_a, "layout"_a,
      "capacity"_a, "pow2"_a, "slots"_a, "timeout_s"_a, "ranks"_a, "devices"_a);
  c.def("bootstrap_info", [](int64_t comm_id, int rank) {
    std::string s = cuda::find_comm(comm_id)->rank(rank).bootstrap_info();
    return nb::bytes(s.data(), s.size());
  });
  c.def("connect", [](int64_t comm_id, int rank, const std::vector<nb::bytes>& peers) {
    auto comm = cuda::find_comm(comm_id);
    std::vector<std::string> infos;
    for (auto& b : peers) infos.emplace_back(static_cast<const char*>(b.data()), b.size());
    comm->rank(rank).connect(infos, comm->locals());
  });
  c.def("buffer_bytes", [](int N, int E, int K, int H, int T, int tp, int S, int wire_kind, int slots) {
    cuda::Geometry g{};
    g.N = N; g.E = E; g.K = K; g.H = H; g.T = T; g.tp = tp; g.S = S; g.wire_kind = wire_kind;
    int64_t shared = 0, priv = 0;
    cuda::finish_geometry(&g, slots, &shared, &priv);
    return shared + priv;
  });
  c.def("destroy", &cuda::unregister_comm, "comm_id"_a);
  c.def("kernel_ms", [](int64_t comm_id, int rank, int op) { return cuda::find_comm(comm_id)->rank(rank).kernel_ms(op); },
        "comm_id"_a, "rank"_a, "op"_a,
        "Milliseconds of the last timed launch of op (0 dispatch_send .. 3 combine_recv) on a local rank; "
        "negative when none was timed (JAX_MOE_A2A_KERNEL_TIMING=1 not set, or the launch was captured in a "
        "command buffer).");
  c.def("last_error", [](int64_t comm_id) {
    std::string out;
    for (auto& [r, s] : cuda::find_comm(comm_id)->locals()) {
      const std::string t = s->error_text();
      if (!t.empty()) out += (out.empty() ? "" : "\n") + t;
    }
    return out;
  }, "comm_id"_a, "Timeouts recorded by this process's kernels (\"\" if none).");
}

}  // namespace a2a::python
