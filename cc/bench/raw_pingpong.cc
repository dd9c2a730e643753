#include "bench/raw_pingpong.h"

#include <chrono>
#include <stdexcept>

#include "transfer/counters.h"
#include "transfer/errors.h"

namespace a2a::bench {

using namespace a2a::transfer;

RawPingPong::RawPingPong(const std::string& provider, const std::string& iface, uint64_t max_size)
    : ep_(provider, iface, 2 * max_size), max_size_(max_size) {}

double RawPingPong::run(uint64_t size, int iters, bool initiator, double timeout_s) {
  if (size > max_size_) throw std::invalid_argument("raw ping-pong: size > max_size");
  auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                     std::chrono::duration<double>(timeout_s));
  auto wait_one = [&] {
    while (ep_.arrivals == 0) {
      ep_.drain();
      if (ep_.arrivals == 0 && Clock::now() > deadline)
        throw TimeoutError("raw ping-pong: the peer did not answer", 0, 1);
    }
    --ep_.arrivals;
  };
  auto t0 = Clock::now();
  for (int i = 0; i < iters; ++i) {
    if (!initiator) wait_one();
    ep_.write(peer_, 0, size, max_size_, uint64_t(i));
    if (initiator) wait_one();
  }
  double t = std::chrono::duration<double>(Clock::now() - t0).count();
  for (int k = 0; k < 100; ++k) ep_.drain();  // collect the last write completions
  return t;
}

}  // namespace a2a::bench
