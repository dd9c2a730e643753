// Row staging: for a packer whose rows live in memory the engine does not read or write itself (GPU
// memory without GPUDirect RDMA), the proxy moves each step's rows between the packer's buffers and
// the registered host buffers of protocol::SlotBuffers with copies it starts and polls, never
// blocking: send rows after the packer's flag and before the writes go out, landed rows after they
// arrived and before the flag that tells the packer. The cuda backend's implementation copies with
// the GPU's copy engines (cuda/row_copies.h: JAX_MOE_A2A_STAGING=copy); the host backend has one
// that copies with memcpy, to test the proxy's staged steps on CPUs (host/staged_rows.h).
#pragma once

#include <array>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "protocol/exchange.h"

namespace a2a::proxy {

// The four row buffers of a slot. Send buffers copy packer -> registered, receive buffers
// registered -> packer.
enum class RowBuffer : int { kDSend = 0, kDRecv = 1, kCSend = 2, kCRecv = 3 };
constexpr int kRowBuffers = 4;
inline bool to_registered(RowBuffer b) { return b == RowBuffer::kDSend || b == RowBuffer::kCSend; }
inline const char* row_buffer_name(RowBuffer b) {
  static const char* names[kRowBuffers] = {"dispatch send", "dispatch recv", "combine send", "combine recv"};
  return names[static_cast<int>(b)];
}

// One slot's pair of every row buffer, in RowBuffer order: the packer's copy and the registered one
// (protocol::SlotBuffers), `bytes` each.
struct StagedSlot {
  std::array<uint8_t*, kRowBuffers> packer, registered;
  std::array<int64_t, kRowBuffers> bytes;
};
// The registered side and the sizes of a slot's buffers; `packer` starts as the registered
// buffers (a packer that writes them itself), the caller points it at its own.
inline StagedSlot staged_slot(const protocol::SlotBuffers& b, const protocol::SlotLayout& lay) {
  StagedSlot s{};
  s.registered = {b.d_send, b.d_recv, b.c_send, b.c_recv};
  s.bytes = {lay.d_send_bytes, lay.d_recv_bytes, lay.c_send_bytes, lay.c_recv_bytes};
  s.packer = s.registered;
  return s;
}
// Throws std::logic_error (`who` first) when a range leaves buffer b of s.
inline void check_ranges(const StagedSlot& s, RowBuffer b, const std::vector<protocol::ByteRange>& ranges,
                         const char* who) {
  const int64_t size = s.bytes[static_cast<int>(b)];
  for (const protocol::ByteRange& r : ranges)
    if (r.off < 0 || r.len < 0 || r.off + r.len > size)
      throw std::logic_error(std::string(who) + ": row copy of bytes [" + std::to_string(r.off) + ", +" +
                             std::to_string(r.len) + ") outside the " + row_buffer_name(b) + " buffer's " +
                             std::to_string(size) + " bytes");
}

// Copies of one buffer of a slot that may be in flight at once (RowStaging::start's tickets): a
// write's pieces are copied back to back while the proxy posts each one as its copy is done.
constexpr int kCopyDepth = 16;

class RowStaging {
 public:
  virtual ~RowStaging() = default;
  // Called once on the proxy's thread when it starts, before any step; the proxy's constructor
  // returns only after it (and rethrows what it throws). Whatever the first copy would set up
  // lazily happens here, while no kernel of ours spins: a CUDA call that loads code or
  // initialises state waits for the context's running kernels, and a receive kernel spins until
  // the very copy that waits for it (the cuda path's stall of 2026-12-03).
  virtual void prepare() {}
  // Starts copying `ranges` (byte offsets, identical in both copies) of slot z's buffer b in its
  // direction, after every copy of (z, b) started before it (one buffer's copies complete in the
  // order started), with at most kCopyDepth of them in flight (the proxy saw every older one done).
  // Returns the copy's ticket: 1, 2, 3, ... per (z, b). Called only on the proxy's thread. Throws on
  // failure (the proxy records it as the step's error).
  virtual uint64_t start(int z, RowBuffer b, const std::vector<protocol::ByteRange>& ranges) = 0;
  // Non-blocking: true once copy `ticket` of (z, b), and so every one started before it, is complete
  // and visible to its reader (the engine, or the packer after the flag the proxy raises next). Not
  // asked again for a ticket once it answered true. Throws on failure.
  virtual bool done(int z, RowBuffer b, uint64_t ticket) = 0;
};

}  // namespace a2a::proxy
