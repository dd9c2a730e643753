#include "bench/raw_exchange.h"

#include <chrono>
#include <stdexcept>

#include "transfer/counters.h"
#include "transfer/errors.h"

namespace a2a::bench {

using namespace a2a::transfer;

RawExchange::RawExchange(const std::string& provider, const std::string& iface, uint64_t max_size, int world,
                         int rank)
    : ep_(provider, iface, (uint64_t(world) + 1) * max_size), max_size_(max_size), world_(world), rank_(rank) {
  if (world < 1 || rank < 0 || rank >= world) throw std::invalid_argument("raw exchange: bad world / rank");
}

void RawExchange::connect(const std::vector<Bytes>& blobs) {
  if (int(blobs.size()) != world_) throw std::invalid_argument("raw exchange: one blob per rank");
  peers_.assign(world_, RawPeer{});
  for (int r = 0; r < world_; ++r)
    if (r != rank_) peers_[r] = ep_.connect(blobs[r]);
}

double RawExchange::run(const std::vector<uint64_t>& sizes, int iters, double timeout_s) {
  if (int(sizes.size()) != world_) throw std::invalid_argument("raw exchange: one size per rank");
  for (uint64_t s : sizes)
    if (s > max_size_) throw std::invalid_argument("raw exchange: size > max_size");
  if (int(peers_.size()) != world_) throw std::logic_error("raw exchange: run before connect");
  const uint64_t peers = uint64_t(world_ - 1);
  auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                     std::chrono::duration<double>(timeout_s));
  // ep_.arrivals may already hold messages of this run (a peer that finished its previous run
  // first): they count. ep_.sent starts at 0 (the previous run waited for all of its writes).
  auto t0 = Clock::now();
  for (int i = 0; i < iters; ++i) {
    for (int k = 1; k < world_; ++k) {
      int d = (rank_ + k) % world_;
      // Our send block sits past the receive blocks; each source lands in its own block at the peer.
      ep_.write(peers_[d], uint64_t(world_) * max_size_, sizes[d], uint64_t(rank_) * max_size_, uint64_t(i));
    }
    const uint64_t want = (uint64_t(i) + 1) * peers;
    while (ep_.arrivals < want || ep_.sent < want) {
      ep_.drain();
      if (Clock::now() > deadline)
        throw TimeoutError("raw exchange: a peer's message or our write's completion did not come",
                           ep_.arrivals, want);
    }
  }
  double t = std::chrono::duration<double>(Clock::now() - t0).count();
  // Take this run's messages out of the counts: what is left belongs to the next run.
  ep_.arrivals -= uint64_t(iters) * peers;
  ep_.sent -= uint64_t(iters) * peers;
  return t;
}

}  // namespace a2a::bench
