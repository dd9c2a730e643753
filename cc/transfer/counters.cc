#include "transfer/counters.h"

#include <algorithm>

namespace a2a::transfer {

void ImmCounters::added_locked(std::unique_lock<std::mutex>& lock) {
  version_.fetch_add(1, std::memory_order_acq_rel);
  bool wake = sleepers_ > 0;
  lock.unlock();
  if (wake) cv_.notify_all();
}

void ImmCounters::add(uint32_t imm, uint64_t n) {
  std::unique_lock<std::mutex> lock(mu_);
  counts_[imm] += n;
  added_locked(lock);
}

void ImmCounters::add_batch(const uint32_t* imms, size_t n) {
  if (n == 0) return;
  std::unique_lock<std::mutex> lock(mu_);
  for (size_t i = 0; i < n; ++i) ++counts_[imms[i]];
  added_locked(lock);
}

uint64_t ImmCounters::count(uint32_t imm) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = counts_.find(imm);
  return it == counts_.end() ? 0 : it->second;
}

std::vector<std::pair<uint32_t, uint64_t>> ImmCounters::snapshot() const {
  std::vector<std::pair<uint32_t, uint64_t>> out;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& kv : counts_)
      if (kv.second) out.emplace_back(kv.first, kv.second);
  }
  std::sort(out.begin(), out.end());
  return out;
}

uint64_t ImmCounters::discard_if(const std::function<bool(uint32_t)>& drop) {
  std::lock_guard<std::mutex> lock(mu_);
  uint64_t n = 0;
  for (auto it = counts_.begin(); it != counts_.end();) {
    if (drop(it->first)) {
      n += it->second;
      it = counts_.erase(it);
    } else {
      ++it;
    }
  }
  return n;
}

bool ImmCounters::try_consume(uint32_t imm, uint64_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  if (n == 0) return true;
  auto it = counts_.find(imm);
  if (it == counts_.end() || it->second < n) return false;
  it->second -= n;
  if (it->second == 0) counts_.erase(it);  // keeps the map as small as the values in flight
  return true;
}

size_t ImmCounters::consume_each(const uint32_t* imms, uint8_t* seen, size_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  size_t done = 0;
  for (size_t i = 0; i < n; ++i) {
    if (!seen[i]) {
      auto it = counts_.find(imms[i]);
      if (it != counts_.end() && it->second > 0) {
        if (--it->second == 0) counts_.erase(it);
        seen[i] = 1;
      }
    }
    done += seen[i];
  }
  return done;
}

bool ImmCounters::wait_change(uint64_t seen_version, Clock::time_point deadline) {
  std::unique_lock<std::mutex> lock(mu_);
  ++sleepers_;
  bool changed = cv_.wait_until(lock, deadline, [&] { return version() != seen_version; });
  --sleepers_;
  return changed;
}

}  // namespace a2a::transfer
