#include "proxy/proxy.h"

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <future>
#include <memory>
#include <sstream>
#include <stdexcept>

#include "proxy/gdrcopy.h"
#include "proxy/topology.h"
#include "transfer/errors.h"
#include "core/env.h"
#include "core/thread_name.h"

namespace a2a::proxy {

using Clock = std::chrono::steady_clock;
using protocol::kCombineRecv;
using protocol::kCombineSend;
using protocol::kDispatchRecv;
using protocol::kDispatchSend;

namespace {

// What each step waits for (DStage / CStage order), for timeouts and reports.
constexpr const char* kDStepWaits[] = {"FREE_D in",   "our d_counts", "our d_packed", "d_send copy",
                                       "COUNTS in",   "PRIV+OVER in", "d_recv copy",  "our d_consumed"};
constexpr const char* kCStepWaits[] = {"FREE_C in", "our c_packed", "c_send copy", "COMB in", "c_recv copy",
                                       "our c_consumed"};

uint64_t ns_between(Clock::time_point t0, Clock::time_point t1) {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(t1 - t0).count());
}

uint64_t ns_since(Clock::time_point t0) { return ns_between(t0, Clock::now()); }

}  // namespace

ProxyOptions ProxyOptions::from_env(int local_index, const std::string& device_bus_id) {
  ProxyOptions o;
  o.spin_us = env::get_double("JAX_MOE_A2A_PROXY_SPIN_US", o.spin_us);
  o.max_sleep_us = env::get_double("JAX_MOE_A2A_PROXY_MAX_SLEEP_US", o.max_sleep_us);
  o.idle_ms = env::get_double("JAX_MOE_A2A_PROXY_IDLE_MS", o.idle_ms);
  o.idle_sleep_us = env::get_double("JAX_MOE_A2A_PROXY_IDLE_SLEEP_US", o.idle_sleep_us);
  const char* mode = env::get("JAX_MOE_A2A_PROXY");
  if (mode && *mode) {
    const std::string v(mode);
    if (v != "adaptive" && v != "spin" && v != "backoff")
      throw std::invalid_argument("JAX_MOE_A2A_PROXY=" + v + ": expected `adaptive` (the default), `spin` or `backoff`");
    o.spin = v == "spin";
    o.poll_in_flight = v != "backoff";
  }
  const char* pipe = env::get("JAX_MOE_A2A_PROXY_PIPELINE");
  if (pipe && *pipe) {
    const std::string v(pipe);
    if (v != "peer" && v != "priv" && v != "off")
      throw std::invalid_argument("JAX_MOE_A2A_PROXY_PIPELINE=" + v + ": expected `peer`, `priv` or `off`");
    o.pipeline = v != "off";
    o.over_early = v == "peer";
  }
  o.report_s = env::get_double("JAX_MOE_A2A_PROXY_REPORT_S", o.report_s);
  const double depth = env::get_double("JAX_MOE_A2A_COPY_DEPTH", o.copy_depth);
  if (!(depth >= 1 && depth <= kCopyDepth) || depth != static_cast<int>(depth))
    throw std::invalid_argument(transfer::format("JAX_MOE_A2A_COPY_DEPTH=%g: expected an integer in [1, %d]", depth,
                                                 kCopyDepth));
  o.copy_depth = static_cast<int>(depth);
  if (const char* tl = env::get("JAX_MOE_A2A_PROXY_TIMELINE")) o.timeline = tl;
  const char* cpus = env::get("JAX_MOE_A2A_PROXY_CPUS");
  if (cpus && *cpus) {  // "3,7": CPU of local rank 0, 1; "none": no pinning
    std::stringstream ss(cpus);
    std::string item;
    for (int i = 0; std::string(cpus) != "none" && std::getline(ss, item, ','); ++i)
      if (i == local_index && !item.empty()) o.cpu = std::atoi(item.c_str());
  } else if (!device_bus_id.empty()) {  // several processes per node: one CPU each
    o.cpu = cpu_near_device("/sys", device_bus_id, local_index + local_process_rank(), allowed_cpus());
  }
  return o;
}

Proxy::Proxy(protocol::Exchange& ex, Ctrl* ctrl, const ProxyOptions& o, FlagPath flags, RowStaging* staging)
    : ex_(ex),
      ctrl_(ctrl),
      o_(o),
      flags_(std::move(flags)),
      staging_(staging),
      source_flags_(o.pipeline && o.source_flags),
      source_flags_early_(source_flags_ && !staging && !flags_.landing_fence),
      slots_(ex.options().slots),
      timeline_(o.timeline) {
  if (ex.options().shape.N > kMaxRanks || ex.options().slots > kMaxSlots)
    throw std::invalid_argument("jax_moe_a2a proxy: at most 64 ranks and 8 slots");
  // The promise is shared with the thread: it may still be inside set_value when get() returns.
  auto prepared = std::make_shared<std::promise<void>>();
  std::future<void> ready = prepared->get_future();
  thread_ = std::thread([this, prepared] {
    set_thread_name(kProxyThreadName);
    try {
      if (staging_) staging_->prepare();
      prepared->set_value();
    } catch (...) {
      prepared->set_exception(std::current_exception());
      return;
    }
    run();
  });
  if (o_.cpu >= 0) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(o_.cpu, &set);
    if (pthread_setaffinity_np(thread_.native_handle(), sizeof(set), &set) == 0) pinned_ = o_.cpu;  // best effort
  }
  try {
    ready.get();
  } catch (...) {
    thread_.join();
    throw;
  }
}

Proxy::~Proxy() { stop(); }

void Proxy::stop() {
  stop_.store(true, std::memory_order_release);
  wake();
  if (thread_.joinable()) thread_.join();
  try {
    timeline_.write(ex_.rank(), ex_.options().shape.N);  // once; nothing when off
  } catch (const std::exception& e) {  // stop() runs in destructors: say it, do not throw
    std::fprintf(stderr, "jax_moe_a2a proxy (rank %d): %s\n", ex_.rank(), e.what());
  }
}

