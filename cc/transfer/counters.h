// Immediate counters: arrivals counted per 32-bit immediate value, consumed by waits.
// Arrival order is irrelevant (EFA's SRD reorders); only counts matter.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace a2a::transfer {

using Clock = std::chrono::steady_clock;

class ImmCounters {
 public:
  void add(uint32_t imm, uint64_t n = 1);
  void add_batch(const uint32_t* imms, size_t n);

  // Arrivals of `imm` not consumed yet.
  uint64_t count(uint32_t imm) const;
  // Every value with unconsumed arrivals: {imm: count}, sorted by imm.
  std::vector<std::pair<uint32_t, uint64_t>> snapshot() const;

  // Consumes n arrivals of imm if that many are there; otherwise leaves the count alone.
  bool try_consume(uint32_t imm, uint64_t n);
  // For each i with !seen[i]: consumes one arrival of imms[i] if there is one and sets seen[i].
  // Returns how many of the n are seen after the call.
  size_t consume_each(const uint32_t* imms, uint8_t* seen, size_t n);
  // Drops every unconsumed arrival whose value `drop` accepts; returns how many (recovery after a
  // failure: stale signals of a step that never finished must not count for a later epoch).
  uint64_t discard_if(const std::function<bool(uint32_t)>& drop);

  // Changes each time arrivals are added (for blocking waits without polling).
  uint64_t version() const { return version_.load(std::memory_order_acquire); }
  // Blocks until version() != seen_version or the deadline passes; false on timeout.
  bool wait_change(uint64_t seen_version, Clock::time_point deadline);

 private:
  void added_locked(std::unique_lock<std::mutex>& lock);

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::unordered_map<uint32_t, uint64_t> counts_;
  std::atomic<uint64_t> version_{0};
  int sleepers_ = 0;
};

}  // namespace a2a::transfer
