// jax_moe_a2a._C.host: creating and connecting the host backend's communicators from Python.
// Bootstrap data (engine addresses, region descriptors) travels through Python (the JAX
// key-value store between processes); the FFI handlers find communicators by id.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include "host/host_comm.h"
#include "proxy/gdrcopy.h"
#include "proxy/proxy.h"
#include "proxy/topology.h"
#include "python/config.h"
#include "python/proxy_stats.h"
#include "transfer/connect_order.h"
#include "transfer/engine.h"
#include "transfer/local_engine.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace a2a::python {
namespace {

transfer::Bytes to_bytes(const nb::bytes& b) {
  const auto* p = static_cast<const uint8_t*>(b.data());
  return transfer::Bytes(p, p + b.size());
}

nb::bytes from_bytes(const transfer::Bytes& b) {
  return nb::bytes(reinterpret_cast<const char*>(b.data()), b.size());
}

}  // namespace

void bind_host(nb::module_& m) {
  nb::module_ h = m.def_submodule("host", "host backend communicators (cc/host)");

  h.def(
      "create",
      [](int64_t comm_id, const Config& config, std::vector<int> local_ranks, int group) {
        const host::HostOptions o = host::host_options(config);
        const int num_ranks = config.num_ranks;
        const std::string& engine = config.engine;
        std::vector<std::shared_ptr<transfer::Engine>> engines;
        if (engine == "local") {
          if (int(local_ranks.size()) != num_ranks)
            throw std::invalid_argument("host.create: the local engine needs every rank of the EP group in this process");
          for (auto& e : transfer::LocalHub::create(num_ranks)) engines.push_back(e);
        } else if (engine == "fabric") {
          for (int r : local_ranks) {
            transfer::EngineOptions eo;
            eo.provider = config.provider;
            eo.rank = r;
            eo.world_size = num_ranks;
            eo.num_domains = transfer::rails_from_env();
            engines.push_back(transfer::make_fabric_engine(eo));
          }
        } else {
          throw std::invalid_argument("host.create: engine must be 'local' or 'fabric', got '" + engine + "'");
        }
        host::register_comm(comm_id, std::make_shared<host::HostComm>(o, std::move(engines), local_ranks), group);
      },
      "comm_id"_a, "config"_a, "local_ranks"_a, "group"_a = 0,
      "Creates EP group `group` of the communicator `comm_id` for this process's ranks of it (ranks within "
      "the group; config.engine 'local' or 'fabric', its engines know only the group's ranks); config.proxied: "
      "the protocol runs on a proxy thread per rank (cc/proxy), as in the cuda backend. Call once per group.");
  h.def(
      "buffer_bytes",
      [](const Config& config) {
        int64_t total = 0;
        for (const auto& [name, bytes] : host::buffer_regions(config)) total += bytes;
        return total;
      },
      "config"_a, "Buffer bytes one rank holds (all slots): the sum of buffer_regions.");
  h.def(
      "buffer_regions", [](const Config& config) { return regions_dict(host::buffer_regions(config)); }, "config"_a,
      "{region: bytes per rank, all slots} of the host backend's buffers.");

  h.def(
      "bootstrap_info",
      [](int64_t comm_id, int rank, int group) {
        auto& rc = host::find_comm(comm_id, group)->rank(rank);
        std::vector<nb::bytes> descs;
        for (auto& d : rc.descriptors()) descs.push_back(from_bytes(d));
        return nb::make_tuple(from_bytes(rc.engine().address()), descs, rc.engine().provider());
      },
      "comm_id"_a, "rank"_a, "group"_a = 0,
      "(engine address, [region descriptors], provider) of one local rank of EP group `group`.");

  h.def(
      "connect",
      [](int64_t comm_id, int rank, const std::vector<std::tuple<int, nb::bytes, std::vector<nb::bytes>>>& peers,
         int group) {
        auto comm = host::find_comm(comm_id, group);
        auto& rc = comm->rank(rank);
        std::vector<transfer::PeerAddress> addrs;
        std::map<int, std::vector<transfer::Bytes>> descs;
        for (auto& [r, addr, ds] : peers) {
          if (r != rank) addrs.push_back({r, to_bytes(addr)});
          for (auto& d : ds) descs[r].push_back(to_bytes(d));
        }
        nb::gil_scoped_release release;
        rc.check_peers(descs);  // before the engines exchange anything: a refusal then leaves nobody waiting
        rc.engine().add_peers(addrs);
        if (rc.engine().kind() == transfer::EngineKind::kFabric) transfer::connect_in_order(rc.engine(), rc.timeout_s());
        std::map<int, host::RankComm*> locals;
        for (int r : comm->ranks()) locals[r] = &comm->rank(r);
        rc.connect(descs, locals);
      },
      "comm_id"_a, "rank"_a, "peers"_a, "group"_a = 0,
      "Connects one local rank to every rank of its EP group: [(rank, address, descriptors)].");

  h.def(
      "recover",
      [](int64_t comm_id, const std::vector<int>& alive, int group) {
        auto comm = host::find_comm(comm_id, group);
        std::vector<uint8_t> m(alive.begin(), alive.end());
        for (auto& v : m) v = v != 0;
        nb::gil_scoped_release release;
        comm->recover(m);
      },
      "comm_id"_a, "alive"_a, "group"_a = 0,
      "Elastic EP recovery of EP group `group` after a peer failure (every survivor, same mask; docs/protocol.md).");

  h.def(
      "last_error",
      [](int64_t comm_id, int group) -> nb::object {
        auto comm = host::find_comm(comm_id, group);
        const std::string f = comm->failure();
        if (f.empty()) return nb::none();
        return nb::make_tuple(f, comm->failure_missing());
      },
      "comm_id"_a, "group"_a = 0, "(failure text, missing ranks) of EP group `group`, or None when usable.");

  h.def("destroy", &host::unregister_comm, "comm_id"_a, "Closes the engines and forgets the communicator (every EP group).");

  h.def(
      "proxy_stats",
      [](int64_t comm_id, int rank, int group) {
        const proxy::ProxyStats s = host::find_comm(comm_id, group)->rank(rank).proxy_stats();
        return python::proxy_stats_dict(s);
      },
      "comm_id"_a, "rank"_a, "group"_a = 0,
      "Counters of a local rank's proxy thread in EP group `group` (proxied mode; zeros and flag_path '' without).");

  nb::module_ px = m.def_submodule("proxy", "where a GPU's proxy thread runs (cc/proxy/topology.h)");
  px.def("parse_cpulist", &proxy::parse_cpulist, "text"_a, "CPUs of a Linux cpulist such as '0-3,8'; [] if malformed.");
  px.def("cpu_near_device", &proxy::cpu_near_device, "sysfs_root"_a, "bus_id"_a, "local_index"_a, "allowed"_a,
         "The proxy CPU of local rank `local_index` for the GPU at PCI `bus_id`: from the device's "
         "local_cpulist under sysfs_root, within `allowed` ([] = any), counting down; -1 if unknown.");
  px.def("allowed_cpus", &proxy::allowed_cpus, "The CPUs this process may run on.");
  // GDRCopy selection (proxy/gdrcopy.h): None takes JAX_MOE_A2A_GDRCOPY / _LIB / _DEV (or the defaults).
  auto probe = [](const std::optional<std::string>& mode, const std::optional<std::string>& library,
                  const std::optional<std::string>& device) {
    const proxy::gdr::Mode m = mode ? proxy::gdr::parse_mode(*mode) : proxy::gdr::mode_from_env();
    return std::make_pair(m, proxy::gdr::probe(m, library ? *library : proxy::gdr::default_library(),
                                               device ? *device : proxy::gdr::default_device()));
  };
  px.def(
      "gdrcopy_status",
      [probe](std::optional<std::string> mode, std::optional<std::string> library, std::optional<std::string> device) {
        const proxy::gdr::Probe p = probe(mode, library, device).second;
        return std::make_pair(p.available, p.reason);
      },
      "mode"_a = nb::none(), "library"_a = nb::none(), "device"_a = nb::none(),
      "(available, reason) of GDRCopy for the proxy's flags: the driver node, the library (dlopen), "
      "gdr_open; no GPU needed. reason is 'gdrcopy' when available.");
  px.def(
      "gdrcopy_select",
      [probe](std::optional<std::string> mode, std::optional<std::string> library, std::optional<std::string> device) {
        const auto [m, p] = probe(mode, library, device);
        return proxy::gdr::describe(m, p);
      },
      "mode"_a = nb::none(), "library"_a = nb::none(), "device"_a = nb::none(),
      "The flag path the cuda backend would choose before touching the GPU: 'gdrcopy' or "
      "'mapped-host: <reason>'; raises RuntimeError when mode '1' requires GDRCopy and it is unavailable.");
  px.def("local_process_rank", &proxy::local_process_rank,
         "This process's rank on its node (OMPI_COMM_WORLD_LOCAL_RANK, SLURM_LOCALID, LOCAL_RANK), else 0.");
}

}  // namespace a2a::python
