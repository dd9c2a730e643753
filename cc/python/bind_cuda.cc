// jax_moe_a2a._C.cuda: creating and connecting the cuda backend's communicators from Python.
// IPC handles travel through Python (the JAX key-value store between processes).
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include "cuda/comm.h"
#include "python/config.h"
#ifdef JAX_MOE_A2A_WITH_LIBFABRIC  // the inter-node path: proxy/proxy.h includes libfabric's headers
#include "cuda/remote_path.h"
#include "python/proxy_stats.h"
#endif

namespace nb = nanobind;
using namespace nb::literals;

namespace a2a::python {

void bind_cuda(nb::module_& m) {
  nb::module_ c = m.def_submodule("cuda", "cuda backend communicators (cc/cuda)");
  c.def(
      "create",
      [](int64_t comm_id, const Config& config, std::vector<int> ranks, std::vector<int> devices, int group,
         int first_local_index) {
        cuda::register_comm(
            comm_id, std::make_shared<cuda::CudaComm>(gpu::gpu_options(config), ranks, devices, first_local_index),
            group);
      },
      "comm_id"_a, "config"_a, "ranks"_a, "devices"_a, "group"_a = 0, "first_local_index"_a = 0,
      "Creates EP group `group` of the communicator for this process's ranks of it (ranks within the group, "
      "one device each; first_local_index: how many ranks of this process earlier groups hold). With "
      "0 < config.node_size < num_ranks, ranks r // node_size share a node and peers on other nodes go "
      "through a proxy thread and the TransferEngine over config.provider.");
#ifdef JAX_MOE_A2A_WITH_LIBFABRIC
  c.def(
      "remote_info",
      [](int64_t comm_id, int rank, int group) -> nb::object {
        cuda::RemotePath* rp = cuda::find_comm(comm_id, group)->rank(rank).remote();
        if (!rp) return nb::none();
        const transfer::Bytes addr = rp->address();
        nb::list descs;
        for (const auto& d : rp->descriptors()) descs.append(nb::bytes(reinterpret_cast<const char*>(d.data()), d.size()));
        return nb::make_tuple(nb::bytes(reinterpret_cast<const char*>(addr.data()), addr.size()), descs, rp->provider());
      },
      "comm_id"_a, "rank"_a, "group"_a = 0,
      "(engine address, [descriptors], provider) of a rank's inter-node path, or None.");
  c.def(
      "connect_remote",
      [](int64_t comm_id, int rank, const std::vector<std::tuple<int, nb::bytes, std::vector<nb::bytes>>>& peers,
         int group) {
        auto as_bytes = [](const nb::bytes& b) {
          const auto* p = static_cast<const uint8_t*>(b.data());
          return transfer::Bytes(p, p + b.size());
        };
        std::vector<std::tuple<int, transfer::Bytes, std::vector<transfer::Bytes>>> ps;
        for (const auto& [r, addr, ds] : peers) {
          std::vector<transfer::Bytes> d;
          for (const auto& x : ds) d.push_back(as_bytes(x));
          ps.emplace_back(r, as_bytes(addr), std::move(d));
        }
        auto comm = cuda::find_comm(comm_id, group);
        cuda::RemotePath* rp = comm->rank(rank).remote();
        if (!rp) throw std::invalid_argument("jax_moe_a2a cuda: rank has no peers on other nodes");
        nb::gil_scoped_release release;
        rp->connect(ps);
      },
      "comm_id"_a, "rank"_a, "peers"_a, "group"_a = 0,
      "Connects a rank's inter-node path: [(rank, address, descriptors)] of every rank of its EP group.");
  c.def(
      "proxy_stats",
      [](int64_t comm_id, int rank, int group) {
        cuda::RemotePath* rp = cuda::find_comm(comm_id, group)->rank(rank).remote();
        const proxy::ProxyStats s = rp ? rp->stats() : proxy::ProxyStats{};
        return python::proxy_stats_dict(s);
      },
      "comm_id"_a, "rank"_a, "group"_a = 0,
      "Counters of a rank's proxy thread (zeros without one); flag_path: 'gdrcopy' or 'mapped-host: <why>'; row_path: 'host', 'copy' or 'device' (JAX_MOE_A2A_STAGING); rails: the engine's domains (JAX_MOE_A2A_RAILS; unset: 2 with copy rows, else 1); staged_bytes, staging_ns, staging_busy_ns: what the copy path's row copies moved, how long they took (summed) and their wall time (any in flight).");
#endif
  c.def("bootstrap_info", [](int64_t comm_id, int rank, int group) {
    std::string s = cuda::find_comm(comm_id, group)->rank(rank).bootstrap_info();
    return nb::bytes(s.data(), s.size());
  }, "comm_id"_a, "rank"_a, "group"_a = 0);
  c.def("connect", [](int64_t comm_id, int rank, const std::vector<nb::bytes>& peers, int group) {
    auto comm = cuda::find_comm(comm_id, group);
    std::vector<std::string> infos;
    for (auto& b : peers) infos.emplace_back(static_cast<const char*>(b.data()), b.size());
    comm->rank(rank).connect(infos, comm->locals());  // peers[r]: rank r of this EP group
  }, "comm_id"_a, "rank"_a, "peers"_a, "group"_a = 0);
  c.def("buffer_bytes", &cuda::device_bytes, "config"_a,
        "Device memory bytes one rank's communicator allocates (all slots): the shared_* and private_* regions.");
  c.def(
      "buffer_regions", [](const Config& config) { return regions_dict(cuda::buffer_regions(config)); }, "config"_a,
      "{region: bytes per rank, all slots}: device memory (shared_*, private_*) and, with peers on other nodes, "
      "the inter-node path's pinned host buffers (remote_*).");
  c.def("destroy", &cuda::unregister_comm, "comm_id"_a);
  c.def("kernel_ms",
        [](int64_t comm_id, int rank, int op, int group) { return cuda::find_comm(comm_id, group)->rank(rank).kernel_ms(op); },
        "comm_id"_a, "rank"_a, "op"_a, "group"_a = 0,
        "Milliseconds of the last timed launch of op (0 dispatch_send .. 3 combine_recv) on a local rank; "
        "negative when none was timed (JAX_MOE_A2A_KERNEL_TIMING=1 not set, or the launch was captured in a "
        "command buffer).");
  c.def("last_error", [](int64_t comm_id) {
    std::string out;
    for (auto& comm : cuda::find_groups(comm_id)) {  // every EP group with ranks here
      for (auto& [r, s] : comm->locals()) {
        const std::string t = s->error_text();
        if (!t.empty()) out += (out.empty() ? "" : "\n") + t;
      }
    }
    return out;
  }, "comm_id"_a, "Timeouts recorded by this process's kernels (\"\" if none).");
}

}  // namespace a2a::python
