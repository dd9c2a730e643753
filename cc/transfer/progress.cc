#include "transfer/progress.h"

#include <sched.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>

#include "transfer/errors.h"
#include "core/env.h"
#include "core/thread_name.h"

namespace a2a::transfer {
namespace {

double elapsed_us(Clock::time_point since) {
  return std::chrono::duration<double, std::micro>(Clock::now() - since).count();
}

}  // namespace

ProgressOptions ProgressOptions::from_env() {
  ProgressOptions o;
  if (const char* mode = env::get("JAX_MOE_A2A_PROGRESS"); mode && *mode) {
    if (std::strcmp(mode, "spin") == 0) o.spin = true;
    else if (std::strcmp(mode, "backoff") == 0) o.hold = false, o.poll_progress = true;  // the old policy
    else if (std::strcmp(mode, "adaptive") != 0)
      throw TransferError(format("JAX_MOE_A2A_PROGRESS=%s: expected 'adaptive', 'spin' or 'backoff'", mode));
  }
  o.spin_us = env::get_double("JAX_MOE_A2A_PROGRESS_SPIN_US", o.spin_us);
  o.max_sleep_us = env::get_double("JAX_MOE_A2A_PROGRESS_MAX_SLEEP_US", o.max_sleep_us);
  o.waiter_spin_us = env::get_double("JAX_MOE_A2A_WAIT_SPIN_US", o.waiter_spin_us);
  o.waiter_yield_us = env::get_double("JAX_MOE_A2A_WAIT_YIELD_US", o.waiter_yield_us);
  if (const char* p = env::get("JAX_MOE_A2A_POLL_PROGRESS"); p && *p) {
    if (std::strcmp(p, "0") == 0) o.poll_progress = false;
    else if (std::strcmp(p, "1") != 0)
      throw TransferError(format("JAX_MOE_A2A_POLL_PROGRESS=%s: expected 1 or 0", p));
  }
  return o;
}

void Backoff::pause() {
  // Reading the clock costs ~20 ns; do it every 64 polls only.
  if ((++polls_ & 63) != 0) {
    cpu_relax();
    return;
  }
  double us = elapsed_us(start_);
  if (us < opts_.waiter_spin_us) cpu_relax();
  else if (us < opts_.waiter_yield_us) sched_yield();
  else std::this_thread::sleep_for(std::chrono::microseconds(20));
}

ProgressThread::ProgressThread(ProgressOptions opts, std::function<int()> poll, std::function<bool()> busy,
                               std::function<bool()> held, const std::atomic<uint64_t>* waiters)
    : opts_(opts), poll_(std::move(poll)), busy_(std::move(busy)), held_(std::move(held)), waiters_(waiters) {
  thread_ = std::thread([this] {
    set_thread_name(kProgressThreadName);
    run();
  });
}

void ProgressThread::stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_.store(true);
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void ProgressThread::nudge() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    nudged_ = true;
  }
  cv_.notify_all();
}

void ProgressThread::run() {
  auto last_event = Clock::now();
  double sleep_us = 2;
  auto sleep = [&](double us) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_for(lock, std::chrono::duration<double, std::micro>(us), [&] { return stop_.load() || nudged_; });
    if (nudged_) {
      nudged_ = false;
      last_event = Clock::now();  // poll at once, and keep polling for spin_us
      sleep_us = 2;
    }
  };
  uint64_t seen_waits = ~uint64_t(0);
  while (!stop_.load(std::memory_order_relaxed)) {
    uint64_t w = waiters_->load(std::memory_order_relaxed);
    const bool held = held_();
    if (!opts_.spin && !held && ((w & 0xffffffffu) != 0 || (w >> 32) != seen_waits)) {
      // Waiters poll for themselves; two pollers only fight over the CQ lock and the cores.
      seen_waits = w >> 32;
      sleep(std::max(opts_.max_sleep_us, 2.0));
      continue;
    }
    int events = 0;
    try {
      events = poll_();
    } catch (...) {
      // poll() records errors itself; never let an exception kill the process from this thread.
    }
    if (events > 0) events_.store(events_.load(std::memory_order_relaxed) + events, std::memory_order_relaxed);
    if (held) held_polls_.store(held_polls_.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
    if (events > 0 || opts_.spin) {
      if (events > 0) {
        last_event = Clock::now();
        sleep_us = 2;
      }
      continue;
    }
    if (held || busy_()) {
      seen_waits = w >> 32;  // the waits begun while held were stepped past, not owed a sleep
      sched_yield();  // a transfer under way, or writes in flight: only polling completes them
    } else if (elapsed_us(last_event) < opts_.spin_us) {
      sched_yield();
    } else {
      sleep(sleep_us);
      sleep_us = std::min(sleep_us * 2, std::max(opts_.max_sleep_us, 2.0));
    }
  }
}

}  // namespace a2a::transfer