void Proxy::wake() {
  wakes_.fetch_add(1);  // seq_cst, as sleeping_'s load below and its store in sleep_unless_woken
  if (sleeping_.load()) {
    std::lock_guard<std::mutex> lock(wake_mu_);
    wake_cv_.notify_one();
  }
}

bool Proxy::sleep_unless_woken(double us, uint64_t seen) {
  std::unique_lock<std::mutex> lock(wake_mu_);
  sleeping_.store(true);
  const bool woken = wake_cv_.wait_for(lock, std::chrono::duration<double, std::micro>(us),
                                       [&] { return wakes_.load() != seen; });
  sleeping_.store(false);
  return woken;
}

std::string Proxy::error_text() const {
  if (!failed()) return "";
  return std::string(ctrl_->error.text, strnlen(ctrl_->error.text, sizeof(ctrl_->error.text)));
}

ProxyStats Proxy::stats() const {
  std::lock_guard<std::mutex> lock(stats_mu_);
  ProxyStats s = stats_;
  s.cpu = pinned_;
  s.flag_path = flags_.name;
  s.pipeline = o_.pipeline;
  s.rails = ex_.engine().num_domains();
  s.write_pieces = ex_.pieces_posted();
  s.comb_pieces = ex_.comb_pieces_posted();
  s.post_ns = ex_.engine().post_ns();
  s.progress_events = ex_.engine().progress_thread_events();
  s.progress_held_polls = ex_.engine().progress_held_polls();
  s.progressing_polls = ex_.engine().progressing_polls();
  s.post_blocked_ns = ex_.engine().post_blocked_ns();
  const int n = ex_.options().shape.N;
  s.row_bytes_to.resize(n);
  s.comb_bytes_to.resize(n);
  s.row_writes_to.resize(n);
  s.comb_writes_to.resize(n);
  for (int d = 0; d < n; ++d) {
    s.row_bytes_to[d] = ex_.row_bytes_to(d);
    s.comb_bytes_to[d] = ex_.comb_bytes_to(d);
    s.row_writes_to[d] = ex_.row_writes_to(d);
    s.comb_writes_to[d] = ex_.comb_writes_to(d);
  }
  return s;
}

void Proxy::fail(int code, int op, int z, const std::vector<int>& missing, const std::string& text) {
  ProxyError& e = ctrl_->error;
  if (error_code(ctrl_) != 0) return;
  e.op = op;
  e.slot = z;
  e.rank = ex_.rank();
  e.missing = 0;
  for (int r : missing)
    if (r >= 0 && r < 64) e.missing |= 1ull << r;
  const size_t n = std::min(text.size(), sizeof(e.text) - 1);
  std::memcpy(e.text, text.data(), n);
  e.text[n] = 0;
  __atomic_store_n(&e.code, code, __ATOMIC_RELEASE);
  if (flags_.mirror) {  // the kernels poll the mirror's code; the record first, then the code
    ProxyError& m = flags_.mirror->error;
    auto put32 = [](int32_t& dst, int32_t v) { *reinterpret_cast<volatile int32_t*>(&dst) = v; };
    put32(m.op, e.op);
    put32(m.slot, e.slot);
    put32(m.rank, e.rank);
    *reinterpret_cast<volatile uint64_t*>(&m.missing) = e.missing;
    volatile char* t = m.text;
    for (size_t i = 0; i <= n; ++i) t[i] = e.text[i];
    gdr::wc_fence();
    *reinterpret_cast<volatile int32_t*>(&m.code) = code;
    gdr::wc_fence();
  }
}

void Proxy::raise(int z, uint64_t SlotCtrl::*field, uint64_t v) {
  store_release(&(ctrl_->slot[z].*field), v);
  if (!flags_.mirror) return;
  gdr::wc_fence();  // every earlier store to the mirror (over_base, c_off) reaches the GPU first
  *reinterpret_cast<volatile uint64_t*>(&(flags_.mirror->slot[z].*field)) = v;
  gdr::wc_fence();  // drain the write-combining buffer: the flag goes out now
}

void Proxy::adopt(int z, SlotState& s) {
  if (s.c_adopted) return;
  ex_.adopt_combine_offsets(z, ctrl_->slot[z].c_from_slot);
  s.c_adopted = true;
}

void Proxy::publish_landing(int z) {
  SlotCtrl& c = ctrl_->slot[z];
  const int N = ex_.options().shape.N;
  ex_.overflow_bases(z, c.over_base);
  const int64_t* off = ex_.combine_offsets(z);
  for (int r = 0; r < N; ++r) c.c_off[r] = static_cast<int32_t>(off[r]);
  if (!flags_.mirror) return;
  SlotCtrl& m = flags_.mirror->slot[z];
  for (int r = 0; r < N; ++r) {
    reinterpret_cast<volatile int64_t*>(m.over_base)[r] = c.over_base[r];
    reinterpret_cast<volatile int32_t*>(m.c_off)[r] = c.c_off[r];
  }
}

uint64_t Proxy::stage(int z, SlotState& s, RowBuffer b, const std::vector<protocol::ByteRange>& ranges) {
  uint64_t bytes = 0;
  for (const protocol::ByteRange& r : ranges) bytes += uint64_t(r.len);
  const Clock::time_point since = Clock::now();
  const uint64_t ticket = staging_->start(z, b, ranges);
  std::deque<SlotState::Copy>& q = s.copies[static_cast<int>(b)];
  q.push_back({ticket, bytes, since});
  if (copies_in_flight() == 1) busy_since_ = since;  // the first in flight: a busy period starts
  if (q.size() > stats_.copies_in_flight_max) {  // only this thread writes it
    std::lock_guard<std::mutex> lock(stats_mu_);
    stats_.copies_in_flight_max = q.size();
  }
  return ticket;
}

void Proxy::copy_late(int z, const SlotState& s, RowBuffer b, int op, uint32_t e) const {
  const std::deque<SlotState::Copy>& q = s.copies[static_cast<int>(b)];
  if (q.empty()) return;
  const double waited = std::chrono::duration<double>(Clock::now() - q.front().since).count();
  if (waited > ex_.options().timeout_s && load_acquire(&ctrl_->slot[z].waiting[op]) >= uint64_t(e) + 1) {
    throw std::runtime_error(transfer::format("the row copies of the %s buffer (%llu bytes) did not finish within "
                                              "%.1f s", row_buffer_name(b), (unsigned long long)q.front().bytes,
                                              waited));
  }
}

