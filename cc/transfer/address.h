// A rank's serialisable endpoint address: what peers need to write to it.
//
// Bytes (little endian): magic "A2AA", version u16, engine kind u16, rank u32, world size u32,
// instance id u64 (random per engine: descriptors of another engine incarnation are refused),
// provider string, domain count u32, then per domain: fi_getname bytes, and the key and base of the
// domain's small "signal" region (target of zero-byte writes that only carry an immediate).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "transfer/memory.h"
#include "transfer/wire.h"

namespace a2a::transfer {

struct DomainAddress {
  Bytes name;        // fi_getname (empty for LocalEngine)
  RemoteKey signal;  // zero-byte write target
};

struct EngineAddress {
  EngineKind kind = EngineKind::kFabric;
  int rank = 0;
  int world_size = 1;
  uint64_t instance = 0;
  std::string provider;
  std::vector<DomainAddress> domains;

  Bytes serialize() const;
  static EngineAddress parse(const Bytes& bytes);
};

// A fresh random 64-bit engine instance id (never 0).
uint64_t new_instance_id();

}  // namespace a2a::transfer
