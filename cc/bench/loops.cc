#include "bench/loops.h"

#include <chrono>

namespace a2a::bench {

using transfer::Clock;
using transfer::ScatterEntry;

namespace {
double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}
}  // namespace

double pingpong(Engine& e, int peer, const Region& src, const RemoteRegion& dst, uint64_t size,
                int iters, int warmup, bool initiator, uint32_t imm, double timeout_s) {
  Clock::time_point t0 = Clock::now();
  for (int i = 0; i < warmup + iters; ++i) {
    if (i == warmup) t0 = Clock::now();
    if (initiator) {
      e.write(peer, src, 0, size, &dst, 0, imm);
      e.wait(imm, 1, timeout_s);
    } else {
      e.wait(imm, 1, timeout_s);
      e.write(peer, src, 0, size, &dst, 0, imm);
    }
  }
  double t = seconds_since(t0);
  e.flush(timeout_s);
  return t;
}

double stream(Engine& e, int peer, const Region& src, const RemoteRegion& dst, uint64_t size,
              int count, bool sender, uint32_t imm, uint32_t ack_imm, double timeout_s) {
  if (sender) {
    Clock::time_point t0 = Clock::now();
    for (int i = 0; i < count; ++i) e.write(peer, src, 0, size, &dst, 0, imm);
    e.wait(ack_imm, 1, timeout_s);
    double t = seconds_since(t0);
    e.flush(timeout_s);
    return t;
  }
  e.wait(imm, static_cast<uint64_t>(count), timeout_s);
  e.write(peer, src, 0, 0, nullptr, 0, ack_imm);
  e.flush(timeout_s);
  return 0;
}

double scatter_loop(Engine& e, const PeerGroup& g, const Region& src,
                    const std::vector<const RemoteRegion*>& dsts, uint64_t size, int my_slot,
                    int iters, int warmup, uint32_t imm, double timeout_s) {
  std::vector<ScatterEntry> entries;
  for (uint32_t i = 0; i < g.size(); ++i)
    entries.push_back({i, i * size, size, dsts[i], uint64_t(my_slot) * size});
  Clock::time_point t0 = Clock::now();
  for (int i = 0; i < warmup + iters; ++i) {
    if (i == warmup) t0 = Clock::now();
    uint32_t v = imm ^ uint32_t(i & 1);
    e.scatter(g, src, entries, v);
    e.wait(v, g.size(), timeout_s);
  }
  double t = seconds_since(t0);
  e.flush(timeout_s);
  return t;
}

double barrier_loop(Engine& e, const PeerGroup& g, int iters, int warmup, uint32_t imm,
                    double timeout_s) {
  Clock::time_point t0 = Clock::now();
  for (int i = 0; i < warmup + iters; ++i) {
    if (i == warmup) t0 = Clock::now();
    e.barrier(g, imm ^ uint32_t(i & 1), timeout_s);
  }
  double t = seconds_since(t0);
  e.flush(timeout_s);
  return t;
}

}  // namespace a2a::bench