bool Proxy::staged(int z, SlotState& s, RowBuffer b, int op, uint32_t e, uint64_t ticket) {
  if (!staging_->done(z, b, ticket)) {
    copy_late(z, s, b, op, e);
    return false;
  }
  std::deque<SlotState::Copy>& q = s.copies[static_cast<int>(b)];
  std::lock_guard<std::mutex> lock(stats_mu_);
  // one end for the durations and the wall time alike (so the wall time never exceeds their sum)
  const Clock::time_point now = Clock::now();
  while (!q.empty() && q.front().ticket <= ticket) {
    stats_.staged_bytes += q.front().bytes;
    stats_.staging_ns += ns_between(q.front().since, now);
    q.pop_front();
    if (copies_in_flight() == 0) stats_.staging_busy_ns += ns_between(busy_since_, now);
  }
  return true;
}

bool Proxy::rows_packed_for(const SlotCtrl& c, uint32_t e, int d, bool all) const {
  return all || (o_.pipeline && load_acquire(&c.d_packed_to[d]) >= uint64_t(e) + 1);
}

void Proxy::post_priv(int z, SlotState& s, uint32_t e, int d, bool early) {
  timeline_.mark(Mark::kDPrivPost, z, e, d);
  ex_.post_private_to(z, e, d);
  timeline_.mark(Mark::kDPrivPosted, z, e, d);
  priv_out(s, d, early);
}

void Proxy::priv_out(SlotState& s, int d, bool early) {
  s.priv_posted |= 1ull << d;
  if (early) {
    std::lock_guard<std::mutex> lock(stats_mu_);
    ++stats_.priv_early;
  }
}

void Proxy::privs_out(SlotState& s) {
  {
    std::lock_guard<std::mutex> lock(stats_mu_);
    stats_.counts_to_priv_ns += ns_since(s.counts_out);
  }
  s.d = kDCountsIn;
  s.d_since = {};
}

bool Proxy::post_overflow_early(int z, SlotState& s, uint32_t e) {
  uint64_t want = 0;  // PRIV out, OVER not yet
  for (int d : ex_.remote_ranks())
    if ((s.priv_posted >> d & 1) && !(s.over_posted >> d & 1)) want |= 1ull << d;
  if (!want) return false;
  const uint64_t missing = s.d_wait.missing_mask();
  int posted = 0;
  for (int d : ex_.remote_ranks()) {
    if (!(want >> d & 1) || !ex_.overflow_offset_known(z, d, missing)) continue;
    ex_.post_overflow_to(z, e, d);
    s.over_posted |= 1ull << d;
    ++posted;
  }
  if (posted) {
    std::lock_guard<std::mutex> lock(stats_mu_);
    stats_.over_early += posted;
  }
  return posted > 0;
}

void Proxy::SlotState::next_dispatch() {
  ++de;
  d = kDFree;
  priv_posted = 0;
  over_posted = 0;
  src_landed = 0;
  d_src = {};
  d_send_pieces = {};
}

void Proxy::SlotState::next_combine() {
  ++ce;
  c = kCFree;
  comb_landed = 0;
  c_adopted = false;
  comb_posted = 0;
  c_src = {};
  c_send_pieces = {};
  comb_groups_started = 0;
  comb_groups_copied = 0;
}

void Proxy::raise_landed(const protocol::Arrivals& wait, uint64_t& raised, uint64_t* flags, uint32_t e, bool all) {
  // bit r: not yet seen in some part of the wait (PRIV and OVER rows; one part per tp member)
  const uint64_t pending = all ? 0 : wait.missing_mask();
  for (int r : ex_.remote_ranks()) {
    if ((raised | pending) >> r & 1) continue;
    store_release(&flags[r], uint64_t(e) + 1);
    raised |= 1ull << r;
  }
}

template <class NextPeer, class Count, class Ranges, class Post, class Finish>
void Proxy::pump_pieces(int z, SlotState& s, uint32_t e, RowBuffer b, int op, SlotState::SendPieces& q,
                        const NextPeer& next_peer, const Count& count, const Ranges& ranges_of, const Post& post,
                        const Finish& finish, bool* moved) {
  auto post_ready = [&] {  // in order: a buffer's copies complete in the order started
    while (!q.queued.empty()) {
      const SlotState::SendPieces::Piece p = q.queued.front();
      if (p.ticket && !staged(z, s, b, op, e, p.ticket)) return;
      q.queued.pop_front();
      post(p.who, p.piece);
      *moved = true;
      if (p.piece + 1 == count(p.who)) {
        finish(p.who);
      } else if (!q.queued.empty() && q.queued.front().ticket) {  // the next piece's copy runs
        std::lock_guard<std::mutex> lock(stats_mu_);
        ++stats_.pieces_behind_copy;
      }
    }
  };
  post_ready();
  for (;;) {
    if (q.who < 0) {
      const int w = next_peer();
      if (w < 0) break;
      q.started |= 1ull << w;
      *moved = true;
      if (count(w) == 0) {  // nothing to write (a rank the slot's mask leaves out)
        finish(w);
        continue;
      }
      q.who = w;
      q.next = 0;
    }
    const int n = count(q.who);
    for (; q.next < n; ++q.next) {
      const std::vector<protocol::ByteRange> ranges = ranges_of(q.who, q.next);
      uint64_t ticket = 0;  // an empty piece carries the immediate alone
      if (!ranges.empty()) {
        if (!can_stage(s, b)) break;
        ticket = stage(z, s, b, ranges);
      }
      q.queued.push_back({q.who, q.next, ticket});
      *moved = true;
    }
    if (q.next < n) break;  // copy_depth copies in flight
    q.who = -1;
  }
  post_ready();
}

