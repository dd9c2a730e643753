#include "host/staged_rows.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>

namespace a2a::host {

StagedRows::StagedRows(std::vector<Slot> slots, double pause_s)
    : slots_(std::move(slots)),
      pause_(std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(pause_s))),
      pending_(slots_.size()) {}

uint64_t StagedRows::start(int z, proxy::RowBuffer b, const std::vector<protocol::ByteRange>& ranges) {
  proxy::check_ranges(slots_.at(z), b, ranges, "host backend");
  Buffer& q = pending_.at(z)[static_cast<int>(b)];
  if (q.copies.size() >= size_t(proxy::kCopyDepth))
    throw std::logic_error("host backend: more than kCopyDepth row copies of one buffer in flight");
  // one engine per buffer: a copy runs after the one before it
  const auto now = std::chrono::steady_clock::now();
  q.busy_until = std::max(q.busy_until, now) + pause_;
  q.copies.push_back({++q.last, ranges, false, q.busy_until});
  return q.last;
}

void StagedRows::make(int z, proxy::RowBuffer b, const Pending& p) const {
  const int i = static_cast<int>(b);
  const Slot& s = slots_[z];
  for (const protocol::ByteRange& r : p.ranges) {
    if (proxy::to_registered(b)) std::memcpy(s.registered[i] + r.off, s.packer[i] + r.off, r.len);
    else std::memcpy(s.packer[i] + r.off, s.registered[i] + r.off, r.len);
  }
}

bool StagedRows::done(int z, proxy::RowBuffer b, uint64_t ticket) {
  Buffer& q = pending_.at(z)[static_cast<int>(b)];
  if (ticket == 0 || ticket > q.last) throw std::logic_error("host backend: row copy ticket never given");
  bool made_now = false;
  for (Pending& p : q.copies) {
    if (p.ticket > ticket) break;
    if (!p.made) {
      make(z, b, p);
      p.made = made_now = true;
    }
  }
  if (made_now) return false;  // made on this poll: reported pending once
  while (!q.copies.empty() && q.copies.front().ticket < ticket) q.copies.pop_front();
  if (!q.copies.empty() && q.copies.front().ticket == ticket) {
    if (std::chrono::steady_clock::now() < q.copies.front().ready) return false;
    q.copies.pop_front();
  }
  return true;
}

}  // namespace a2a::host
