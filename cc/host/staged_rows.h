// JAX_MOE_A2A_HOST_STAGED=1 (tests, proxied mode): the host backend packs and unpacks rows in
// buffers of its own, apart from the registered ones, and the proxy stages them with this
// proxy::RowStaging, the way the cuda backend's copy engines do under JAX_MOE_A2A_STAGING=copy
// (cuda/row_copies.h). The copies are made on the first poll after their start, which still
// reports them pending; the second poll reports them done, and no sooner than `pause_s` after their
// start (JAX_MOE_A2A_HOST_COPY_PAUSE_S: a slow copy engine, so pieces of a write go out apart). So
// every staged step of the proxy takes its waiting branch at least once, and a range the proxy
// forgot to copy leaves stale or zero rows that the oracle catches.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <vector>

#include "proxy/staging.h"

namespace a2a::host {

class StagedRows final : public proxy::RowStaging {
 public:
  using Slot = proxy::StagedSlot;  // `packer`: the host backend's own buffers
  StagedRows(std::vector<Slot> slots, double pause_s);

  void start(int z, proxy::RowBuffer b, const std::vector<protocol::ByteRange>& ranges) override;
  bool done(int z, proxy::RowBuffer b) override;

 private:
  struct Pending {
    std::vector<protocol::ByteRange> ranges;
    int polls = 0;
    std::chrono::steady_clock::time_point ready;  // start + pause_s
  };
  std::vector<Slot> slots_;
  std::chrono::steady_clock::duration pause_;
  std::vector<std::array<Pending, proxy::kRowBuffers>> pending_;  // [slot][buffer]
};

}  // namespace a2a::host