bool Proxy::post_sends(int z, SlotState& s, uint32_t e, bool* moved) {
  const SlotCtrl& c = ctrl_->slot[z];
  const bool all = load_acquire(&c.d_packed) >= uint64_t(e) + 1;
  if (staging_) {  // each destination's pieces copied back to back, each posted once its copy is done
    auto next_peer = [&] {
      for (int d : ex_.remote_ranks())
        if (!(s.d_send_pieces.started >> d & 1) && rows_packed_for(c, e, d, all)) return d;
      return -1;
    };
    auto post = [&](int d, int i) {
      if (i == 0) timeline_.mark(Mark::kDPrivPost, z, e, d);
      ex_.post_private_piece(z, e, d, i);
    };
    auto finish = [&](int d) {
      timeline_.mark(Mark::kDPrivPosted, z, e, d);
      priv_out(s, d, !all);
    };
    pump_pieces(z, s, e, RowBuffer::kDSend, kDispatchRecv, s.d_send_pieces, next_peer,
                [&](int d) { return ex_.private_pieces(z, d); },
                [&](int d, int i) { return ex_.send_rows_of_piece(z, d, i); }, post, finish, moved);
    for (int d : ex_.remote_ranks())
      if (!(s.priv_posted >> d & 1)) return false;
    return true;
  }
  bool done = true;
  for (int d : ex_.remote_ranks()) {
    if (s.priv_posted >> d & 1) continue;
    if (!rows_packed_for(c, e, d, all)) {
      done = false;
      continue;
    }
    *moved = true;
    post_priv(z, s, e, d, !all);
  }
  return done;
}

bool Proxy::stage_combine_sends(int z, SlotState& s, uint32_t e, bool* moved) {
  const SlotCtrl& c = ctrl_->slot[z];
  SlotState::SendPieces& q = s.c_send_pieces;
  // The rows for m are its tp group's members' runs: copied once per group, for whichever member
  // comes first (a masked rank has nothing copied: its group's live members still need theirs);
  // the group's other members then get every piece at once.
  const int tp = ex_.options().shape.tp;
  auto group = [&](int m) { return 1ull << (m / tp * tp); };
  auto post_copied_groups = [&] {
    for (int m : ex_.remote_ranks()) {
      if ((q.started >> m & 1) || !(s.comb_groups_copied & group(m))) continue;
      timeline_.mark(Mark::kCCombPost, z, e, m);
      ex_.post_combine_to(z, e, m, c.rows_from, c.c_stride);
      q.started |= 1ull << m;
      s.comb_posted |= 1ull << m;
      *moved = true;
    }
  };
  auto next_peer = [&] {
    for (int m : ex_.remote_ranks()) {
      if ((q.started >> m & 1) || (s.comb_groups_started & group(m))) continue;  // its group's copy runs
      if (ex_.alive(z, m)) s.comb_groups_started |= group(m);
      return m;
    }
    return -1;
  };
  auto post = [&](int m, int i) {
    if (i == 0) timeline_.mark(Mark::kCCombPost, z, e, m);
    ex_.post_combine_piece(z, e, m, c.rows_from, c.c_stride, i);
  };
  auto finish = [&](int m) {
    s.comb_posted |= 1ull << m;
    if (ex_.alive(z, m)) s.comb_groups_copied |= group(m);
  };
  post_copied_groups();
  pump_pieces(z, s, e, RowBuffer::kCSend, kCombineRecv, q, next_peer, [&](int) { return ex_.combine_pieces(); },
              [&](int m, int i) { return ex_.combine_send_rows_of_piece(z, m, c.rows_from, c.c_stride, i); }, post,
              finish, moved);
  post_copied_groups();
  for (int m : ex_.remote_ranks())
    if (!(s.comb_posted >> m & 1)) return false;
  return true;
}

bool Proxy::stage_by_source(int z, SlotState& s, uint32_t e, RowBuffer b, int op, const protocol::Arrivals& wait,
                            SlotState::LandedCopies& lc, uint64_t& flagged, uint64_t* flags,
                            const std::function<protocol::ByteRange(int, int, int)>& ranges_of,
                            uint64_t ProxyStats::*early, bool* moved) {
  enum : uint8_t { kWaiting = 0, kCopying = 1, kCopied = 2 };
  const size_t parts = wait.parts.size();
  if (lc.state.size() != parts) {  // the epoch's first look
    lc.state.resize(parts);
    for (size_t p = 0; p < parts; ++p) lc.state[p].assign(wait.parts[p].ranks.size(), kWaiting);
  }
  // Copies done, in order (a buffer's copies complete in the order started).
  while (!lc.in_flight.empty() && staged(z, s, b, op, e, lc.in_flight.front().ticket)) {
    for (const auto& [p, k] : lc.in_flight.front().entries) lc.state[p][k] = kCopied;
    lc.in_flight.pop_front();
    *moved = true;
  }
  // Every entry that landed and is in no copy goes into the next copy (adjacent pieces merged).
  const bool room = can_stage(s, b);
  std::vector<protocol::ByteRange> ranges;
  SlotState::LandedCopies::Copy copy{0, {}};
  uint64_t pending = 0;  // bit r: an entry of rank r not landed or not copied
  // [part] bit r: a piece of rank r's write in that part still to come (parts: 2, or tp <= 8)
  std::array<uint64_t, 8> unseen{};
  for (size_t p = 0; p < parts; ++p) {
    const protocol::Arrivals::Part& part = wait.parts[p];
    for (size_t k = 0; k < part.ranks.size(); ++k) {
      uint8_t& st = lc.state[p][k];
      if (st == kCopied) continue;
      const int r = part.rank_at(k);
      pending |= 1ull << r;
      if (!part.seen[k]) unseen.at(p) |= 1ull << r;
      if (st == kCopying || !part.seen[k] || !room) continue;
      const protocol::ByteRange got = ranges_of(int(p), r, part.piece_at(k));
      if (got.len == 0) {  // nothing to copy (an empty piece, or a rank the slot's mask leaves out)
        st = kCopied;
        continue;
      }
      if (!ranges.empty() && ranges.back().off + ranges.back().len == got.off) ranges.back().len += got.len;
      else ranges.push_back(got);
      st = kCopying;
      copy.entries.emplace_back(int(p), k);
    }
  }
  if (!ranges.empty()) {
    // the copy holds a piece of a write whose other pieces are still coming
    bool piece_early = false;
    for (const auto& [p, k] : copy.entries) piece_early |= (unseen[p] >> wait.parts[p].rank_at(k) & 1) != 0;
    copy.ticket = stage(z, s, b, ranges);
    lc.in_flight.push_back(std::move(copy));
    *moved = true;
    if (wait.missing_mask()) {
      std::lock_guard<std::mutex> lock(stats_mu_);
      ++(stats_.*early);
      stats_.pieces_copied_early += piece_early;
    }
  }
  // A rank's rows all copied: a packer that reads per-source flags (the host backend's) may unpack
  // them now (where no landing fence has to come first; the cuda path reads only d_landed / c_landed).
  if (source_flags_ && !flags_.landing_fence)
    for (int r : ex_.remote_ranks()) {
      if ((flagged | pending) >> r & 1) continue;
      store_release(&flags[r], uint64_t(e) + 1);
      flagged |= 1ull << r;
    }
  return pending == 0;  // every entry here and copied
}

