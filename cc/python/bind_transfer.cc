// jax_moe_a2a._C.transfer: the TransferEngine (cc/transfer) for Python. Blocking calls release the
// GIL. Errors: TransferError (a RuntimeError), TransferTimeoutError (a TimeoutError), ValueError
// and IndexError for bad arguments.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include "transfer/connect_order.h"
#include "transfer/engine.h"
#include "transfer/fabric_engine.h"
#include "transfer/local_engine.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace a2a::python {
namespace {

using namespace a2a::transfer;

Bytes to_bytes(const nb::bytes& b) {
  const auto* p = static_cast<const uint8_t*>(b.data());
  return Bytes(p, p + b.size());
}

nb::bytes from_bytes(const Bytes& b) { return nb::bytes(reinterpret_cast<const char*>(b.data()), b.size()); }

MemoryKind memory_kind(const std::string& s) {
  if (s == "host" || s == "cpu") return MemoryKind::kHost;
  if (s == "cuda" || s == "gpu") return MemoryKind::kCuda;
  throw std::invalid_argument("memory kind '" + s + "': expected 'host' or 'cuda'");
}

const char* memory_name(MemoryKind k) { return k == MemoryKind::kCuda ? "cuda" : "host"; }

// [(peer_index, src_offset, length, dst RemoteRegion | None, dst_offset), ...]
std::vector<ScatterEntry> scatter_entries(const nb::handle& entries) {
  std::vector<ScatterEntry> out;
  for (nb::handle item : entries) {
    nb::sequence seq = nb::borrow<nb::sequence>(item);
    if (nb::len(seq) != 5)
      throw std::invalid_argument(
          "scatter entries are (peer_index, src_offset, length, dst_region_or_None, dst_offset)");
    ScatterEntry e;
    e.peer = nb::cast<uint32_t>(seq[0]);
    e.src_offset = nb::cast<uint64_t>(seq[1]);
    e.length = nb::cast<uint64_t>(seq[2]);
    nb::object dst = seq[3];
    e.dst = dst.is_none() ? nullptr : nb::cast<const RemoteRegion*>(dst);
    e.dst_offset = nb::cast<uint64_t>(seq[4]);
    out.push_back(e);
  }
  return out;
}

constexpr double kDefaultTimeout = 60.0;

void bind_region(nb::module_& m) {
  nb::class_<Region>(m, "Region", "Local registered memory. `descriptor()` goes to the peers.")
      .def_prop_ro("address", [](const Region& r) { return reinterpret_cast<uintptr_t>(r.data()); })
      .def_prop_ro("size", &Region::size)
      .def_prop_ro("owner", &Region::owner)
      .def_prop_ro("memory", [](const Region& r) { return memory_name(r.memory_kind()); })
      .def_prop_ro("closed", &Region::closed)
      .def("descriptor", [](const Region& r) { return from_bytes(r.descriptor()); },
           "Serialised descriptor (bytes): address, size, owner rank, keys per domain.")
      .def("close", &Region::close, "Deregisters the memory (idempotent).")
      .def("__repr__", [](const Region& r) {
        return format("<Region rank %d, %llu bytes at 0x%llx, %s%s>", r.owner(),
                      (unsigned long long)r.size(), (unsigned long long)(uintptr_t)r.data(),
                      memory_name(r.memory_kind()), r.closed() ? ", closed" : "");
      });

  nb::class_<RemoteRegion>(m, "RemoteRegion", "A peer's memory, from Engine.remote(descriptor).")
      .def_ro("owner", &RemoteRegion::owner)
      .def_ro("size", &RemoteRegion::size)
      .def_ro("address", &RemoteRegion::address)
      .def_prop_ro("memory", [](const RemoteRegion& r) { return memory_name(r.memory); })
      .def_prop_ro("num_domains", [](const RemoteRegion& r) { return r.keys.size(); })
      .def("descriptor", [](const RemoteRegion& r) { return from_bytes(r.serialize()); })
      .def("__repr__", [](const RemoteRegion& r) {
        return format("<RemoteRegion rank %d, %llu bytes at 0x%llx>", r.owner,
                      (unsigned long long)r.size, (unsigned long long)r.address);
      });

  nb::class_<PeerGroup>(m, "PeerGroup", "Peers of scatter/signal/barrier, with prepared requests.")
      .def_prop_ro("ranks", &PeerGroup::ranks)
      .def("__len__", &PeerGroup::size)
      .def("__repr__", [](const PeerGroup& g) { return "<PeerGroup ranks [" + join_ranks(g.ranks()) + "]>"; });
}

void bind_engine(nb::module_& m) {
  using Release = nb::call_guard<nb::gil_scoped_release>;
  nb::class_<Engine>(m, "Engine",
                     "Transfer engine: one-sided writes with 32-bit immediates, counted at the receiver.")
      .def_prop_ro("rank", &Engine::rank)
      .def_prop_ro("world_size", &Engine::world_size)
      .def_prop_ro("provider", &Engine::provider)
      .def_prop_ro("num_domains", &Engine::num_domains)
      .def_prop_ro("instance", &Engine::instance)
      .def_prop_ro("closed", &Engine::closed)
      .def("address", [](const Engine& e) { return from_bytes(e.address()); },
           "This rank's serialised address (bytes).")
      .def("add_peers",
           [](Engine& e, const std::vector<std::pair<int, nb::bytes>>& peers) {
             std::vector<PeerAddress> list;
             for (const auto& [rank, addr] : peers) list.push_back({rank, to_bytes(addr)});
             nb::gil_scoped_release release;
             e.add_peers(list);
           },
           "peers"_a, "Adds [(rank, address bytes), ...].")
      .def("connect_in_order",
           [](Engine& e, double timeout_s) {
             nb::gil_scoped_release release;
             connect_in_order(e, timeout_s);
           },
           "timeout_s"_a,
           "Collective: the first write of every pair goes from the lower rank to the higher "
           "(avoids simultaneous connects on connection-oriented providers); see connect_order.h.")
      .def("peers", &Engine::peers, "Known ranks (ourselves included).")
      .def("register_array",
           [](Engine& e, nb::ndarray<nb::c_contig, nb::device::cpu> a) {
             if (a.nbytes() == 0) throw std::invalid_argument("register_array: empty array");
             return e.register_memory(a.data(), a.nbytes(), MemoryKind::kHost, 0);
           },
           // noconvert: never register a temporary contiguous copy (writes would land there)
           nb::arg("array").noconvert(), nb::keep_alive<0, 2>(),
           "Registers a C-contiguous, writeable host array (kept alive by the region).")
      .def("register_ptr",
           [](Engine& e, uintptr_t ptr, uint64_t size, const std::string& memory, int device) {
             return e.register_memory(reinterpret_cast<void*>(ptr), size, memory_kind(memory), device);
           },
           "ptr"_a, "size"_a, "memory"_a = "host", "device"_a = 0,
           "Registers raw memory: memory='host' or 'cuda' (needs FI_HMEM). You keep it alive.")
      .def("remote", [](const Engine& e, const nb::bytes& d) { return e.remote(to_bytes(d)); },
           "descriptor"_a, "Validates a peer's descriptor; unknown/stale owners are refused.")
      .def("peer_group", &Engine::peer_group, "ranks"_a)
      .def("write",
           [](Engine& e, int peer, const Region& src, uint64_t src_offset, uint64_t length,
              const RemoteRegion* dst, uint64_t dst_offset, uint32_t imm) {
             nb::gil_scoped_release release;
             e.write(peer, src, src_offset, length, dst, dst_offset, imm);
           },
           "peer"_a, "src"_a, "src_offset"_a, "length"_a, "dst"_a.none(), "dst_offset"_a, "imm"_a)
      .def("write_on",
           [](Engine& e, int rail, int peer, const Region& src, uint64_t src_offset, uint64_t length,
              const RemoteRegion* dst, uint64_t dst_offset, uint32_t imm) {
             nb::gil_scoped_release release;
             e.write_on(rail, peer, src, src_offset, length, dst, dst_offset, imm);
           },
           "rail"_a, "peer"_a, "src"_a, "src_offset"_a, "length"_a, "dst"_a.none(), "dst_offset"_a, "imm"_a,
           "write() on rail `rail`: our domain rail % num_domains to the peer's domain rail % its num_domains.")
      .def("scatter",
           [](Engine& e, const PeerGroup& g, const Region& src, nb::handle entries, uint32_t imm) {
             std::vector<ScatterEntry> list = scatter_entries(entries);
             nb::gil_scoped_release release;
             e.scatter(g, src, list, imm);
           },
           "group"_a, "src"_a, "entries"_a, "imm"_a,
           "entries: [(peer_index, src_offset, length, dst RemoteRegion | None, dst_offset)].")
      .def("signal", &Engine::signal, "group"_a, "imm"_a, Release())
      .def("barrier", &Engine::barrier, "group"_a, "imm"_a, "timeout_s"_a = kDefaultTimeout, Release())
      .def("barrier_ranked", &Engine::barrier_ranked, "group"_a, "tag"_a, "epoch"_a,
           "timeout_s"_a = kDefaultTimeout, Release())
      .def("wait", &Engine::wait, "imm"_a, "n"_a = 1, "timeout_s"_a = kDefaultTimeout, Release())
      .def("wait_ranks", &Engine::wait_ranks, "tag"_a, "epoch"_a, "ranks"_a,
           "timeout_s"_a = kDefaultTimeout, Release())
      .def("count", &Engine::count, "imm"_a, "Arrivals of imm not consumed yet.")
      .def("counts",
           [](const Engine& e) {
             nb::dict d;
             for (const auto& [imm, n] : e.counts()) d[nb::int_(imm)] = nb::int_(n);
             return d;
           },
           "{imm: unconsumed arrivals}.")
      .def("flush", &Engine::flush, "timeout_s"_a = kDefaultTimeout, Release())
      .def("pending", &Engine::pending)
      .def("close", &Engine::close, Release())
      .def("__enter__", [](nb::handle self) { return nb::borrow(self); })
      .def("__exit__", [](Engine& e, nb::handle, nb::handle, nb::handle) {
        nb::gil_scoped_release release;
        e.close();
      }, nb::arg().none(), nb::arg().none(), nb::arg().none())
      .def("__repr__", [](const Engine& e) {
        return format("<%s rank %d/%d, provider '%s', %d domain(s)%s>",
                      e.kind() == EngineKind::kLocal ? "LocalEngine" : "FabricEngine", e.rank(),
                      e.world_size(), e.provider().c_str(), e.num_domains(),
                      e.closed() ? ", closed" : "");
      });

  nb::class_<FabricEngine, Engine>(m, "FabricEngine", "The engine over libfabric RDM endpoints.")
      .def(
          "__init__",
          [](FabricEngine* self, const std::string& provider, int num_domains, int rank,
             int world_size, const std::string& iface, bool hmem, double post_timeout_s) {
            EngineOptions o;
            o.provider = provider;
            o.num_domains = num_domains;
            o.rank = rank;
            o.world_size = world_size;
            o.iface = iface;
            o.hmem = hmem;
            o.post_timeout_s = post_timeout_s;
            nb::gil_scoped_release release;
            new (self) FabricEngine(o);
          },
          "provider"_a = "", "num_domains"_a = 1, "rank"_a = 0, "world_size"_a = 1, "iface"_a = "",
          "hmem"_a = false, "post_timeout_s"_a = 30.0,
          "provider '' -> $JAX_MOE_A2A_PROVIDER -> 'shm'; iface '' -> $JAX_MOE_A2A_IFACE (domain "
          "names, e.g. 'lo' for tcp on loopback).")
      .def("domain_names", [](const FabricEngine& e) {
        std::vector<std::string> out;
        for (int d = 0; d < e.num_domains(); ++d) out.push_back(e.domain(d).name());
        return out;
      })
      .def("mr_mode", [](const FabricEngine& e) { return e.domain(0).mr_mode(); },
           "domain 0's FI_MR_* bits as reported by the provider.")
      .def("progress", &FabricEngine::progress, Release(),
           "Polls the completion queues once (the progress thread does this too).");

  nb::class_<LocalEngine, Engine>(m, "LocalEngine", "Rank of an in-process hub (memcpy + counters).");
  m.def("local_engines", &LocalHub::create, "world_size"_a,
        "world_size in-process engines that know each other: [rank 0, rank 1, ...].");
}

void bind_helpers(nb::module_& m) {
  m.def("pack_imm", &pack_imm, "tag"_a, "epoch"_a, "rank"_a,
        "tag (8 bits) | epoch (8 bits) | rank (16 bits) as one 32-bit immediate.");
  m.def("unpack_imm", [](uint32_t imm) {
    ImmFields f = unpack_imm(imm);
    return std::make_tuple(f.tag, f.epoch, f.rank);
  }, "imm"_a);
}

}  // namespace

void bind_transfer(nb::module_& parent) {
  nb::module_ m = parent.def_submodule(
      "transfer", "TransferEngine: libfabric RMA writes with immediate counters (no MoE knowledge).");
  // Translators run newest first: the TimeoutError subclass must be registered after its base.
  nb::exception<TransferError>(m, "TransferError", PyExc_RuntimeError);
  nb::exception<TimeoutError>(m, "TransferTimeoutError", PyExc_TimeoutError);
  bind_region(m);
  bind_engine(m);
  bind_helpers(m);
  m.attr("fabric_api_version") = nb::make_tuple(FI_MAJOR(kFabricApiVersion), FI_MINOR(kFabricApiVersion));
}

}  // namespace a2a::python
