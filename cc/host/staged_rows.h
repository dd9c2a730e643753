// JAX_MOE_A2A_HOST_STAGED=1 (tests, proxied mode): the host backend packs and unpacks rows in
// buffers of its own, apart from the registered ones, and the proxy stages them with this
// proxy::RowStaging, the way the cuda backend's copy engines do under JAX_MOE_A2A_STAGING=copy
// (cuda/row_copies.h). A copy is made on the first poll of its ticket (or a later one's), which
// still reports it pending; a later poll reports it done, and no sooner than `pause_s` after its
// start or the previous copy's end (JAX_MOE_A2A_HOST_COPY_PAUSE_S: a slow copy engine, one per
// buffer, so the pieces of a write go out apart).
// So every staged step of the proxy takes its waiting branch at least once, and a range the proxy
// forgot to copy leaves stale or zero rows that the oracle catches. A buffer's copies are made in
// the order started.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <deque>
#include <vector>

#include "proxy/staging.h"

namespace a2a::host {

class StagedRows final : public proxy::RowStaging {
 public:
  using Slot = proxy::StagedSlot;  // `packer`: the host backend's own buffers
  StagedRows(std::vector<Slot> slots, double pause_s);

  uint64_t start(int z, proxy::RowBuffer b, const std::vector<protocol::ByteRange>& ranges) override;
  bool done(int z, proxy::RowBuffer b, uint64_t ticket) override;

 private:
  struct Pending {
    uint64_t ticket;
    std::vector<protocol::ByteRange> ranges;
    bool made = false;
    std::chrono::steady_clock::time_point ready;  // pause_s after its start or the previous copy's ready
  };
  struct Buffer {
    uint64_t last = 0;            // the last ticket given
    std::chrono::steady_clock::time_point busy_until{};  // the last copy's `ready`
    std::deque<Pending> copies;   // started and not yet reported done, in order
  };
  void make(int z, proxy::RowBuffer b, const Pending& p) const;
  std::vector<Slot> slots_;
  std::chrono::steady_clock::duration pause_;
  std::vector<std::array<Buffer, proxy::kRowBuffers>> pending_;  // [slot][buffer]
};

}  // namespace a2a::host