bool Proxy::stage_landed(int z, SlotState& s, uint32_t e, bool* moved) {
  const int64_t* over_base = ctrl_->slot[z].over_base;
  return stage_by_source(z, s, e, RowBuffer::kDRecv, kDispatchRecv, s.d_wait, s.d_src, s.src_landed,
                         ctrl_->slot[z].d_landed_from,
                         [&](int part, int r, int piece) { return ex_.landed_piece(z, part, r, piece, over_base); },
                         &ProxyStats::staged_early, moved);
}

bool Proxy::stage_comb_landed(int z, SlotState& s, uint32_t e, bool* moved) {
  // part j of the combine's wait: tp member j's rows
  return stage_by_source(z, s, e, RowBuffer::kCRecv, kCombineRecv, s.c_wait, s.c_src, s.comb_landed,
                         ctrl_->slot[z].c_landed_from,
                         [&](int j, int r, int piece) { return ex_.combine_landed_piece(s.comb_in.at(r).at(j), piece); },
                         &ProxyStats::comb_staged_early, moved);
}

std::string Proxy::slot_state(int z) const {
  const SlotCtrl& c = ctrl_->slot[z];
  const SlotState& st = slots_[z];
  auto f = [](const uint64_t& v) { return static_cast<unsigned long long>(load_acquire(&v)); };
  return transfer::format("slot flags: d_counts %llu d_packed %llu d_consumed %llu c_packed %llu c_consumed %llu "
                          "waiting [%llu %llu %llu %llu] d_send_ok %llu d_landed %llu c_send_ok %llu c_landed %llu; "
                          "proxy at dispatch step %d (waits: %s) epoch %u, combine step %d (waits: %s) epoch %u, "
                          "pipeline %s",
                          f(c.d_counts), f(c.d_packed), f(c.d_consumed), f(c.c_packed), f(c.c_consumed),
                          f(c.waiting[0]), f(c.waiting[1]), f(c.waiting[2]), f(c.waiting[3]), f(c.d_send_ok),
                          f(c.d_landed), f(c.c_send_ok), f(c.c_landed), static_cast<int>(st.d), kDStepWaits[st.d], st.de,
                          static_cast<int>(st.c), kCStepWaits[st.c], st.ce,
                          !o_.pipeline ? "off" : o_.over_early ? "peer" : "priv");
}

void Proxy::check_late(int op, int z, uint32_t e, const protocol::Arrivals& a, const char* what, Clock::time_point& since) {
  if (load_acquire(&ctrl_->slot[z].waiting[op]) < uint64_t(e) + 1) return;  // nobody waits yet
  const auto now = Clock::now();
  if (since == Clock::time_point{}) since = now;
  if (std::chrono::duration<double>(now - since).count() > ex_.options().timeout_s)
    ex_.timed_out(a, op, z, what, "(the proxy thread gave up; " + slot_state(z) + ")");
}

std::string Proxy::in_flight(int z) const {
  const SlotCtrl& c = ctrl_->slot[z];
  const SlotState& s = slots_[z];
  std::string why;
  auto add = [&why](const std::string& w) { why += (why.empty() ? "" : "; ") + w; };
  if (s.d != kDCounts)
    add(transfer::format("dispatch epoch %u at step %d (waits: %s)", s.de, static_cast<int>(s.d), kDStepWaits[s.d]));
  if (s.c != kCPacked)
    add(transfer::format("combine epoch %u at step %d (waits: %s)", s.ce, static_cast<int>(s.c), kCStepWaits[s.c]));
  if (s.d == kDCounts && load_acquire(&c.waiting[kDispatchSend]) >= uint64_t(s.de) + 1)
    add(transfer::format("our dispatch_send of epoch %u waited on the proxy (waiting[0]) but raised no d_counts", s.de));
  if (s.c == kCPacked && load_acquire(&c.waiting[kCombineSend]) >= uint64_t(s.ce) + 1)
    add(transfer::format("our combine_send of epoch %u waited on the proxy (waiting[2]) but raised no c_packed", s.ce));
  if (s.d == kDCounts) {
    std::vector<int> ahead;
    const uint64_t bits = ex_.counts_waiting(z, s.de);
    for (int r = 0; r < 64; ++r)
      if (bits >> r & 1) ahead.push_back(r);
    if (!ahead.empty())
      add(transfer::format("COUNTS of dispatch epoch %u came from ranks [%s] but our packer raised no d_counts", s.de,
                           transfer::join_ranks(ahead).c_str()));
  }
  return why;
}

