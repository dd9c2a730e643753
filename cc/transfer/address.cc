#include "transfer/address.h"

#include <unistd.h>

#include <chrono>
#include <random>

#include "transfer/errors.h"

namespace a2a::transfer {
namespace {
constexpr uint32_t kAddressMagic = 0x41413241;  // "A2AA"
constexpr uint16_t kAddressVersion = 1;
constexpr uint32_t kMaxDomains = 64;
}  // namespace

Bytes EngineAddress::serialize() const {
  ByteWriter w;
  w.put<uint32_t>(kAddressMagic);
  w.put<uint16_t>(kAddressVersion);
  w.put<uint16_t>(static_cast<uint16_t>(kind));
  w.put<uint32_t>(static_cast<uint32_t>(rank));
  w.put<uint32_t>(static_cast<uint32_t>(world_size));
  w.put<uint64_t>(instance);
  w.put_string(provider);
  w.put<uint32_t>(static_cast<uint32_t>(domains.size()));
  for (const DomainAddress& d : domains) {
    w.put_bytes(d.name.data(), d.name.size());
    w.put<uint64_t>(d.signal.key);
    w.put<uint64_t>(d.signal.base);
  }
  return w.take();
}

EngineAddress EngineAddress::parse(const Bytes& bytes) {
  ByteReader r(bytes, "engine address");
  if (r.get<uint32_t>() != kAddressMagic)
    throw TransferError("engine address: bad magic (not a jax_moe_a2a address)");
  uint16_t version = r.get<uint16_t>();
  if (version != kAddressVersion)
    throw TransferError(format("engine address: version %u, this engine reads version %u", version,
                               kAddressVersion));
  EngineAddress a;
  uint16_t kind = r.get<uint16_t>();
  if (kind != uint16_t(EngineKind::kFabric) && kind != uint16_t(EngineKind::kLocal))
    throw TransferError(format("engine address: unknown engine kind %u", kind));
  a.kind = static_cast<EngineKind>(kind);
  uint32_t rank = r.get<uint32_t>(), world = r.get<uint32_t>();
  if (world == 0 || world > 0x7fffffffu || rank >= world)
    throw TransferError(format("engine address: rank %u of world size %u", rank, world));
  a.rank = static_cast<int>(rank);
  a.world_size = static_cast<int>(world);
  a.instance = r.get<uint64_t>();
  a.provider = r.get_string();
  uint32_t n = r.get<uint32_t>();
  if (n == 0 || n > kMaxDomains) throw TransferError(format("engine address: %u domains", n));
  a.domains.resize(n);
  for (DomainAddress& d : a.domains) {
    d.name = r.get_bytes();
    d.signal.key = r.get<uint64_t>();
    d.signal.base = r.get<uint64_t>();
  }
  r.expect_end();
  return a;
}

uint64_t new_instance_id() {
  std::random_device rd;
  uint64_t x = (uint64_t(rd()) << 32) ^ rd();
  x ^= uint64_t(std::chrono::steady_clock::now().time_since_epoch().count()) * 0x9E3779B97F4A7C15ull;
  x ^= uint64_t(getpid()) << 17;
  return x ? x : 1;
}

}  // namespace a2a::transfer
