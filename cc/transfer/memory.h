// Registered memory: local regions (with one libfabric MR per domain) and remote regions parsed
// from serialisable descriptors.
//
// Descriptor bytes (little endian): magic "A2AR", version u16, engine kind u16, owner rank u32,
// owner instance id u64, address u64, size u64, memory kind u32, domain count u32, then per domain d:
// key u64 and base u64 (the RMA address of byte 0: the virtual address under FI_MR_VIRT_ADDR,
// 0 for offset-based providers).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "transfer/wire.h"

struct fid_mr;

namespace a2a::transfer {

enum class MemoryKind : uint32_t { kHost = 0, kCuda = 1 };
enum class EngineKind : uint16_t { kFabric = 1, kLocal = 2 };

// Where a peer writes into one domain of the owner: rma address of byte 0 and key.
struct RemoteKey {
  uint64_t key = 0;
  uint64_t base = 0;
};

// Another rank's (or our own) registered memory, parsed and validated from a descriptor.
struct RemoteRegion {
  EngineKind kind = EngineKind::kFabric;
  int owner = -1;
  uint64_t owner_instance = 0;
  uint64_t address = 0;  // owner's virtual address (informational; LocalEngine copies to it)
  uint64_t size = 0;
  MemoryKind memory = MemoryKind::kHost;
  std::vector<RemoteKey> keys;  // one per owner domain

  Bytes serialize() const;
  static RemoteRegion parse(const Bytes& descriptor);  // format checks only; engines check owner
};

// One domain's registration of a region.
struct DomainMr {
  fid_mr* mr = nullptr;
  void* desc = nullptr;  // fi_mr_desc, for FI_MR_LOCAL providers
  RemoteKey remote;
};

class Region;

// Live regions of one engine, so that closing the engine deregisters what Python still holds.
class RegionRegistry {
 public:
  void add(Region* r);
  void remove(Region* r);  // registry mutex held
  // Runs f() while a live region with domain-0 key `key` covers [address, address+size) and
  // cannot be deregistered; false (f not run) otherwise.
  template <typename F>
  bool with_live(uint64_t key, uint64_t address, uint64_t size, F&& f) {
    std::shared_lock<std::shared_mutex> lock(mu_);
    if (!covers_locked(key, address, size)) return false;
    f();
    return true;
  }
  // Deregisters every region and refuses new ones.
  void close_all();
  bool alive() const { return alive_.load(); }
  std::shared_mutex& mutex() { return mu_; }

 private:
  bool covers_locked(uint64_t key, uint64_t address, uint64_t size) const;
  std::shared_mutex mu_;
  std::unordered_map<uint64_t, Region*> regions_;  // by domain-0 key
  std::atomic<bool> alive_{true};
};

// A local registered buffer. Created by Engine::register_memory; deregistered by close() or when
// the last reference goes (or when the engine closes, whichever comes first).
class Region {
 public:
  Region(std::shared_ptr<RegionRegistry> registry, uint64_t engine_instance, EngineKind kind,
         int owner, void* data, uint64_t size, MemoryKind memory, int device,
         std::vector<DomainMr> mrs);
  ~Region();
  Region(const Region&) = delete;
  Region& operator=(const Region&) = delete;

  void* data() const { return data_; }
  uint64_t size() const { return size_; }
  MemoryKind memory_kind() const { return memory_; }
  int device() const { return device_; }
  int owner() const { return owner_; }
  uint64_t engine_instance() const { return engine_instance_; }
  bool closed() const { return closed_.load(std::memory_order_acquire); }
  const DomainMr& mr(size_t domain) const { return mrs_[domain]; }
  size_t num_domains() const { return mrs_.size(); }

  RemoteRegion remote() const;  // what a peer gets from descriptor()
  Bytes descriptor() const { return remote().serialize(); }

  void close();  // deregisters (idempotent)

 private:
  friend class RegionRegistry;
  void close_locked();  // registry mutex held

  std::shared_ptr<RegionRegistry> registry_;
  uint64_t engine_instance_;
  EngineKind kind_;
  int owner_;
  void* data_;
  uint64_t size_;
  MemoryKind memory_;
  int device_;
  std::vector<DomainMr> mrs_;
  std::atomic<bool> closed_{false};
};

}  // namespace a2a::transfer
