#include "host/staged_rows.h"

#include <cstring>
#include <stdexcept>
#include <string>

namespace a2a::host {

StagedRows::StagedRows(std::vector<Slot> slots) : slots_(std::move(slots)), pending_(slots_.size()) {}

void StagedRows::start(int z, proxy::RowBuffer b, const std::vector<protocol::ByteRange>& ranges) {
  const int i = static_cast<int>(b);
  for (const protocol::ByteRange& r : ranges)
    if (r.off < 0 || r.len < 0 || r.off + r.len > slots_.at(z).bytes[i])
      throw std::logic_error("host backend: staged copy of bytes [" + std::to_string(r.off) + ", +" +
                             std::to_string(r.len) + ") outside buffer " + std::to_string(i) + " (" +
                             std::to_string(slots_.at(z).bytes[i]) + " bytes)");
  pending_.at(z)[i] = {ranges, 0};
}

bool StagedRows::done(int z, proxy::RowBuffer b) {
  const int i = static_cast<int>(b);
  Pending& p = pending_.at(z)[i];
  if (p.polls++ > 0) return true;
  const Slot& s = slots_[z];
  for (const protocol::ByteRange& r : p.ranges) {
    if (proxy::to_registered(b)) std::memcpy(s.registered[i] + r.off, s.packer[i] + r.off, r.len);
    else std::memcpy(s.packer[i] + r.off, s.registered[i] + r.off, r.len);
  }
  return false;
}

}  // namespace a2a::host
