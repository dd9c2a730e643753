#include "transfer/engine.h"
#include "core/env.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

namespace a2a::transfer {
EngineOptions EngineOptions::resolved() const {
  EngineOptions o = *this;
  if (o.provider.empty()) o.provider = env::get_or("JAX_MOE_A2A_PROVIDER", "shm");
  if (o.iface.empty()) o.iface = env::get_or("JAX_MOE_A2A_IFACE", "");
  std::string hmem_env = env::get_or("JAX_MOE_A2A_HMEM", "");
  if (!hmem_env.empty()) o.hmem = o.hmem || (hmem_env != "0" && hmem_env != "false");
  o.post_timeout_s = env::get_double("JAX_MOE_A2A_POST_TIMEOUT_S", o.post_timeout_s);
  std::string cq = env::get_or("JAX_MOE_A2A_RX_CQ_SIZE", "");
  if (!cq.empty()) o.rx_cq_size = std::strtoull(cq.c_str(), nullptr, 10);
  if (o.world_size < 1 || o.world_size > int(kImmMaxRank) + 1)
    throw std::invalid_argument(format("world_size=%d: expected 1..%u", o.world_size, kImmMaxRank + 1));
  if (o.rank < 0 || o.rank >= o.world_size)
    throw std::invalid_argument(format("rank=%d: expected 0..%d", o.rank, o.world_size - 1));
  if (o.num_domains < 1 || o.num_domains > 64)
    throw std::invalid_argument(format("num_domains=%d: expected 1..64", o.num_domains));
  if (!(o.post_timeout_s > 0)) throw std::invalid_argument("post_timeout_s must be > 0");
  if (o.rx_cq_size < 64) throw std::invalid_argument("rx_cq_size must be >= 64");
  return o;
}

int rails_from_env(int fallback) {
  if (fallback < 1 || fallback > 16) throw std::invalid_argument(format("rails_from_env: fallback %d not in 1..16", fallback));
  const double r = env::get_double("JAX_MOE_A2A_RAILS", fallback);
  if (!(r >= 1 && r <= 16) || r != std::floor(r))
    throw std::invalid_argument(format("JAX_MOE_A2A_RAILS=%g: expected an integer in 1..16 (domains per rank)", r));
  return static_cast<int>(r);
}

Clock::time_point Engine::deadline_after(double timeout_s) {
  if (!(timeout_s >= 0) || std::isinf(timeout_s) || timeout_s > 1e7) timeout_s = 1e7;  // ~4 months
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(
                            std::chrono::duration<double>(timeout_s));
}

std::vector<int> Engine::peers() const {
  std::vector<int> out;
  for (int r = 0; r < world_size_; ++r)
    if (has_peer(r)) out.push_back(r);
  return out;
}

RemoteRegion Engine::remote(const Bytes& descriptor) const {
  check_open("remote");
  RemoteRegion r = RemoteRegion::parse(descriptor);
  if (r.kind != kind())
    throw TransferError(format("remote(): descriptor of a %s engine given to a %s engine",
                               r.kind == EngineKind::kLocal ? "local" : "fabric",
                               kind() == EngineKind::kLocal ? "local" : "fabric"));
  if (r.owner >= world_size_)
    throw TransferError(format("remote(): descriptor owner rank %d is outside world size %d: "
                               "refused", r.owner, world_size_));
  uint64_t known = peer_instance(r.owner);
  if (known == 0)
    throw TransferError(format("remote(): descriptor from unknown peer rank %d (never added with "
                               "add_peers): refused", r.owner));
  if (known != r.owner_instance)
    throw TransferError(format("remote(): descriptor of rank %d comes from engine instance "
                               "%016llx, but rank %d was added as instance %016llx (stale or "
                               "forged descriptor): refused",
                               r.owner, (unsigned long long)r.owner_instance, r.owner,
                               (unsigned long long)known));
  if (int(r.keys.size()) != peer_domains(r.owner))
    throw TransferError(format("remote(): descriptor of rank %d has %zu domain keys, the peer has "
                               "%d domains: refused", r.owner, r.keys.size(), peer_domains(r.owner)));
  return r;
}

void Engine::check_open(const char* call) const {
  if (closed()) throw TransferError(format("%s: the engine (rank %d) is closed", call, rank_));
}

void Engine::check_source(const Region& src, uint64_t offset, uint64_t length,
                          const char* call) const {
  if (src.engine_instance() != instance_)
    throw TransferError(format("%s: source region was registered with another engine", call));
  if (src.closed()) throw TransferError(format("%s: source region is closed", call));
  if (offset > src.size() || length > src.size() - offset)
    throw std::out_of_range(format("%s: source slice [%llu, +%llu) exceeds the region's %llu bytes",
                                   call, (unsigned long long)offset, (unsigned long long)length,
                                   (unsigned long long)src.size()));
}

void Engine::check_target(int peer, const RemoteRegion* dst, uint64_t offset, uint64_t length,
                          const char* call) const {
  if (peer < 0 || peer >= world_size_)
    throw std::out_of_range(format("%s: peer rank %d outside world size %d", call, peer, world_size_));
  uint64_t known = peer_instance(peer);
  if (known == 0) throw TransferError(format("%s: rank %d is not a peer of this engine (add_peers)", call, peer));
  if (!dst) {
    if (length != 0)
      throw std::invalid_argument(format("%s to rank %d: %llu bytes need a destination region", call,
                                         peer, (unsigned long long)length));
    return;
  }
  if (dst->owner != peer || dst->owner_instance != known)
    throw TransferError(format("%s to rank %d: the destination region belongs to rank %d%s", call,
                               peer, dst->owner,
                               dst->owner == peer ? " (another engine instance)" : ""));
  if (offset > dst->size || length > dst->size - offset)
    throw std::out_of_range(format(
        "%s to rank %d: destination slice [%llu, +%llu) exceeds the region's %llu bytes", call, peer,
        (unsigned long long)offset, (unsigned long long)length, (unsigned long long)dst->size));
}

void Engine::check_group(const PeerGroup& group, const char* call) const {
  if (group.engine_instance() != instance_)
    throw TransferError(format("%s: the peer group belongs to another engine", call));
}

std::vector<int> Engine::check_group_ranks(const std::vector<int>& ranks) const {
  check_open("peer_group");
  std::vector<int> seen;
  for (int r : ranks) {
    if (r < 0 || r >= world_size_)
      throw std::out_of_range(format("peer_group: rank %d outside world size %d", r, world_size_));
    if (!has_peer(r))
      throw TransferError(format("peer_group: rank %d is not a peer of this engine (add_peers)", r));
    if (std::find(seen.begin(), seen.end(), r) != seen.end())
      throw std::invalid_argument(format("peer_group: rank %d appears twice", r));
    seen.push_back(r);
  }
  return seen;
}

void Engine::barrier(const PeerGroup& group, uint32_t imm, double timeout_s) {
  signal(group, imm);
  auto deadline = deadline_after(timeout_s);
  uint64_t n = group.size();
  auto ready = [&] { return counters_.try_consume(imm, n); };
  if (!await(ready, deadline)) {
    uint64_t got = counters_.count(imm);
    std::string errs = error_summary();
    throw TimeoutError(format("barrier(imm=0x%08x) on rank %d: %llu of %llu peers arrived within "
                              "%.3f s%s%s",
                              imm, rank_, (unsigned long long)got, (unsigned long long)n, timeout_s,
                              errs.empty() ? "" : "; ", errs.c_str()),
                       got, n);
  }
}

void Engine::barrier_ranked(const PeerGroup& group, uint32_t tag, uint32_t epoch, double timeout_s) {
  signal(group, pack_imm(tag, epoch, static_cast<uint32_t>(rank_)));
  wait_ranks(tag, epoch, group.ranks(), timeout_s);
}

void Engine::wait(uint32_t imm, uint64_t n, double timeout_s) {
  check_open("wait");
  auto deadline = deadline_after(timeout_s);
  auto ready = [&] { return counters_.try_consume(imm, n); };
  if (!await(ready, deadline)) {
    uint64_t got = counters_.count(imm);
    ImmFields f = unpack_imm(imm);
    std::string errs = error_summary();
    throw TimeoutError(
        format("wait(imm=0x%08x [tag %u, epoch %u, rank %u]) on rank %d: %llu of %llu arrivals "
               "within %.3f s%s%s",
               imm, f.tag, f.epoch, f.rank, rank_, (unsigned long long)got, (unsigned long long)n,
               timeout_s, errs.empty() ? "" : "; ", errs.c_str()),
        got, n);
  }
}

void Engine::wait_ranks(uint32_t tag, uint32_t epoch, const std::vector<int>& ranks,
                        double timeout_s) {
  check_open("wait_ranks");
  std::vector<uint32_t> imms;
  for (int r : ranks) {
    if (r < 0) throw std::invalid_argument(format("wait_ranks: rank %d", r));
    imms.push_back(pack_imm(tag, epoch, static_cast<uint32_t>(r)));
  }
  std::vector<uint8_t> seen(imms.size(), 0);
  auto deadline = deadline_after(timeout_s);
  auto ready = [&] {
    return counters_.consume_each(imms.data(), seen.data(), imms.size()) == imms.size();
  };
  bool ok = await(ready, deadline);
  if (!ok) {
    std::vector<int> missing;
    for (size_t i = 0; i < ranks.size(); ++i)
      if (!seen[i]) missing.push_back(ranks[i]);
    // Give back what this wait consumed, so a retry still sees those arrivals.
    for (size_t i = 0; i < imms.size(); ++i)
      if (seen[i]) counters_.add(imms[i]);
    std::string errs = error_summary();
    uint64_t got = ranks.size() - missing.size();
    throw TimeoutError(format("wait_ranks(tag %u, epoch %u) on rank %d: %llu of %zu ranks arrived "
                              "within %.3f s; missing ranks: %s%s%s",
                              tag, epoch, rank_, (unsigned long long)got, ranks.size(), timeout_s,
                              join_ranks(missing).c_str(), errs.empty() ? "" : "; ", errs.c_str()),
                       got, ranks.size(), missing);
  }
}

bool Engine::poll_ranks(uint32_t tag, uint32_t epoch, const std::vector<int>& ranks,
                        std::vector<uint8_t>& seen) {
  check_open("poll_ranks");
  if (seen.size() != ranks.size()) throw std::invalid_argument("poll_ranks: seen must have one entry per rank");
  std::vector<uint32_t> imms;
  imms.reserve(ranks.size());
  for (int r : ranks) imms.push_back(pack_imm(tag, epoch, static_cast<uint32_t>(r)));
  auto ready = [&] { return counters_.consume_each(imms.data(), seen.data(), imms.size()) == imms.size(); };
  return poll_once(ready);
}

uint64_t Engine::discard_arrivals(const std::function<bool(uint32_t)>& drop) {
  check_open("discard_arrivals");
  auto never = [] { return false; };
  await(never, Clock::now());  // one progress pass: arrivals still in the queues
  return counters_.discard_if(drop);
}

bool Engine::poll_flush() {
  check_open("poll_flush");
  auto idle = [&] { return pending() == 0; };
  if (!await(idle, Clock::now())) return false;
  flush(0);
  return true;
}

}  // namespace a2a::transfer
