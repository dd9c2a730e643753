// LocalEngine: the Engine for several ranks inside one process (devices of one process). Writes
// are memcpy into the target region plus a counter increment at the target; nothing is in flight
// after a call returns. Ranks of one LocalHub know each other from the start.
#pragma once

#include <memory>
#include <shared_mutex>
#include <vector>

#include "transfer/engine.h"

namespace a2a::transfer {

class LocalEngine;

class LocalHub : public std::enable_shared_from_this<LocalHub> {
 public:
  // world_size engines, rank r at index r. The hub lives as long as any of them.
  static std::vector<std::shared_ptr<LocalEngine>> create(int world_size);

  uint64_t id() const { return id_; }
  int world_size() const { return world_size_; }

 private:
  friend class LocalEngine;
  explicit LocalHub(int world_size);
  std::string name() const;  // the "provider" string: identifies this hub

  uint64_t id_;
  int world_size_;
  std::shared_mutex mu_;               // shared: a write in progress; exclusive: attach/detach
  std::vector<LocalEngine*> engines_;  // null once closed
};

class LocalEngine final : public Engine {
 public:
  LocalEngine(std::shared_ptr<LocalHub> hub, int rank);
  ~LocalEngine() override;

  EngineKind kind() const override { return EngineKind::kLocal; }
  std::string provider() const override { return hub_->name(); }
  int num_domains() const override { return 1; }

  Bytes address() const override;
  void add_peers(const std::vector<PeerAddress>& peers) override;

  std::shared_ptr<Region> register_memory(void* data, uint64_t size, MemoryKind kind,
                                          int device) override;
  std::shared_ptr<PeerGroup> peer_group(const std::vector<int>& ranks) override;
  void write(int peer, const Region& src, uint64_t src_offset, uint64_t length,
             const RemoteRegion* dst, uint64_t dst_offset, uint32_t imm) override;
  void scatter(const PeerGroup& group, const Region& src, const std::vector<ScatterEntry>& entries,
               uint32_t imm) override;
  void signal(const PeerGroup& group, uint32_t imm) override;

  void flush(double) override { check_open("flush"); }
  uint64_t pending() const override { return 0; }
  void close() override;
  bool closed() const override { return closed_.load(std::memory_order_acquire); }

 protected:
  bool await(Predicate ready, Clock::time_point deadline) override;
  uint64_t peer_instance(int rank) const override;
  int peer_domains(int rank) const override { return peer_instance(rank) ? 1 : 0; }

 private:
  // memcpy + counter at the target; hub lock held shared by the caller.
  void deliver(int peer, const Region* src, uint64_t src_offset, uint64_t length,
               const RemoteRegion* dst, uint64_t dst_offset, uint32_t imm, const char* call);

  std::shared_ptr<LocalHub> hub_;
  std::shared_ptr<RegionRegistry> registry_ = std::make_shared<RegionRegistry>();
  std::atomic<uint64_t> next_key_{1};
  std::atomic<bool> closed_{false};
};

}  // namespace a2a::transfer
