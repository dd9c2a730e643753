// TransferEngine: one-sided writes with 32-bit immediate data between ranks, counted at the
// receiver. Knows nothing about MoE: regions, peers, groups, writes, immediates.
//
//   auto e = make_engine(opts);                   // libfabric (FabricEngine) ...
//   auto es = LocalHub::create(n);                // ... or n ranks inside one process (LocalEngine)
//   e->add_peers({{r, address_bytes_of_r}, ...}); // addresses travel through the job's KV store
//   auto reg = e->register_memory(ptr, bytes);    // reg->descriptor() travels the same way
//   RemoteRegion dst = e->remote(descriptor_of_peer);
//   auto g = e->peer_group({1, 2, 3});
//   e->scatter(*g, *reg, {{0, 0, 64, &dst1, 0}, {1, 64, 0, nullptr, 0}}, imm);
//   e->wait(imm, n, 5.0);                        // n arrivals of imm, whatever the order
//
// Thread safety: every call may come from several threads at once, except close() (no other call
// may run during or after it).
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "transfer/counters.h"
#include "transfer/errors.h"
#include "transfer/imm.h"
#include "transfer/memory.h"
#include "transfer/peer_group.h"
#include "transfer/progress.h"
#include "transfer/wire.h"

namespace a2a::transfer {

struct EngineOptions {
  std::string provider;  // "" -> $JAX_MOE_A2A_PROVIDER -> "shm"
  int num_domains = 1;   // domains (NICs) per rank; peer r uses domain r % num_domains; write_on() any
  int rank = 0;
  int world_size = 1;
  std::string iface;        // "" -> $JAX_MOE_A2A_IFACE; comma-separated domain names ("lo")
  bool hmem = false;        // or $JAX_MOE_A2A_HMEM=1: ask the provider for FI_HMEM
  double post_timeout_s = 30;  // or $JAX_MOE_A2A_POST_TIMEOUT_S: -FI_EAGAIN retries give up after
  size_t rx_cq_size = 16384;   // or $JAX_MOE_A2A_RX_CQ_SIZE
  ProgressOptions progress = ProgressOptions::from_env();

  // Fills the empty fields from the environment and checks ranges.
  EngineOptions resolved() const;
};

// The rails (domains) a communicator's engine opens: $JAX_MOE_A2A_RAILS, 1..16; unset, `fallback`
// (the caller's default: 1 for the host backend, the cuda backend's by its row path). The inter-node
// protocol stripes each large write over them (protocol/exchange.cc).
int rails_from_env(int fallback = 1);

struct PeerAddress {
  int rank;
  Bytes address;
};

// One slice of a scatter: `length` bytes from `src_offset` of the source region to `dst_offset` of
// `dst` at group member `peer`. length == 0 sends only the immediate (dst may be null).
struct ScatterEntry {
  uint32_t peer;
  uint64_t src_offset;
  uint64_t length;
  const RemoteRegion* dst;
  uint64_t dst_offset;
};

class Engine {
 public:
  virtual ~Engine() = default;

  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  uint64_t instance() const { return instance_; }  // random id of this engine incarnation
  virtual EngineKind kind() const = 0;
  virtual std::string provider() const = 0;
  virtual int num_domains() const = 0;

  // --- addressing -------------------------------------------------------------------------------
  virtual Bytes address() const = 0;  // serialised EngineAddress
  // Adds peers (our own rank is always known). Re-adding the same address is a no-op; a
  // different address for a known rank, another provider or world size is refused.
  virtual void add_peers(const std::vector<PeerAddress>& peers) = 0;
  std::vector<int> peers() const;  // known ranks, ascending
  bool has_peer(int rank) const { return peer_instance(rank) != 0; }

  // --- memory -----------------------------------------------------------------------------------
  virtual std::shared_ptr<Region> register_memory(void* data, uint64_t size,
                                                  MemoryKind kind = MemoryKind::kHost,
                                                  int device = 0) = 0;
  // Parses and validates a peer's descriptor: refused unless its owner is a known peer of this
  // engine with the same engine instance (unknown, stale and forged descriptors raise).
  RemoteRegion remote(const Bytes& descriptor) const;

  // --- groups and writes ------------------------------------------------------------------------
  virtual std::shared_ptr<PeerGroup> peer_group(const std::vector<int>& ranks) = 0;
  // One write to `peer` (a rank). dst may be null when length == 0.
  virtual void write(int peer, const Region& src, uint64_t src_offset, uint64_t length,
                     const RemoteRegion* dst, uint64_t dst_offset, uint32_t imm) = 0;
  // The same on rail `rail` (>= 0): our domain rail % num_domains() to the peer's domain rail % its
  // number of domains. A rank's rails are its domains: several NICs, or several shm endpoints whose
  // copies run in parallel (each domain has its own progress thread). An engine of one domain has
  // one rail: write().
  virtual void write_on(int rail, int peer, const Region& src, uint64_t src_offset, uint64_t length,
                        const RemoteRegion* dst, uint64_t dst_offset, uint32_t imm) {
    (void)rail;
    write(peer, src, src_offset, length, dst, dst_offset, imm);
  }
  // Every entry is validated before anything is posted; then one write per entry.
  virtual void scatter(const PeerGroup& group, const Region& src,
                       const std::vector<ScatterEntry>& entries, uint32_t imm) = 0;
  // A zero-byte write carrying imm to every member of the group.
  virtual void signal(const PeerGroup& group, uint32_t imm) = 0;
  // The same on rail `rail` (write_on's pairing) to every member but ourselves.
  virtual void signal_on(int rail, const PeerGroup& group, uint32_t imm) {
    (void)rail;
    signal(group, imm);
  }
  // signal(group, imm), then wait(imm, group.size()). Consecutive barriers on one group must
  // alternate between two imm values at least (e.g. epoch parity), else a fast peer's next
  // arrival could count for this one.
  void barrier(const PeerGroup& group, uint32_t imm, double timeout_s);
  // Same with imm = pack_imm(tag, epoch, our rank); a timeout names the missing ranks.
  void barrier_ranked(const PeerGroup& group, uint32_t tag, uint32_t epoch, double timeout_s);

