// Polling policy: how a waiting thread and the engine's progress thread spend idle time.
//
// Waiters poll the completion queues themselves (lowest latency: the thread that needs an arrival
// sees it first), so the progress thread steps aside while anyone waits and otherwise backs off from
// spinning to short sleeps. Nothing spins forever: every loop has a deadline or a stop flag.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>

#include "transfer/counters.h"

namespace a2a::transfer {

struct ProgressOptions {
  // Progress thread: keep polling (yielding the core between polls) this long after the last
  // event before sleeping.
  double spin_us = 50;
  // Progress thread: longest sleep between polls when idle (sleeps grow from 2 us to this).
  double max_sleep_us = 500;
  // Progress thread polls without ever sleeping or stepping aside for waiters (dedicated core).
  bool spin = false;
  // Progress thread polls while the engine's progress is held (a transfer under way:
  // Engine::hold_progress); false (PROGRESS=backoff): it backs off and steps aside for waiters then too.
  bool hold = true;
  // Waiters: busy-poll this long, then sched_yield every 64 polls, then (after yield_us) sleep
  // 20 us per poll. Short spins matter when ranks outnumber cores (4 ranks on 2 cores: a 100 us
  // spin made every scatter round cost ~110 us, 5 us ~20 us).
  double waiter_spin_us = 5;
  double waiter_yield_us = 20000;
  // Non-blocking polls (Engine::poll_ranks: the proxy thread's) move the transport themselves
  // (true), or only read what the progress thread delivered (false, the default: over shm the
  // provider's copy of an incoming message then runs on the progress thread, held polling while
  // the proxy's transfer is under way, not on the proxy thread between its row copies and posts).
  bool poll_progress = false;  // true by default under PROGRESS=backoff

  // Reads JAX_MOE_A2A_PROGRESS (adaptive|spin|backoff), JAX_MOE_A2A_PROGRESS_SPIN_US,
  // JAX_MOE_A2A_PROGRESS_MAX_SLEEP_US, JAX_MOE_A2A_WAIT_SPIN_US, JAX_MOE_A2A_WAIT_YIELD_US,
  // JAX_MOE_A2A_POLL_PROGRESS (1|0).
  static ProgressOptions from_env();
};

// A non-owning reference to a `bool()` callable (no allocation, unlike std::function): the
// readiness test of a wait, called on every poll.
class Predicate {
 public:
  template <typename F>
  Predicate(F& f) : obj_(&f), call_([](void* o) { return (*static_cast<F*>(o))(); }) {}  // NOLINT
  bool operator()() const { return call_(obj_); }

 private:
  void* obj_;
  bool (*call_)(void*);
};

// One waiter's backoff: call pause() after every unsuccessful poll.
class Backoff {
 public:
  explicit Backoff(const ProgressOptions& o) : opts_(o), start_(Clock::now()) {}
  void pause();

 private:
  const ProgressOptions& opts_;
  Clock::time_point start_;
  uint32_t polls_ = 0;
};

// A thread that calls poll() (returns the number of events handled) until stopped.
class ProgressThread {
 public:
  // busy(): true while work is outstanding that only polling completes (posted writes); the
  // thread then never sleeps longer than a yield. waiters (see WaiterScope): the thread steps
  // aside while a thread waits, and for one more sleep after any wait began (a caller that
  // waits again and again, like a ping-pong, polls alone). held(): true while a transfer is
  // under way (Engine::hold_progress): the thread polls, yielding between polls, and does not
  // step aside for waiters (a proxy whose polls leave the transport to us may still flush).
  ProgressThread(ProgressOptions opts, std::function<int()> poll, std::function<bool()> busy,
                 std::function<bool()> held, const std::atomic<uint64_t>* waiters);
  ~ProgressThread() { stop(); }
  void stop();  // idempotent; joins
  // Completions this thread handled, and its polls made while held (readable from any thread).
  uint64_t events() const { return events_.load(std::memory_order_relaxed); }
  uint64_t held_polls() const { return held_polls_.load(std::memory_order_relaxed); }
  // Ends a sleep now (busy() just turned true: a transfer began while the thread slept).
  void nudge();

 private:
  void run();
  ProgressOptions opts_;
  std::function<int()> poll_;
  std::function<bool()> busy_;
  std::function<bool()> held_;
  const std::atomic<uint64_t>* waiters_;
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> events_{0}, held_polls_{0};  // written by the thread only
  bool nudged_ = false;  // under mu_
  std::mutex mu_;
  std::condition_variable cv_;
  std::thread thread_;
};

// RAII: counts a thread as waiting while alive. The counter holds the number of waits begun in
// its high 32 bits and the number of threads waiting now in its low 32 bits (one atomic add each
// way, as cheap as a plain count).
class WaiterScope {
 public:
  static constexpr uint64_t kBegun = uint64_t(1) << 32;
  explicit WaiterScope(std::atomic<uint64_t>& n) : n_(n) {
    n_.fetch_add(kBegun + 1, std::memory_order_relaxed);
  }
  ~WaiterScope() { n_.fetch_sub(1, std::memory_order_relaxed); }

 private:
  std::atomic<uint64_t>& n_;
};

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

}  // namespace a2a::transfer
