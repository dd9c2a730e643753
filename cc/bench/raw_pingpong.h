// Raw libfabric ping-pong (no engine: raw_endpoint.h, busy polling in the calling thread), the
// baseline the engine's small-write latency is compared with. It lives in the same processes as
// the engine so that the benchmark can interleave raw and engine blocks: on a small shared VM the
// placement of the two processes changes the half round trip by 3x over seconds, and only
// side-by-side blocks compare fairly. Same logic as cc/transfer/tools/fi_writedata_pingpong.c.
// Benchmark code: not part of the library.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "bench/raw_endpoint.h"

namespace a2a::bench {

class RawPingPong {
 public:
  // provider / iface as for the engine; max_size: largest message.
  RawPingPong(const std::string& provider, const std::string& iface, uint64_t max_size);

  Bytes blob() const { return ep_.blob(); }     // address + buffer key/base for the peer
  void connect(const Bytes& peer) { peer_ = ep_.connect(peer); }  // the peer's blob
  // `iters` round trips of `size` bytes; returns seconds (half round trip = s / iters / 2).
  double run(uint64_t size, int iters, bool initiator, double timeout_s);

 private:
  RawEndpoint ep_;
  uint64_t max_size_;
  RawPeer peer_;
};

}  // namespace a2a::bench