void Proxy::report_stalls() {
  const double after = o_.report_s < 0 ? ex_.options().timeout_s : o_.report_s;
  if (after <= 0 || failed()) return;
  const auto now = Clock::now();
  for (int z = 0; z < int(slots_.size()); ++z) {
    SlotState& s = slots_[z];
    if (s.d != s.seen_d || s.c != s.seen_c || s.de != s.seen_de || s.ce != s.seen_ce) {
      s.seen_d = s.d, s.seen_c = s.c, s.seen_de = s.de, s.seen_ce = s.ce;
      s.steps_since = now;
      s.busy_since = {};
      s.stall_reported = false;
      continue;
    }
    const double stalled = std::chrono::duration<double>(now - s.steps_since).count();
    // At most one look per slot every min(1 s, after) past the threshold (in_flight takes the
    // engine's lock).
    if (s.stall_reported || stalled < after ||
        std::chrono::duration<double>(now - s.stall_checked).count() < std::min(1.0, after))
      continue;
    s.stall_checked = now;
    const std::string why = in_flight(z);
    // A slot that rested (no op in flight) for long has an old steps_since: its stall starts when
    // a look first finds an op in flight, so the first step after a pause is not reported at once.
    if (why.empty()) {
      s.busy_since = {};
      continue;
    }
    if (s.busy_since == Clock::time_point{}) s.busy_since = now;
    const double busy = std::chrono::duration<double>(now - s.busy_since).count();
    if (busy < after) continue;
    s.stall_reported = true;
    std::fprintf(stderr,
                 "jax_moe_a2a proxy (rank %d, slot %d): no step for %.1f s with an op in flight (%s); %s "
                 "(a report, not an error; printed once per stall)\n",
                 ex_.rank(), z, std::min(stalled, busy), why.c_str(), slot_state(z).c_str());
    std::fflush(stderr);
  }
}

bool Proxy::step_dispatch(int z, SlotState& s) {
  SlotCtrl& c = ctrl_->slot[z];
  const uint32_t e = s.de;
  switch (s.d) {
    case kDFree:
      cur_op_ = kDispatchSend;
      if (e > 0) {
        if (!s.d_armed) {
          s.d_wait = ex_.expect_free_d(z, e - 1);
          s.d_armed = true;
          s.d_since = {};
        }
        const bool freed = ex_.poll(s.d_wait);
        if (!freed || !ex_.engine().poll_flush()) {
          check_late(kDispatchSend, z, e, s.d_wait, "waiting for remote peers to free the slot", s.d_since);
          return false;
        }
      }
      s.d_armed = false;
      raise(z, &SlotCtrl::d_send_ok, uint64_t(e) + 1);
      timeline_.mark(Mark::kDSendOk, z, e);
      s.d = kDCounts;
      return true;
    case kDCounts:
      if (load_acquire(&c.d_counts) < uint64_t(e) + 1) return false;
      cur_op_ = kDispatchSend;
      ex_.post_counts(z, e);
      s.counts_out = Clock::now();
      timeline_.mark(Mark::kDCountsOut, z, e);
      s.d = kDPriv;
      return true;
    case kDPriv:
      cur_op_ = kDispatchSend;
      if (o_.pipeline && !staging_) {  // each peer's write as soon as its rows are packed
        bool moved = false;
        if (!post_sends(z, s, e, &moved)) return moved;
        privs_out(s);
        return true;
      }
      if (!staging_ && load_acquire(&c.d_packed) < uint64_t(e) + 1) return false;
      s.d = kDSendCopy;
      [[fallthrough]];
    case kDSendCopy:
      cur_op_ = kDispatchSend;
      if (staging_) {  // every row of a destination (PRIV and OVER: OVER goes out from there later)
        bool moved = false;
        if (!post_sends(z, s, e, &moved)) return moved;
        privs_out(s);
        return true;
      }
      timeline_.mark(Mark::kDPrivPost, z, e);
      ex_.post_private(z, e);
      timeline_.mark(Mark::kDPrivPosted, z, e);
      privs_out(s);
      return true;
    case kDCountsIn:
      cur_op_ = kDispatchRecv;
      if (!s.d_armed) {
        s.d_wait = ex_.expect_counts(z, e);
        s.d_armed = true;
      }
      if (!ex_.poll(s.d_wait)) {
        if (o_.over_early && post_overflow_early(z, s, e)) return true;
        check_late(kDispatchRecv, z, e, s.d_wait, "route counts", s.d_since);
        return false;
      }
      timeline_.mark(Mark::kDCountsIn, z, e);  // again when a combine's post below returns first
      // The combine offsets of this dispatch replace the previous dispatch's, which a combine
      // packed but not yet posted still needs: the packer raised that c_packed before this
      // dispatch's d_counts (a slot's combine_send precedes its next dispatch_send), so post it now
      // (with row staging: once its rows are copied; until then this step waits).
      if ((s.c == kCPacked && load_acquire(&c.c_packed) >= uint64_t(s.ce) + 1) || s.c == kCSendCopy) {
        bool moved = false;
        while ((s.c == kCPacked || s.c == kCSendCopy) && step_combine(z, s)) moved = true;
        cur_op_ = kDispatchRecv;
        if (s.c == kCPacked || s.c == kCSendCopy) {
          // Its copy may outlive the timeout while our dispatch_recv, not its combine_recv, waits.
          if (s.c == kCSendCopy) copy_late(z, s, RowBuffer::kCSend, kDispatchRecv, e);
          return moved;  // a copy just started is progress: poll again before sleeping
        }
      }
      // A combine packed on another slot w from this slot's previous dispatch takes those offsets
      // now, before they are replaced (its c_packed, too, was raised before this d_counts).
      // This relies on stream order: the packer of that combine (on slot w) ran before the send of
      // this dispatch (on slot z) on the same stream, so c_packed of w is up whenever d_counts of z
      // is; a combine whose c_packed rose after d_counts would read the new dispatch's offsets.
      for (int w = 0; w < static_cast<int>(slots_.size()); ++w) {
        SlotState& o = slots_[w];
        if (w != z && o.c == kCPacked && load_acquire(&ctrl_->slot[w].c_packed) >= uint64_t(o.ce) + 1 &&
            ctrl_->slot[w].c_from_slot == z)
          adopt(w, o);
      }
      ex_.take_combine_offsets(z);
      ex_.post_overflow(z, e, s.over_posted);
      publish_landing(z);
      timeline_.mark(Mark::kDOverOut, z, e);
      if (source_flags_) store_release(&c.d_placed, uint64_t(e) + 1);  // over_base, c_off: valid
      s.d_wait = ex_.expect_rows(z, e);
      s.d = kDRowsIn;
      return true;
    case kDRowsIn: {
      cur_op_ = kDispatchRecv;
      const bool in = ex_.poll(s.d_wait);
      if (source_flags_early_) raise_landed(s.d_wait, s.src_landed, ctrl_->slot[z].d_landed_from, e, false);
      bool copied = false;  // staging: a source complete while others are in flight is copied now
      if (staging_ && !in) stage_landed(z, s, e, &copied);
      if (!in) {
        check_late(kDispatchRecv, z, e, s.d_wait, "private and overflow rows", s.d_since);
        return copied;
      }
      timeline_.mark(Mark::kDRowsIn, z, e);
      s.d_armed = false;
      s.d = kDRecvCopy;
      [[fallthrough]];
    }
    case kDRecvCopy:
      cur_op_ = kDispatchRecv;
      if (staging_) {
        bool copied = false;
        if (!stage_landed(z, s, e, &copied)) return copied;
      }
      if (flags_.landing_fence) flags_.landing_fence();
      if (source_flags_) raise_landed(s.d_wait, s.src_landed, ctrl_->slot[z].d_landed_from, e, true);  // those not raised yet
      raise(z, &SlotCtrl::d_landed, uint64_t(e) + 1);
      timeline_.mark(Mark::kDLanded, z, e);
      {
        std::lock_guard<std::mutex> lock(stats_mu_);
        stats_.counts_to_landed_ns += ns_since(s.counts_out);
        ++stats_.dispatches_landed;
      }
      s.d = kDConsumed;
      return true;
    case kDConsumed:
      if (load_acquire(&c.d_consumed) < uint64_t(e) + 1) return false;
      cur_op_ = kDispatchRecv;
      ex_.signal_free_d(z, e);
      timeline_.mark(Mark::kDConsumed, z, e);
      {
        std::lock_guard<std::mutex> lock(stats_mu_);
        ++stats_.dispatches;
      }
      s.next_dispatch();
      return true;
  }
  return false;
}