  // --- immediate counters -----------------------------------------------------------------------
  // Blocks until n arrivals of imm were seen, then consumes them. TimeoutError after timeout_s
  // says how many of how many arrived.
  void wait(uint32_t imm, uint64_t n, double timeout_s);
  // One arrival of pack_imm(tag, epoch, r) for every r in ranks; TimeoutError names the missing.
  void wait_ranks(uint32_t tag, uint32_t epoch, const std::vector<int>& ranks, double timeout_s);
  // Non-blocking wait_ranks for loops that must never block (the cuda backend's proxy thread):
  // polls the transport once, then consumes one arrival of pack_imm(tag, epoch, ranks[i]) for
  // every i with !seen[i] that has one and sets seen[i]. True when every rank is seen. `seen`
  // (ranks.size() entries) is the caller's between polls.
  bool poll_ranks(uint32_t tag, uint32_t epoch, const std::vector<int>& ranks, std::vector<uint8_t>& seen);
  // Non-blocking flush: polls the transport once; true when no write is in flight (then the
  // completion errors seen since the last flush raise as in flush()).
  bool poll_flush();
  uint64_t count(uint32_t imm) const { return counters_.count(imm); }
  // Polls the transport once, then drops every unconsumed arrival whose immediate `drop` accepts;
  // returns how many were dropped (the host backend's recovery after a peer failure).
  uint64_t discard_arrivals(const std::function<bool(uint32_t)>& drop);
  std::vector<std::pair<uint32_t, uint64_t>> counts() const { return counters_.snapshot(); }

  // --- completion and shutdown ------------------------------------------------------------------
  // Waits until every posted write completed locally (source buffers reusable); raises the
  // completion errors seen since the last flush, TimeoutError if writes are still in flight.
  virtual void flush(double timeout_s) = 0;
  virtual uint64_t pending() const = 0;  // writes posted and not completed
  // Time spent inside this engine's posts (write, write_on, signals), summed over its callers, and
  // the part of it spent retrying on a full transmit queue (-FI_EAGAIN, progressing the transport
  // meanwhile: over shm, the provider's copies of incoming messages), ns. 0 where never counted.
  virtual uint64_t post_ns() const { return 0; }
  virtual uint64_t post_blocked_ns() const { return 0; }
  // Completions handled by the engine's progress threads (not by its waiters or pollers), and
  // their polls made while held (hold_progress). 0 where there is no progress thread.
  virtual uint64_t progress_thread_events() const { return 0; }
  virtual uint64_t progress_held_polls() const { return 0; }
  // Non-blocking polls (poll_ranks) that moved the transport themselves (POLL_PROGRESS=1); 0 where
  // never counted.
  virtual uint64_t progressing_polls() const { return 0; }
  virtual void close() = 0;              // idempotent
  virtual bool closed() const = 0;

  // --- progress hold ----------------------------------------------------------------------------
  // Held (by the proxy thread while a transfer is under way), the engine's progress thread keeps
  // polling, yielding the core between polls, instead of backing off into sleeps: arrivals then
  // move as they come, not after a sleep of up to PROGRESS_MAX_SLEEP_US. One holder per engine.
  void hold_progress(bool on) {
    if (progress_held_.load(std::memory_order_relaxed) == on) return;
    progress_held_.store(on, std::memory_order_relaxed);
    if (on) progress_hold_began();
  }
  bool progress_held() const { return progress_held_.load(std::memory_order_relaxed); }

 protected:
  Engine(int rank, int world_size, uint64_t instance)
      : rank_(rank), world_size_(world_size), instance_(instance) {}

  // Blocks until ready() returns true (true) or the deadline passes (false).
  virtual bool await(Predicate ready, Clock::time_point deadline) = 0;
  // poll_ranks' one look: moves the transport once, then asks ready() (an engine may leave the
  // transport to its progress thread: ProgressOptions::poll_progress).
  virtual bool poll_once(Predicate ready) { return await(ready, Clock::now()); }
  // Instance id of a known peer, 0 if unknown; num_domains of that peer.
  virtual uint64_t peer_instance(int rank) const = 0;
  virtual int peer_domains(int rank) const = 0;
  // Text of errors not reported yet (appended to timeout messages); "" if none.
  virtual std::string error_summary() const { return {}; }
  // hold_progress(true) after false: wake a sleeping progress thread.
  virtual void progress_hold_began() {}

  // Shared validation (throws TransferError / std::invalid_argument naming `call` and the peer).
  void check_open(const char* call) const;
  void check_source(const Region& src, uint64_t offset, uint64_t length, const char* call) const;
  void check_target(int peer, const RemoteRegion* dst, uint64_t offset, uint64_t length,
                    const char* call) const;
  void check_group(const PeerGroup& group, const char* call) const;
  std::vector<int> check_group_ranks(const std::vector<int>& ranks) const;

  static Clock::time_point deadline_after(double timeout_s);

  int rank_;
  int world_size_;
  uint64_t instance_;
  ImmCounters counters_;
  std::atomic<bool> progress_held_{false};
};

// The libfabric engine for opts (provider, domains, rank...).
std::unique_ptr<Engine> make_fabric_engine(const EngineOptions& opts);

}  // namespace a2a::transfer
