#include "transfer/local_engine.h"

#include <cstring>
#include <mutex>

#include "transfer/address.h"

namespace a2a::transfer {
namespace {
// Instance id of rank r of hub h: distinct per rank and per hub.
uint64_t rank_instance(uint64_t hub, int rank) { return hub ^ (0x9E3779B97F4A7C15ull * uint64_t(rank + 1)); }
}  // namespace

LocalHub::LocalHub(int world_size) : id_(new_instance_id()), world_size_(world_size) {
  if (world_size < 1 || world_size > int(kImmMaxRank) + 1)
    throw std::invalid_argument(format("LocalHub: world_size=%d", world_size));
  engines_.assign(world_size, nullptr);
}

std::string LocalHub::name() const { return format("local:%016llx", (unsigned long long)id_); }

std::vector<std::shared_ptr<LocalEngine>> LocalHub::create(int world_size) {
  std::shared_ptr<LocalHub> hub(new LocalHub(world_size));
  std::vector<std::shared_ptr<LocalEngine>> out;
  for (int r = 0; r < world_size; ++r) out.push_back(std::make_shared<LocalEngine>(hub, r));
  return out;
}

LocalEngine::LocalEngine(std::shared_ptr<LocalHub> hub, int rank)
    : Engine(rank, hub->world_size(), rank_instance(hub->id(), rank)), hub_(std::move(hub)) {
  std::unique_lock<std::shared_mutex> lock(hub_->mu_);
  if (hub_->engines_[rank]) throw TransferError(format("LocalHub: rank %d exists already", rank));
  hub_->engines_[rank] = this;
}

LocalEngine::~LocalEngine() { close(); }

void LocalEngine::close() {
  if (closed_.exchange(true)) return;
  {
    std::unique_lock<std::shared_mutex> lock(hub_->mu_);  // waits for writes into us to finish
    hub_->engines_[rank_] = nullptr;
  }
  registry_->close_all();
}

Bytes LocalEngine::address() const {
  EngineAddress a;
  a.kind = EngineKind::kLocal;
  a.rank = rank_;
  a.world_size = world_size_;
  a.instance = instance_;
  a.provider = provider();
  a.domains.push_back({});
  return a.serialize();
}

void LocalEngine::add_peers(const std::vector<PeerAddress>& peers) {
  check_open("add_peers");
  // Every rank of the hub is known already; check that the addresses agree with that.
  for (const PeerAddress& pa : peers) {
    EngineAddress a = EngineAddress::parse(pa.address);
    if (a.kind != EngineKind::kLocal || a.provider != provider() || a.rank != pa.rank ||
        a.instance != rank_instance(hub_->id(), pa.rank))
      throw TransferError(format("add_peers: the address given for rank %d is not rank %d of this "
                                 "in-process hub (%s)", pa.rank, pa.rank, provider().c_str()));
  }
}

uint64_t LocalEngine::peer_instance(int rank) const {
  if (rank < 0 || rank >= world_size_) return 0;
  return rank_instance(hub_->id(), rank);
}

std::shared_ptr<Region> LocalEngine::register_memory(void* data, uint64_t size, MemoryKind kind,
                                                     int device) {
  check_open("register_memory");
  if (data == nullptr || size == 0)
    throw std::invalid_argument("register_memory: empty buffer (pointer and size must be non-zero)");
  if (kind != MemoryKind::kHost)
    throw TransferError("register_memory: the in-process engine copies with memcpy; host memory only");
  DomainMr m;
  m.remote.key = next_key_.fetch_add(1);  // identifies the region: writes check it is still live
  m.remote.base = reinterpret_cast<uint64_t>(data);
  return std::make_shared<Region>(registry_, instance_, EngineKind::kLocal, rank_, data, size, kind,
                                  device, std::vector<DomainMr>{m});
}

std::shared_ptr<PeerGroup> LocalEngine::peer_group(const std::vector<int>& ranks) {
  return std::make_shared<PeerGroup>(instance_, check_group_ranks(ranks));
}

void LocalEngine::deliver(int peer, const Region* src, uint64_t src_offset, uint64_t length,
                          const RemoteRegion* dst, uint64_t dst_offset, uint32_t imm,
                          const char* call) {
  LocalEngine* target = hub_->engines_[peer];
  if (!target)
    throw TransferError(format("%s from rank %d to rank %d: the peer engine is closed", call, rank_, peer));
  if (length) {
    uint64_t addr = dst->address + dst_offset;
    bool copied = target->registry_->with_live(dst->keys[0].key, addr, length, [&] {
      std::memmove(reinterpret_cast<void*>(addr),
                   static_cast<const char*>(src->data()) + src_offset, length);
    });
    if (!copied)
      throw TransferError(format("%s from rank %d to rank %d: the destination region was "
                                 "deregistered", call, rank_, peer));
  }
  target->counters_.add(imm);
}

void LocalEngine::write(int peer, const Region& src, uint64_t src_offset, uint64_t length,
                        const RemoteRegion* dst, uint64_t dst_offset, uint32_t imm) {
  check_open("write");
  check_source(src, src_offset, length, "write");
  check_target(peer, dst, dst_offset, length, "write");
  std::shared_lock<std::shared_mutex> lock(hub_->mu_);
  deliver(peer, &src, src_offset, length, dst, dst_offset, imm, "write");
}

void LocalEngine::scatter(const PeerGroup& group, const Region& src,
                          const std::vector<ScatterEntry>& entries, uint32_t imm) {
  check_open("scatter");
  check_group(group, "scatter");
  for (const ScatterEntry& e : entries) {
    if (e.peer >= group.size())
      throw std::out_of_range(format("scatter: entry for group member %u of a group of %zu", e.peer,
                                     group.size()));
    check_source(src, e.src_offset, e.length, "scatter");
    check_target(group.ranks()[e.peer], e.dst, e.dst_offset, e.length, "scatter");
  }
  std::shared_lock<std::shared_mutex> lock(hub_->mu_);
  for (const ScatterEntry& e : entries)
    deliver(group.ranks()[e.peer], &src, e.src_offset, e.length, e.dst, e.dst_offset, imm, "scatter");
}

void LocalEngine::signal(const PeerGroup& group, uint32_t imm) {
  check_open("signal");
  check_group(group, "signal");
  std::shared_lock<std::shared_mutex> lock(hub_->mu_);
  for (int r : group.ranks()) deliver(r, nullptr, 0, 0, nullptr, 0, imm, "signal");
}

bool LocalEngine::await(Predicate ready, Clock::time_point deadline) {
  for (;;) {
    uint64_t v = counters_.version();
    if (ready()) return true;
    if (!counters_.wait_change(v, deadline)) return ready();
  }
}

}  // namespace a2a::transfer
