// Raw libfabric all-to-all (no engine: raw_endpoint.h, busy polling in the calling thread): every
// rank writes one message to every other rank at once and waits until its own writes completed
// and every peer's message landed. The wire's time for an exchange's bytes in the exchange's
// pattern (every direction at once), the baseline issue 35's measure divides by; the ping-pong
// (raw_pingpong.h) times one message in one direction. Benchmark code: not part of the library.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "bench/raw_endpoint.h"

namespace a2a::bench {

class RawExchange {
 public:
  // provider / iface as for the engine; max_size: the largest message to one peer; `world` ranks,
  // this one `rank`. The buffer holds one send block and one receive block per rank.
  RawExchange(const std::string& provider, const std::string& iface, uint64_t max_size, int world, int rank);

  Bytes blob() const { return ep_.blob(); }
  // Every rank's blob, in rank order (our own is skipped).
  void connect(const std::vector<Bytes>& blobs);
  // `iters` exchanges back to back: in each, writes sizes[d] bytes to every rank d != rank (0 is a
  // zero-length write: the peer still counts it), in the order rank + 1, rank + 2, ..., then waits
  // until they completed and one message of every peer landed. Returns the seconds of all
  // `iters`; a round starts as soon as the last one ended here, so a peer's next messages may
  // arrive while this rank still waits (counted, not lost). Every rank must pass the same iters.
  double run(const std::vector<uint64_t>& sizes, int iters, double timeout_s);

 private:
  RawEndpoint ep_;
  uint64_t max_size_;
  int world_, rank_;
  std::vector<RawPeer> peers_;
};

}  // namespace a2a::bench