bool Proxy::step_combine(int z, SlotState& s) {
  SlotCtrl& c = ctrl_->slot[z];
  const uint32_t e = s.ce;
  switch (s.c) {
    case kCFree:
      cur_op_ = kCombineSend;
      if (e > 0) {
        if (!s.c_armed) {
          s.c_wait = ex_.expect_free_c(z, e - 1);
          s.c_armed = true;
          s.c_since = {};
        }
        const bool freed = ex_.poll(s.c_wait);
        if (!freed || !ex_.engine().poll_flush()) {
          check_late(kCombineSend, z, e, s.c_wait, "waiting for remote peers to free the slot", s.c_since);
          return false;
        }
      }
      s.c_armed = false;
      raise(z, &SlotCtrl::c_send_ok, uint64_t(e) + 1);
      timeline_.mark(Mark::kCSendOk, z, e);
      s.c = kCPacked;
      return true;
    case kCPacked:
      if (load_acquire(&c.c_packed) < uint64_t(e) + 1) return false;
      cur_op_ = kCombineSend;
      adopt(z, s);
      s.c = kCSendCopy;
      if (staging_) {
        // c_recv's ranges now: the next dispatch's counts replace the offsets they come from.
        s.comb_in.assign(ex_.options().shape.N, {});
        for (int d : ex_.remote_ranks()) s.comb_in[d] = ex_.combine_landed_runs(z, d, c.c_stride);
      }
      [[fallthrough]];
    case kCSendCopy:
      cur_op_ = kCombineSend;
      if (staging_) {
        bool moved = false;
        if (!stage_combine_sends(z, s, e, &moved)) {
          // Our own pieces still going out: the peers' COMB pieces that landed meanwhile are
          // copied now, not after our last post (the receive copies have their own buffer and,
          // on the GPU, their own stream). The wait is armed once and kept for kCLanded.
          if (!s.c_armed) {
            s.c_wait = ex_.expect_comb(z, e);
            s.c_armed = true;
          }
          ex_.poll(s.c_wait);
          cur_op_ = kCombineRecv;
          stage_comb_landed(z, s, e, &moved);
          return moved;
        }
      } else {
        timeline_.mark(Mark::kCCombPost, z, e);
        ex_.post_combine(z, e, c.rows_from, c.c_stride);
      }
      s.comb_out = Clock::now();
      timeline_.mark(Mark::kCCombPosted, z, e);
      if (!s.c_armed) s.c_wait = ex_.expect_comb(z, e);
      s.c_armed = false;
      s.c_since = {};
      s.c = kCLanded;
      return true;
    case kCLanded: {
      cur_op_ = kCombineRecv;
      const bool in = ex_.poll(s.c_wait);
      if (source_flags_early_) raise_landed(s.c_wait, s.comb_landed, ctrl_->slot[z].c_landed_from, e, false);
      bool copied = false;  // staging: a rank's rows complete while others are in flight are copied now
      if (staging_ && !in) stage_comb_landed(z, s, e, &copied);
      if (!in) {
        check_late(kCombineRecv, z, e, s.c_wait, "expert outputs", s.c_since);
        return copied;
      }
      timeline_.mark(Mark::kCCombIn, z, e);
      s.c = kCRecvCopy;
      [[fallthrough]];
    }
    case kCRecvCopy:
      cur_op_ = kCombineRecv;
      if (staging_) {
        bool copied = false;
        if (!stage_comb_landed(z, s, e, &copied)) return copied;
      }
      if (flags_.landing_fence) flags_.landing_fence();
      if (source_flags_) raise_landed(s.c_wait, s.comb_landed, ctrl_->slot[z].c_landed_from, e, true);  // those not raised yet
      raise(z, &SlotCtrl::c_landed, uint64_t(e) + 1);
      timeline_.mark(Mark::kCLanded, z, e);
      {
        std::lock_guard<std::mutex> lock(stats_mu_);
        stats_.comb_to_landed_ns += ns_since(s.comb_out);
        ++stats_.combines_landed;
      }
      s.c = kCConsumed;
      return true;
    case kCConsumed:
      if (load_acquire(&c.c_consumed) < uint64_t(e) + 1) return false;
      cur_op_ = kCombineRecv;
      ex_.signal_free_c(z, e);
      timeline_.mark(Mark::kCConsumed, z, e);
      {
        std::lock_guard<std::mutex> lock(stats_mu_);
        ++stats_.combines;
      }
      s.next_combine();
      return true;
  }
  return false;
}

