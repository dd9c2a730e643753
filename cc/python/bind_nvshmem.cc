// jax_moe_a2a._C.nvshmem: the NVSHMEM runtime (status, unique id, one initialisation per process)
// and the nvshmem backend's communicators. Bootstrap data travels through Python (the JAX
// key-value store between processes), never through NVSHMEM collectives (they abort in limited
// MPG mode, several PEs per GPU).
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <stdexcept>

#include "nvshmem/comm.h"
#include "nvshmem/runtime.h"
#include "python/config.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace a2a::python {

void bind_nvshmem(nb::module_& m) {
  nb::module_ c = m.def_submodule("nvshmem", "nvshmem backend: runtime and communicators (cc/nvshmem)");
  c.def("status", &nvshmem::init_status, "nvshmemx_init_status(): 0 none, 1 bootstrapped, 2 initialised, 3/4 MPG.");
  c.def("status_name", [](int s) { return std::string(nvshmem::status_name(s)); });
  c.def("unique_id", []() {
    const std::string s = nvshmem::unique_id();
    return nb::bytes(s.data(), s.size());
  }, "A fresh 128-byte NVSHMEM unique id (made by one process, read by the others).");
  c.def("ensure_initialized", [](int pe, int npes, nb::bytes uid, int device) {
    return nvshmem::ensure_initialized(pe, npes, std::string(static_cast<const char*>(uid.data()), uid.size()), device);
  }, "pe"_a, "npes"_a, "uid"_a, "device"_a,
     "Initialises NVSHMEM once per process by unique id (or attaches to a runtime already up); returns the status.");
  c.def("my_pe", &nvshmem::my_pe);
  c.def("n_pes", &nvshmem::n_pes);
  c.def("arena_size", &nvshmem::arena_size, "Bytes of this process's symmetric arena (0 before the first communicator).");
  c.def(
      "create",
      [](int64_t comm_id, const Config& config, int rank, int device, int64_t arena_bytes, bool all_remote) {
        nvshmem::register_comm(comm_id,
                               std::make_shared<nvshmem::NvComm>(config, rank, device, arena_bytes, all_remote));
      },
      "comm_id"_a, "config"_a, "rank"_a, "device"_a, "arena_bytes"_a, "all_remote"_a = false,
      "Collective over every PE (a host barrier, and the arena's nvshmem_malloc the first time). all_remote: "
      "every other rank takes the remote path ($JAX_MOE_A2A_NVSHMEM_REMOTE=all).");
  c.def("remote_peers", [](int64_t comm_id) {
    std::vector<int> out;
    const auto comm = nvshmem::find_comm(comm_id);
    for (int r = 0; r < comm->geometry().N; ++r)
      if ((comm->remote_mask() >> r) & 1) out.push_back(r);
    return out;
  }, "comm_id"_a, "The ranks that take the remote path (combine rows through the bounce rows), after connect.");
  c.def("bounce_bytes", [](int64_t comm_id) { return nvshmem::find_comm(comm_id)->bounce_bytes(); }, "comm_id"_a,
        "Arena bytes of the bounce rows this rank took at connect (all slots): 0 when no peer is remote.");
  c.def("bootstrap_info", [](int64_t comm_id) {
    const std::string s = nvshmem::find_comm(comm_id)->bootstrap_info();
    return nb::bytes(s.data(), s.size());
  });
  c.def("connect", [](int64_t comm_id, const std::vector<nb::bytes>& peers) {
    std::vector<std::string> infos;
    for (auto& b : peers) infos.emplace_back(static_cast<const char*>(b.data()), b.size());
    nvshmem::find_comm(comm_id)->connect(infos);
  });
  c.def(
      "buffer_bytes",
      [](const Config& config) {
        int64_t total = 0;
        for (const auto& [name, bytes] : nvshmem::buffer_regions(config)) total += bytes;
        return total;
      },
      "config"_a, "Symmetric heap bytes one rank's communicator takes (all slots): the sum of buffer_regions.");
  c.def(
      "buffer_regions", [](const Config& config) { return regions_dict(nvshmem::buffer_regions(config)); },
      "config"_a, "{region: bytes per rank, all slots} of the communicator's symmetric block.");
  c.def("destroy", &nvshmem::unregister_comm, "comm_id"_a);
  c.def("kernel_ms", [](int64_t comm_id, int rank, int op) {
    auto comm = nvshmem::find_comm(comm_id);
    if (comm->rank() != rank) throw std::invalid_argument("jax_moe_a2a nvshmem: rank " + std::to_string(rank) +
                                                         " is not this process's rank");
    return comm->kernel_ms(op);
  }, "comm_id"_a, "rank"_a, "op"_a,
        "Milliseconds of the last timed launch of op (0 dispatch_send .. 3 combine_recv) of this process's rank; "
        "negative when none was timed (JAX_MOE_A2A_KERNEL_TIMING=1 not set at create, or the launch was captured "
        "in a command buffer).");
  c.def("last_error", [](int64_t comm_id) { return nvshmem::find_comm(comm_id)->error_text(); }, "comm_id"_a,
        "A timeout recorded by this process's kernels (\"\" if none).");
}

}  // namespace a2a::python
