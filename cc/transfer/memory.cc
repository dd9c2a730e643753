#include "transfer/memory.h"

#include <rdma/fabric.h>
#include <rdma/fi_domain.h>

#include "transfer/errors.h"

namespace a2a::transfer {
namespace {
constexpr uint32_t kDescriptorMagic = 0x52413241;  // "A2AR"
constexpr uint16_t kDescriptorVersion = 1;
constexpr uint32_t kMaxDomains = 64;
}  // namespace

Bytes RemoteRegion::serialize() const {
  ByteWriter w;
  w.put<uint32_t>(kDescriptorMagic);
  w.put<uint16_t>(kDescriptorVersion);
  w.put<uint16_t>(static_cast<uint16_t>(kind));
  w.put<uint32_t>(static_cast<uint32_t>(owner));
  w.put<uint64_t>(owner_instance);
  w.put<uint64_t>(address);
  w.put<uint64_t>(size);
  w.put<uint32_t>(static_cast<uint32_t>(memory));
  w.put<uint32_t>(static_cast<uint32_t>(keys.size()));
  for (const RemoteKey& k : keys) {
    w.put<uint64_t>(k.key);
    w.put<uint64_t>(k.base);
  }
  return w.take();
}

RemoteRegion RemoteRegion::parse(const Bytes& descriptor) {
  ByteReader r(descriptor, "memory descriptor");
  if (r.get<uint32_t>() != kDescriptorMagic)
    throw TransferError("memory descriptor: bad magic (not a jax_moe_a2a descriptor)");
  uint16_t version = r.get<uint16_t>();
  if (version != kDescriptorVersion)
    throw TransferError(format("memory descriptor: version %u, this engine reads version %u",
                               version, kDescriptorVersion));
  RemoteRegion out;
  uint16_t kind = r.get<uint16_t>();
  if (kind != uint16_t(EngineKind::kFabric) && kind != uint16_t(EngineKind::kLocal))
    throw TransferError(format("memory descriptor: unknown engine kind %u", kind));
  out.kind = static_cast<EngineKind>(kind);
  uint32_t owner = r.get<uint32_t>();
  if (owner > 0x7fffffffu) throw TransferError("memory descriptor: bad owner rank");
  out.owner = static_cast<int>(owner);
  out.owner_instance = r.get<uint64_t>();
  out.address = r.get<uint64_t>();
  out.size = r.get<uint64_t>();
  if (out.address + out.size < out.address) throw TransferError("memory descriptor: address overflow");
  uint32_t memory = r.get<uint32_t>();
  if (memory > uint32_t(MemoryKind::kCuda))
    throw TransferError(format("memory descriptor: unknown memory kind %u", memory));
  out.memory = static_cast<MemoryKind>(memory);
  uint32_t n = r.get<uint32_t>();
  if (n == 0 || n > kMaxDomains) throw TransferError(format("memory descriptor: %u domains", n));
  out.keys.resize(n);
  for (RemoteKey& k : out.keys) {
    k.key = r.get<uint64_t>();
    k.base = r.get<uint64_t>();
  }
  r.expect_end();
  return out;
}

void RegionRegistry::add(Region* r) {
  std::unique_lock<std::shared_mutex> lock(mu_);
  if (!alive_.load()) throw TransferError("register memory: the engine is closed");
  if (!regions_.emplace(r->mr(0).remote.key, r).second)
    throw TransferError("register memory: duplicate memory key (provider bug?)");
}

void RegionRegistry::remove(Region* r) { regions_.erase(r->mr(0).remote.key); }

bool RegionRegistry::covers_locked(uint64_t key, uint64_t address, uint64_t size) const {
  auto it = regions_.find(key);
  if (it == regions_.end()) return false;
  const Region* r = it->second;
  uint64_t base = reinterpret_cast<uint64_t>(r->data());
  return address >= base && address + size <= base + r->size();
}

void RegionRegistry::close_all() {
  std::unique_lock<std::shared_mutex> lock(mu_);
  alive_.store(false);
  for (auto& kv : regions_) kv.second->close_locked();
  regions_.clear();
}

Region::Region(std::shared_ptr<RegionRegistry> registry, uint64_t engine_instance, EngineKind kind,
               int owner, void* data, uint64_t size, MemoryKind memory, int device,
               std::vector<DomainMr> mrs)
    : registry_(std::move(registry)),
      engine_instance_(engine_instance),
      kind_(kind),
      owner_(owner),
      data_(data),
      size_(size),
      memory_(memory),
      device_(device),
      mrs_(std::move(mrs)) {
  if (mrs_.empty()) throw TransferError("Region without registrations");
  try {
    registry_->add(this);
  } catch (...) {
    closed_ = true;
    for (DomainMr& m : mrs_)
      if (m.mr) fi_close(&m.mr->fid);
    throw;
  }
}

Region::~Region() { close(); }

RemoteRegion Region::remote() const {
  if (closed()) throw TransferError("Region.descriptor(): the region is closed");
  RemoteRegion out;
  out.kind = kind_;
  out.owner = owner_;
  out.owner_instance = engine_instance_;
  out.address = reinterpret_cast<uint64_t>(data_);
  out.size = size_;
  out.memory = memory_;
  for (const DomainMr& m : mrs_) out.keys.push_back(m.remote);
  return out;
}

void Region::close() {
  std::unique_lock<std::shared_mutex> lock(registry_->mutex());
  if (closed()) return;
  close_locked();
  registry_->remove(this);
}

void Region::close_locked() {
  if (closed_.exchange(true)) return;
  for (DomainMr& m : mrs_) {
    if (m.mr) fi_close(&m.mr->fid);  // the domain is still open: engines close regions first
    m.mr = nullptr;
    m.desc = nullptr;
  }
}

}  // namespace a2a::transfer