bool Proxy::packer_waiting() const {
  static constexpr uint64_t SlotCtrl::*kRaised[4] = {&SlotCtrl::d_send_ok, &SlotCtrl::d_landed, &SlotCtrl::c_send_ok,
                                                     &SlotCtrl::c_landed};  // protocol::Op order
  for (int z = 0; z < int(slots_.size()); ++z)
    for (int op = 0; op < kNumHalves; ++op)
      if (load_acquire(&ctrl_->slot[z].waiting[op]) > load_acquire(&(ctrl_->slot[z].*kRaised[op]))) return true;
  return false;
}

bool Proxy::op_under_way() const {
  for (const SlotState& s : slots_) {
    // The transfer proper: from our packer's d_counts (c_packed) to the landing. Not the steps that
    // wait on our own packer's next half (kDCounts, kDConsumed, kCPacked, kCConsumed: its enqueue
    // wakes us) or on the peers' consumption of the op before (kDFree, kCFree: a peer's compute
    // between its halves, which may be long).
    if (s.d == kDPriv || s.d == kDSendCopy || s.d == kDCountsIn || s.d == kDRowsIn || s.d == kDRecvCopy) return true;
    if (s.c == kCSendCopy || s.c == kCLanded || s.c == kCRecvCopy) return true;
  }
  return false;
}

void Proxy::run() {
  auto last_progress = Clock::now();
  // Set by a wake (a packer enqueued or raised something): poll until an op shows up (a step
  // moves), for at most idle_ms. The cuda backend wakes us as it enqueues a half; its kernel
  // raises d_counts / c_packed some 10-300 us later, and a sleep of the back-off then would
  // delay the op's first step by up to max_sleep_us.
  auto wake_deadline = Clock::time_point{};
  double sleep_us = 1;
  uint64_t polls = 0, sleeps = 0;
  uint64_t wakes_seen = wakes_.load();
  transfer::Engine& engine = ex_.engine();  // held polling while we poll (hold_progress)
  while (!stop_.load(std::memory_order_acquire)) {
    // Read before this round's polls: a packer's flag raised after them comes with a wake that
    // the sleep below sees.
    const uint64_t wakes = wakes_.load();
    const bool woken = wakes != wakes_seen;  // a packer announced work: as good as progress
    bool progressed = woken, moved = false;
    wakes_seen = wakes;
    if (!failed()) {
      for (int z = 0; z < int(slots_.size()); ++z) {
        cur_slot_ = z;
        try {
          while (step_dispatch(z, slots_[z])) moved = true;
          while (step_combine(z, slots_[z])) moved = true;
        } catch (const transfer::TimeoutError& e) {
          fail(1, cur_op_, z, e.missing, e.what());
        } catch (const std::exception& e) {
          fail(2, cur_op_, z, {},
               transfer::format("jax_moe_a2a %s (slot %d, rank %d): the proxy thread failed: %s",
                                protocol::op_name(cur_op_), z, ex_.rank(), e.what()));
        }
        if (failed()) break;
      }
    }
    ++polls;
    progressed = progressed || moved;
    if (progressed) {
      engine.hold_progress(!failed());
      last_progress = Clock::now();
      if (moved) wake_deadline = {};  // the op showed up: op_under_way() takes over
      if (woken && !moved) wake_deadline = last_progress + std::chrono::microseconds(static_cast<int64_t>(o_.idle_ms * 1e3));
      sleep_us = 1;
      continue;
    }
    report_stalls();
    const auto now = Clock::now();
    const double idle_us = std::chrono::duration<double, std::micro>(now - last_progress).count();
    // Polling, not sleeping, while something will come without a wake: a packer waits on us (a
    // sleep would delay its flag by up to max_sleep_us), an op is under way (its next step waits
    // on a peer's write or a copy), or a wake announced an op whose first flag is not up yet
    // (o_.poll_in_flight; JAX_MOE_A2A_PROXY=backoff turns the last two off). Bounded at 10 s (or
    // twice the timeout) without progress: a waiting[] left behind by a kernel that gave up, or an
    // op called out of order or whose peer died, must not keep a core busy for long.
    const bool under_way = op_under_way();
    const bool busy = packer_waiting() || (o_.poll_in_flight && (under_way || now < wake_deadline));
    const bool polling = o_.spin || idle_us < o_.spin_us ||
                         (!failed() && idle_us < 1e6 * std::min(2 * ex_.options().timeout_s, 10.0) && busy);
    // While we poll, so does the engine's progress thread (our polls may only read what it
    // delivered: POLL_PROGRESS=0); while we sleep, it backs off too.
    engine.hold_progress(polling && !failed());
    if (polling) {
      sched_yield();
      continue;
    }
    ++sleeps;
    if (under_way) {
      std::lock_guard<std::mutex> lock(stats_mu_);
      ++stats_.sleeps_under_way;
    }
    if (sleep_unless_woken(sleep_us, wakes_seen)) {
      std::lock_guard<std::mutex> lock(stats_mu_);  // counted at once: it follows a sleep, so it is rare
      ++stats_.woken;
      continue;  // the next round counts the wake as progress
    }
    const double cap = failed() || idle_us > o_.idle_ms * 1e3 ? o_.idle_sleep_us : o_.max_sleep_us;
    sleep_us = std::min(sleep_us * 2, cap);
    if ((polls & 1023) == 0) {
      std::lock_guard<std::mutex> lock(stats_mu_);
      stats_.polls = polls;
      stats_.sleeps = sleeps;
    }
  }
  engine.hold_progress(false);
  std::lock_guard<std::mutex> lock(stats_mu_);
  stats_.polls = polls;
  stats_.sleeps = sleeps;
}

}  // namespace a2a::proxy
