// FabricEngine: the Engine over libfabric RDM endpoints (RMA writes with remote CQ data).
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "transfer/address.h"
#include "transfer/engine.h"
#include "transfer/fabric.h"

namespace a2a::transfer {

class FabricEngine final : public Engine, private CompletionSink {
 public:
  explicit FabricEngine(const EngineOptions& opts);  // opts are resolved() here
  ~FabricEngine() override;

  EngineKind kind() const override { return EngineKind::kFabric; }
  std::string provider() const override { return provider_; }
  int num_domains() const override { return static_cast<int>(domains_.size()); }
  const Domain& domain(int d) const { return *domains_[d]; }

  Bytes address() const override { return address_; }
  void add_peers(const std::vector<PeerAddress>& peers) override;

  std::shared_ptr<Region> register_memory(void* data, uint64_t size, MemoryKind kind,
                                          int device) override;
  std::shared_ptr<PeerGroup> peer_group(const std::vector<int>& ranks) override;
  void write(int peer, const Region& src, uint64_t src_offset, uint64_t length,
             const RemoteRegion* dst, uint64_t dst_offset, uint32_t imm) override;
  void write_on(int rail, int peer, const Region& src, uint64_t src_offset, uint64_t length,
                const RemoteRegion* dst, uint64_t dst_offset, uint32_t imm) override;
  void scatter(const PeerGroup& group, const Region& src, const std::vector<ScatterEntry>& entries,
               uint32_t imm) override;
  void signal(const PeerGroup& group, uint32_t imm) override;
  void signal_on(int rail, const PeerGroup& group, uint32_t imm) override;

  void flush(double timeout_s) override;
  uint64_t pending() const override { return outstanding_.load(std::memory_order_acquire); }
  uint64_t post_ns() const override { return post_ns_.load(std::memory_order_relaxed); }
  uint64_t post_blocked_ns() const override { return post_blocked_ns_.load(std::memory_order_relaxed); }
  uint64_t progress_thread_events() const override {
    uint64_t n = 0;
    for (const auto& t : progress_threads_) n += t->events();
    return n;
  }
  uint64_t progressing_polls() const override { return progressing_polls_.load(std::memory_order_relaxed); }
  uint64_t progress_held_polls() const override {
    uint64_t n = 0;
    for (const auto& t : progress_threads_) n += t->held_polls();
    return n;
  }
  void close() override;
  bool closed() const override { return closed_.load(std::memory_order_acquire); }

  // Polls every domain's CQs once; returns the completions handled.
  int progress();

 protected:
  bool await(Predicate ready, Clock::time_point deadline) override;
  bool poll_once(Predicate ready) override {
    if (!opts_.progress.poll_progress) return ready();
    progressing_polls_.fetch_add(1, std::memory_order_relaxed);
    return await(ready, Clock::now());
  }
  uint64_t peer_instance(int rank) const override;
  int peer_domains(int rank) const override;
  std::string error_summary() const override;
  void progress_hold_began() override {  // PROGRESS=backoff never holds: its sleeps stay as they were
    if (opts_.progress.hold)
      for (auto& t : progress_threads_) t->nudge();
  }

 private:
  FabricEngine(EngineOptions resolved, int);  // opts already resolved

  struct Peer {
    std::atomic<bool> known{false};
    uint64_t instance = 0;
    int num_domains = 0;
    Bytes address;
    WriteTemplate tpl;                // write(): our domain rank % num_domains()
    std::vector<WriteTemplate> rails;  // write_on(): one per our domain d (its domain d % num_domains)
  };

  // CompletionSink (called by Domain::poll).
  void on_arrivals(const uint32_t* imms, size_t n) override;
  void on_sent(size_t n) override;
  void on_send_error(void* context, const std::string& text, bool completed) override;
  void on_recv_error(const std::string& text) override;
  void on_unexpected(uint64_t flags) override;

  WriteTemplate make_template(int rank, const EngineAddress& peer, int local_domain, int remote_domain) const;
  // write_on's template to a known peer: its rail (rail % num_domains()), or its own with one domain.
  static const WriteTemplate& rail_template(const Peer& p, int rail) {
    return p.rails.empty() ? p.tpl : p.rails[rail % p.rails.size()];
  }
  // Posts one write (retrying -FI_EAGAIN while progressing, up to post_timeout_s). src == nullptr
  // sends a zero-byte write to the peer's signal region. Self writes are memcpy + counter.
  void post(const WriteTemplate& t, const Region* src, uint64_t src_offset, uint64_t length,
            const RemoteRegion* dst, uint64_t dst_offset, uint32_t imm, const char* call);
  void record_error(std::string text);

  EngineOptions opts_;
  std::string provider_;
  std::vector<std::unique_ptr<Domain>> domains_;
  Bytes address_;
  std::vector<std::unique_ptr<Peer>> peers_;  // by rank; slots never move
  // Completion contexts: &contexts_[r] marks a write to rank r (Domain tells ours by the range).
  std::unique_ptr<uint8_t[]> contexts_;
  std::mutex peers_mu_;                       // serialises add_peers
  std::shared_ptr<RegionRegistry> registry_ = std::make_shared<RegionRegistry>();

  std::atomic<uint64_t> outstanding_{0};
  std::atomic<uint64_t> post_ns_{0}, post_blocked_ns_{0};  // post_ns(), post_blocked_ns()
  std::atomic<uint64_t> progressing_polls_{0};              // progressing_polls()
  std::atomic<uint64_t> waiters_{0};  // WaiterScope
  std::atomic<bool> closed_{false};
  std::mutex close_mu_;

  mutable std::mutex errors_mu_;
  std::vector<std::string> errors_;  // first few since the last flush
  uint64_t error_count_ = 0;
  std::atomic<bool> has_errors_{false};

  // One progress thread per domain (a domain's copies, e.g. shm's, then run beside the others'); last
  // member: stops first.
  std::vector<std::unique_ptr<ProgressThread>> progress_threads_;
};

}  // namespace a2a::transfer
