#include "host/staged_rows.h"

#include <cstring>

namespace a2a::host {

StagedRows::StagedRows(std::vector<Slot> slots, double pause_s)
    : slots_(std::move(slots)),
      pause_(std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(pause_s))),
      pending_(slots_.size()) {}

void StagedRows::start(int z, proxy::RowBuffer b, const std::vector<protocol::ByteRange>& ranges) {
  proxy::check_ranges(slots_.at(z), b, ranges, "host backend");
  pending_.at(z)[static_cast<int>(b)] = {ranges, 0, std::chrono::steady_clock::now() + pause_};
}

bool StagedRows::done(int z, proxy::RowBuffer b) {
  const int i = static_cast<int>(b);
  Pending& p = pending_.at(z)[i];
  if (p.polls++ > 0) return std::chrono::steady_clock::now() >= p.ready;
  const Slot& s = slots_[z];
  for (const protocol::ByteRange& r : p.ranges) {
    if (proxy::to_registered(b)) std::memcpy(s.registered[i] + r.off, s.packer[i] + r.off, r.len);
    else std::memcpy(s.packer[i] + r.off, s.registered[i] + r.off, r.len);
  }
  return false;
}

}  // namespace a2a::host
