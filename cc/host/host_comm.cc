#include "host/host_comm.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

#include <chrono>
#include <thread>

#include "core/fp8.h"
#include "core/registry.h"
#include "host/pack.h"
#include "host/staged_rows.h"
#include "core/ctrl.h"
#include "proxy/gdrcopy.h"
#include "proxy/proxy.h"
#include "transfer/post_timeout.h"
#include "transfer/errors.h"
#include "transfer/imm.h"
#include "core/env.h"

namespace a2a::host {

using protocol::kCombineRecv;
using protocol::kCombineSend;
using protocol::kDispatchRecv;
using protocol::kDispatchSend;
using proxy::RowBuffer;
using transfer::Bytes;
using transfer::format;

HostOptions host_options(const Config& c) {
  HostOptions o;
  static_cast<TransportOptions&>(o) = transport_options(c);
  o.shape = shape_of(c);
  o.wire = c.dispatch_dtype;
  o.pow2_scale = c.pow2_scale;
  o.proxied = c.proxied;
  return o;
}

namespace {

protocol::ExchangeOptions exchange_options(const HostOptions& o) {
  protocol::ExchangeOptions x;
  static_cast<TransportOptions&>(x) = o;
  x.shape = o.shape;
  if (!o.proxied) x.node_size = 0;  // 0: every pair, ourselves included, through the engine
  return x;
}

// Recovery immediates (tags past the protocol's 0..127): the epoch tables, then "stale arrivals dropped".
constexpr uint32_t kRecoverTable = 200, kRecoverDone = 201;
int recover_words(int slots) { return 1 + 2 * slots; }

}  // namespace

std::vector<std::pair<std::string, int64_t>> buffer_regions(const Config& c) {
  const HostOptions o = host_options(c);
  const SlotLayout lay(exchange_options(o));
  const int64_t z = o.slots;
  return {{"dispatch_recv_counts", z * lay.counts_bytes},
          {"dispatch_recv_private_rows", z * lay.over_off},
          {"dispatch_recv_overflow_rows", z * (lay.d_recv_bytes - lay.over_off)},
          {"dispatch_send_counts", z * lay.counts_send_bytes},
          {"dispatch_send_rows", z * lay.d_send_bytes},
          {"combine_send_rows", z * lay.c_send_bytes},
          {"combine_recv_rows", z * lay.c_recv_bytes}};
}

// What node-local peers write straight into us (the stand-in of the cuda backend's IPC buffers),
// with epoch + 1 flags like cuda::SyncFlags: arrived[s] (s wrote), free[r] (r read our rows there).
struct RankComm::Local {
  std::vector<uint8_t> rows;     // [N src][P][row]
  std::vector<int32_t> counts;   // [N src][L]
  std::vector<uint8_t> c_rows;   // [tp member][Q][c_row], as c_recv (protocol/exchange.h)
  std::vector<uint64_t> d_arrived, d_free, c_arrived, c_free;  // [N]
};

struct RankComm::Slot {
  uint32_t d_epoch = 0, c_epoch = 0;
  SendPlan plan;  // from the last dispatch_send
  std::vector<uint8_t> pack_cache, pack_filled;  // RowPacker's per-token rows, reused per dispatch
  std::vector<int64_t> over_base;                // [N] inline mode: from Exchange::overflow_bases
  std::vector<uint8_t> c_written;                // [N * P] combine_send: the rows it wrote, reused per combine
};

RankComm::RankComm(const HostOptions& o, int rank, std::shared_ptr<transfer::Engine> engine)
    : o_(o), rank_(rank) {
  const protocol::ExchangeOptions xo = exchange_options(o);
  const SlotLayout lay(xo);
  std::vector<protocol::SlotBuffers> bufs;
  for (int z = 0; z < o.slots; ++z) {
    protocol::SlotBuffers b{};
    for (auto [ptr, bytes] : {std::pair<uint8_t**, int64_t>{&b.counts_send, lay.counts_send_bytes},
                              {&b.counts_recv, lay.counts_bytes}, {&b.d_send, lay.d_send_bytes},
                              {&b.d_recv, lay.d_recv_bytes}, {&b.c_send, lay.c_send_bytes},
                              {&b.c_recv, lay.c_recv_bytes}}) {
      storage_.emplace_back(bytes, 0);
      *ptr = storage_.back().data();
    }
    bufs.push_back(b);
    slots_.push_back(std::make_unique<Slot>());
    slots_.back()->over_base.assign(o.shape.N, 0);
  }
  ex_ = std::make_unique<protocol::Exchange>(xo, rank, std::move(engine), bufs);
  const int W = recover_words(o.slots);
  recov_in_.assign(int64_t(o.shape.N) * W, 0);
  recov_out_.assign(W, 0);
  recov_in_reg_ = ex_->engine().register_memory(recov_in_.data(), recov_in_.size() * 4);
  recov_out_reg_ = ex_->engine().register_memory(recov_out_.data(), recov_out_.size() * 4);
  if (o.node_size < 0 || (o.node_size > 0 && !o.proxied))
    throw std::invalid_argument("host backend: node_size needs proxied=True (and must be >= 0)");
  for (int z = 0; z < o.slots && o.node_size > 0; ++z) {
    const int N = o.shape.N;
    auto l = std::make_unique<Local>();
    l->rows.assign(int64_t(N) * lay.P * lay.row, 0);
    l->counts.assign(int64_t(N) * o.shape.L, 0);
    l->c_rows.assign(int64_t(o.shape.tp) * lay.Q * lay.c_row_stride_max, 0);
    for (auto* f : {&l->d_arrived, &l->d_free, &l->c_arrived, &l->c_free}) f->assign(N, 0);
    local_.push_back(std::move(l));
  }
  recv_pause_s_ = env::get_double("JAX_MOE_A2A_HOST_RECV_PAUSE_S", 0);
  pack_pause_s_ = env::get_double("JAX_MOE_A2A_HOST_PACK_PAUSE_S", 0);
  if (o.proxied) {
    if (o.shape.N > proxy::kMaxRanks) throw std::invalid_argument("host backend: proxied mode supports at most 64 ranks");
    proxy_opts_ = proxy::ProxyOptions::from_env(0);  // here, not in connect(): see proxy_opts_
    ctrl_ = std::make_unique<proxy::Ctrl>();
    in_ = ctrl_.get();
    // JAX_MOE_A2A_HOST_FLAG_MIRROR=1 (tests): the proxy also stores its flags into a second block,
    // as it does into GPU memory under GDRCopy, and we read them only there (tests/test_gdrcopy.py).
    const char* m = env::get("JAX_MOE_A2A_HOST_FLAG_MIRROR");
    if (m && std::string(m) == "1") {
      mirror_ = std::make_unique<proxy::Ctrl>();
      in_ = mirror_.get();
    }
  }
  const char* env_staged = env::get("JAX_MOE_A2A_HOST_STAGED");
  const bool staged = o.proxied && env_staged && std::string(env_staged) == "1";
  std::vector<proxy::StagedSlot> copies;
  for (const protocol::SlotBuffers& b : bufs) {
    proxy::StagedSlot c = proxy::staged_slot(b, lay);
    for (int i = 0; staged && i < proxy::kRowBuffers; ++i) {
      storage_.emplace_back(c.bytes[i], 0);
      c.packer[i] = storage_.back().data();
    }
    rows_.push_back(c.packer);
    copies.push_back(c);
  }
  if (staged)
    staging_ = std::make_unique<StagedRows>(std::move(copies), env::get_double("JAX_MOE_A2A_HOST_COPY_PAUSE_S", 0));
}

RankComm::~RankComm() {
  stop();
  for (auto* r : {&recov_in_reg_, &recov_out_reg_})
    if (*r) (*r)->close();
}

std::vector<Bytes> RankComm::descriptors() const {
  std::vector<Bytes> out = ex_->descriptors();
  out.push_back(recov_in_reg_->descriptor());
  return out;
}

void RankComm::drain() {
  if (!connected_) return;
  for (int z = 0; z < o_.slots; ++z) {
    const Slot& sl = *slots_[z];
    if (o_.proxied) {
      wait_flag(&in_->slot[z].d_send_ok, uint64_t(sl.d_epoch) + 1, kDispatchSend, z, -1, /*timed=*/false);
      wait_flag(&in_->slot[z].c_send_ok, uint64_t(sl.c_epoch) + 1, kCombineSend, z, -1, /*timed=*/false);
    } else {
      ex_->wait(ex_->expect_all_owed(z), kDispatchSend, z, "closing: waiting for peers to free the slot");
      ex_->forget_owed(z);
    }
  }
  engine().flush(o_.timeout_s);
}

void RankComm::stop() {
  if (proxy_) proxy_->stop();
}

proxy::ProxyStats RankComm::proxy_stats() const {
  if (!proxy_) return proxy::ProxyStats{};
  proxy::ProxyStats s = proxy_->stats();
  for (int i = 0; i < 4; ++i) {
    s.packer_call_ns[i] = __atomic_load_n(&op_ns_[i], __ATOMIC_RELAXED);
    s.packer_wait_ns[i] = __atomic_load_n(&wait_ns_[i], __ATOMIC_RELAXED);
  }
  s.recv_early = __atomic_load_n(&recv_early_, __ATOMIC_RELAXED);
  return s;
}

// Proxied mode: adds the call's time to op_ns_[op] (its waits add themselves to wait_ns_[op]:
// wait_flag). Holds no state in the RankComm, so that calls of different ops may overlap.
struct RankComm::OpTimer {
  RankComm& c;
  int op;  // the op's index in op_ns_ (protocol::Op)
  std::chrono::steady_clock::time_point t0;
  OpTimer(RankComm& comm, int o) : c(comm), op(o), t0(std::chrono::steady_clock::now()) {}
  ~OpTimer() {
    if (!c.o_.proxied) return;
    const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
    __atomic_fetch_add(&c.op_ns_[op], uint64_t(ns), __ATOMIC_RELAXED);
  }
};

RankComm::Local& RankComm::local(int z) const { return *local_[z]; }

std::map<int, std::vector<Bytes>> RankComm::exchange_descriptors(const std::map<int, std::vector<Bytes>>& descs) const {
  std::map<int, std::vector<Bytes>> out;
  for (const auto& [r, ds] : descs) {
    const size_t want = ex_->descriptor_count() + 1;  // + the recovery table
    if (ds.size() != want)
      throw std::invalid_argument(format("jax_moe_a2a: rank %d sent %zu descriptors, expected %zu", r, ds.size(), want));
    out[r] = std::vector<Bytes>(ds.begin(), ds.end() - 1);
  }
  return out;
}

void RankComm::check_peers(const std::map<int, std::vector<Bytes>>& descs) const {
  ex_->check_peers(exchange_descriptors(descs));
}

void RankComm::connect(const std::map<int, std::vector<Bytes>>& descs, const std::map<int, RankComm*>& locals) {
  for (int r = 0; r < o_.shape.N && !local_.empty(); ++r) {
    if (!on_node(r)) continue;
    auto it = locals.find(r);
    if (it == locals.end())
      throw std::invalid_argument(format("host backend: node_size %d puts rank %d on rank %d's node, but it lives in "
                                         "another process (the proxied mode needs a node's ranks in one process)",
                                         o_.node_size, r, rank_));
    node_[r] = it->second;
  }
  const std::map<int, std::vector<Bytes>> ex_descs = exchange_descriptors(descs);
  recov_peer_.resize(o_.shape.N);
  for (const auto& [r, ds] : descs)
    if (r >= 0 && r < o_.shape.N) recov_peer_[r] = engine().remote(ds.back());
  ex_->connect(ex_descs);
  if (o_.proxied) {
    // No GPU memory here: the flags stay in our (CPU) Ctrl block. Say why, as the cuda backend
    // does: GDRCopy's probe reason where it is missing (tests/test_gdrcopy.py checks it on CPUs).
    proxy::FlagPath flags;
    const proxy::gdr::Probe pr = proxy::gdr::probe_from_env();
    flags.name = proxy::gdr::mapped_host(pr.available ? "host backend (GDRCopy needs GPU memory)" : pr.reason);
    if (mirror_) {
      flags.mirror = mirror_.get();
      flags.name = "host-mirror: the proxy's flags read from a second block (JAX_MOE_A2A_HOST_FLAG_MIRROR=1)";
    }
    proxy::ProxyOptions po = proxy_opts_;
    po.source_flags = true;  // dispatch_recv and combine_recv read them (per_source_)
    per_source_ = po.pipeline && !mirror_;
    proxy_ = std::make_unique<proxy::Proxy>(*ex_, ctrl_.get(), po, flags, staging_.get());
  }
  connected_ = true;
}

void RankComm::raise(uint64_t* flag, uint64_t value) {
  proxy::store_release(flag, value);
  if (proxy_) proxy_->wake();  // the proxy sees the flag now, not after its idle sleep
}

std::vector<uint8_t> RankComm::use_mask(int z, const int32_t* alive, int op) {
  const int N = o_.shape.N;
  std::vector<uint8_t> m(N, 1);
  bool all = true;
  for (int r = 0; alive && r < N; ++r) {
    m[r] = alive[r] != 0;
    all = all && m[r];
  }
  if (!all && (o_.proxied || !node_.empty()))
    throw std::invalid_argument(format("host %s (rank %d): rank_mask needs the inline mode (proxied=False): the proxy "
                                       "thread waits for every rank", protocol::op_name(op), rank_));
  ex_->set_alive(z, m);
  return m;
}

void RankComm::wait_flag(const uint64_t* flag, uint64_t want, int op, int slot, int peer, bool timed) {
  using Clock = std::chrono::steady_clock;
  if (peer < 0) raise(&ctrl_->slot[slot].waiting[op], want);
  const double limit = peer < 0 ? o_.timeout_s + 5 : o_.timeout_s;
  const auto t0 = Clock::now();
  struct Add {  // the wait's time into wait_ns_[op], however it ends
    uint64_t* sum;  // null: not timed
    Clock::time_point t0;
    ~Add() {
      if (sum)
        __atomic_fetch_add(sum, uint64_t(std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count()),
                           __ATOMIC_RELAXED);
    }
  } add{timed ? &wait_ns_[op] : nullptr, t0};
  double sleep_us = 1;
  for (uint64_t i = 0;; ++i) {
    if (proxy::load_acquire(flag) >= want) return;
    if (proxy::error_code(in_) != 0) throw std::runtime_error(proxy_->error_text());
    const double waited = std::chrono::duration<double>(Clock::now() - t0).count();
    if (waited > limit && peer < 0)  // the proxy names missing ranks after timeout_s; this is the backstop
      throw std::runtime_error(format("jax_moe_a2a host %s (slot %d, rank %d): the proxy thread raised no flag "
                                      "within %.1f s", protocol::op_name(op), slot, rank_, waited));
    if (waited > limit)
      throw transfer::TimeoutError(format("jax_moe_a2a %s (node-local; slot %d, rank %d): ranks [%d] did not arrive "
                                          "within %.1f s", protocol::op_name(op), slot, rank_, peer, o_.timeout_s),
                                   0, 1, {peer});
    if (waited < 20e-6) continue;
    std::this_thread::sleep_for(std::chrono::duration<double, std::micro>(sleep_us));
    sleep_us = std::min(sleep_us * 2, 50.0);
  }
}

// ---- dispatch --------------------------------------------------------------------------------

void RankComm::dispatch_send(const DispatchSendArgs& a) {
  OpTimer timer(*this, kDispatchSend);
  Slot& sl = *slots_[a.slot];
  const MoeShape& s = o_.shape;
  const SlotLayout& lay = ex_->layout();
  const protocol::SlotBuffers& buf = ex_->buffers(a.slot);
  const int N = s.N, L = s.L, K = s.K, T = s.T;
  const uint32_t e = sl.d_epoch;
  const std::vector<uint8_t> alive = use_mask(a.slot, a.alive, kDispatchSend);
  const bool me = alive[rank_];  // a masked rank (still running) touches no peer
  if (o_.proxied) {
    wait_flag(&in_->slot[a.slot].d_send_ok, e + 1, kDispatchSend, a.slot);
  } else if (me) {
    // From each live rank the FREE_D it owes us: e - 1, or under a mask that of the last dispatch
    // of this slot both of us took part in (it may still be reading that one: exchange.h)
    ex_->wait(ex_->expect_owed_free_d(a.slot), kDispatchSend, a.slot, "waiting for peers to free the slot");
    engine().flush(o_.timeout_s);  // our previous writes from this slot's send buffer are done
    ex_->owe_free_d(a.slot, e);
  }

  sl.plan = plan_sends(s, rank_, a.ids, a.num_tokens);
  const SendPlan& p = sl.plan;
  std::memcpy(a.dest, p.dest.data(), sizeof(int32_t) * T * K);
  std::memcpy(a.pair_slot, p.comb_slot.data(), sizeof(int32_t) * T * K);  // the compact combine index
  *a.dropped = p.dropped;
  a.handle[0] = static_cast<int32_t>(e);
  a.handle[1] = a.slot;

  // Node-local peers must be done with our previous epoch before our counts go out: the proxy
  // writes our count matrix into every rank's d_recv, node-local ones included, and a node-local
  // peer's proxy reads it there (post_overflow, overflow_bases) until its d_landed, which precedes
  // its d_free. FREE_D covers remote ranks only (the cuda kernels wait the same way).
  for (auto [d, peer] : node_) wait_flag(&local(a.slot).d_free[d], e, kDispatchSend, a.slot, d);
  // Our count matrix [N][L] goes to its own buffer, the rows to d_send.
  std::memcpy(buf.counts_send, p.counts.data(), sizeof(int32_t) * N * L);
  if (o_.proxied) raise(&ctrl_->slot[a.slot].d_counts, e + 1);
  else if (me) ex_->post_counts(a.slot, e);
  RowPacker packer(o_, a.x, a.x_kind, a.x_scale, sl.pack_cache, sl.pack_filled);
  for (int d = 0; d < N; ++d) {
    uint8_t* base = rows(a.slot, RowBuffer::kDSend) + int64_t(d) * lay.P * lay.row;
    for (size_t j = 0; j < p.order[d].size(); ++j) {
      const auto [t, k] = p.order[d][j];
      packer.pack(t, a.weights[int64_t(t) * K + k], base + int64_t(j) * lay.row);
    }
    // Its rows are in d_send: the proxy may write them to d now, while we pack the next peer's.
    if (o_.proxied && ex_->remote(rank_, d)) {
      raise(&ctrl_->slot[a.slot].d_packed_to[d], e + 1);
      if (pack_pause_s_ > 0 && d + 1 < N)  // tests
        std::this_thread::sleep_for(std::chrono::duration<double>(pack_pause_s_));
    }
  }
  for (auto [d, peer] : node_) {  // node-local destinations: straight into their memory
    Local& there = peer->local(a.slot);
    std::memcpy(&there.rows[int64_t(rank_) * lay.P * lay.row], rows(a.slot, RowBuffer::kDSend) + int64_t(d) * lay.P * lay.row,
                int64_t(p.rows_to[d]) * lay.row);
    std::memcpy(&there.counts[int64_t(rank_) * L], &p.counts[int64_t(d) * L], sizeof(int32_t) * L);
    raise(&there.d_arrived[rank_], e + 1);
  }
  if (o_.proxied) raise(&ctrl_->slot[a.slot].d_packed, e + 1);
  else if (me) ex_->post_private(a.slot, e);
  sl.d_epoch = e + 1;
}

void RankComm::dispatch_recv(const DispatchRecvArgs& a) {
  OpTimer timer(*this, kDispatchRecv);
  Slot& sl = *slots_[a.slot];
  const MoeShape& s = o_.shape;
  const int N = s.N, L = s.L;
  const uint32_t e = static_cast<uint32_t>(a.handle[0]);
  if (a.handle[1] != a.slot) throw std::invalid_argument("host dispatch_recv: handle from another slot");
  const int64_t* over_base = sl.over_base.data();
  const std::vector<uint8_t> alive = use_mask(a.slot, a.alive, kDispatchRecv);
  const bool me = alive[rank_];
  if (o_.proxied && per_source_) {  // the offsets now, each source's rows as they land (below)
    wait_flag(&ctrl_->slot[a.slot].d_placed, e + 1, kDispatchRecv, a.slot);
    over_base = ctrl_->slot[a.slot].over_base;
  } else if (o_.proxied) {
    wait_flag(&in_->slot[a.slot].d_landed, e + 1, kDispatchRecv, a.slot);
    over_base = in_->slot[a.slot].over_base;
  } else if (me) {
    ex_->wait(ex_->expect_counts(a.slot, e), kDispatchRecv, a.slot, "route counts");
    ex_->post_overflow(a.slot, e);
    ex_->wait(ex_->expect_rows(a.slot, e), kDispatchRecv, a.slot, "private and overflow rows");
    ex_->overflow_bases(a.slot, sl.over_base.data());
  }
  // Inline mode: the combine offsets' snapshot (the proxy takes it at its "counts in" step), before
  // FREE_D lets the sources overwrite their count matrices; zeros when we are masked.
  if (!o_.proxied) ex_->take_combine_offsets(a.slot);
  if (recv_pause_s_ > 0) std::this_thread::sleep_for(std::chrono::duration<double>(recv_pause_s_));  // tests

  for (auto [s, peer] : node_) wait_flag(&local(a.slot).d_arrived[s], e + 1, kDispatchRecv, a.slot, s);
  std::vector<int32_t> to_me(int64_t(N) * L);
  for (int src = 0; src < N; ++src) {
    if (!me || !alive[src]) continue;  // nothing from a masked rank (its counts are stale), nothing to a masked one
    std::memcpy(&to_me[int64_t(src) * L],
                node_.count(src) ? &local(a.slot).counts[int64_t(src) * L] : ex_->counts_of(a.slot, src) + int64_t(rank_) * L,
                sizeof(int32_t) * L);
  }
  RecvArrangement arr(s, to_me.data());
  const int64_t R = s.recv_rows_total();
  std::fill(a.weights, a.weights + R, 0.0f);
  std::fill(a.src, a.src + 2 * R, -1);
  std::fill(a.recv_slot, a.recv_slot + R, -1);
  RowUnpacker unpacker(o_, a.x, a.scale);
  for (int src = 0; src < N; ++src) {
    a.recv_counts[src] = arr.rows_from(src);
    // Pipelined: src's rows have landed (the rest may still be in flight). Positions depend on the
    // counts only, so the outputs are the same in any landing order.
    if (o_.proxied && per_source_ && ex_->remote(rank_, src) && arr.rows_from(src) > 0) {
      wait_flag(&ctrl_->slot[a.slot].d_landed_from[src], e + 1, kDispatchRecv, a.slot);
      if (proxy::load_acquire(&ctrl_->slot[a.slot].d_landed) < uint64_t(e) + 1)  // others still in flight
        __atomic_fetch_add(&recv_early_, uint64_t(1), __ATOMIC_RELAXED);
    }
    for (int l = 0; l < L; ++l) {
      const int32_t n = to_me[int64_t(src) * L + l];
      for (int i = 0; i < n; ++i) {
        const int64_t pos = arr.position(src, l, i);
        if (pos < 0) continue;
        const int32_t j = arr.src_expert_start(src, l) + i;
        int32_t tok;
        const SlotLayout& lay = ex_->layout();
        const uint8_t* row = node_.count(src) ? &local(a.slot).rows[(int64_t(src) * lay.P + j) * lay.row]
                                              : rows(a.slot, RowBuffer::kDRecv) + ex_->landed_offset(src, j, over_base[src]);
        a.weights[pos] = unpacker.unpack(row, pos, &tok);
        a.src[2 * pos] = src;
        a.src[2 * pos + 1] = tok;
        a.recv_slot[pos] = j;
      }
    }
  }
  for (int l = 0; l < L; ++l) a.group_sizes[l] = arr.group_size(l);
  *a.overflow = static_cast<int32_t>(arr.overflow());
  for (auto [s, peer] : node_) raise(&peer->local(a.slot).d_free[rank_], e + 1);
  if (o_.proxied) raise(&ctrl_->slot[a.slot].d_consumed, e + 1);
  else if (me) ex_->signal_free_d(a.slot, e);
}

// ---- combine ---------------------------------------------------------------------------------

void RankComm::combine_send(const CombineSendArgs& a) {
  OpTimer timer(*this, kCombineSend);
  Slot& sl = *slots_[a.slot];
  const MoeShape& s = o_.shape;
  const int N = s.N;
  const int P = ex_->layout().P, Q = ex_->layout().Q;
  uint8_t* c_send = rows(a.slot, RowBuffer::kCSend);
  const uint32_t e = sl.c_epoch;
  const std::vector<uint8_t> alive = use_mask(a.slot, a.alive, kCombineSend);
  const bool me = alive[rank_];
  if (o_.proxied) {
    wait_flag(&in_->slot[a.slot].c_send_ok, e + 1, kCombineSend, a.slot);
  } else if (me) {
    ex_->wait(ex_->expect_owed_free_c(a.slot), kCombineSend, a.slot, "waiting for peers to free the slot");
    engine().flush(o_.timeout_s);
    ex_->owe_free_c(a.slot, e);
  }
  // The rows go back at the offsets of their dispatch, which may have run on another slot: inline,
  // this slot's snapshot becomes that dispatch's here; proxied, the proxy adopts it (c_from_slot).
  if (!o_.proxied) ex_->adopt_combine_offsets(a.slot, a.from_slot);
  const int64_t stride = int64_t(s.H) * elem_bytes(a.y_kind);
  for (int src = 0; src < N; ++src)
    if (a.recv_counts[src] < 0 || a.recv_counts[src] > P)
      throw std::invalid_argument(format("host combine_send: %d rows from rank %d (at most %d): routing arrays "
                                         "corrupted", a.recv_counts[src], src, P));
  const int64_t R = s.recv_rows_total();
  const uint8_t* y = static_cast<const uint8_t*>(a.y);
  std::vector<uint8_t>& written = sl.c_written;  // the slot's: two slots' sends may run at once
  written.assign(int64_t(N) * P, 0);
  for (int64_t pos = 0; pos < R; ++pos) {
    const int32_t src = a.recv_src[pos * a.recv_src_stride];
    if (src < 0) continue;
    const int32_t j = a.recv_slot[pos];
    if (src >= N || j < 0 || j >= P || j >= a.recv_counts[src])
      throw std::invalid_argument(format("host combine_send: routing arrays corrupted at row %lld", (long long)pos));
    std::memcpy(c_send + (int64_t(src) * P + j) * stride, y + pos * stride, stride);
    written[int64_t(src) * P + j] = 1;
  }
  // Rows a source sent that we dropped (over capacity) go back as zeros: only those are cleared
  // (clearing every row first wrote the combine's bytes twice).
  for (int src = 0; src < N; ++src)
    for (int32_t j = 0; j < a.recv_counts[src]; ++j)
      if (!written[int64_t(src) * P + j]) std::memset(c_send + (int64_t(src) * P + j) * stride, 0, stride);
  // Node-local ranks: every member j of m's tp group gets source g0 + j's run at its combine
  // offset (the Exchange's snapshot of this dispatch), as post_combine writes remote ones.
  const int64_t* off = ex_->combine_offsets(a.from_slot);  // not replaced before our next dispatch_recv there
  for (auto [m, peer] : node_) {
    wait_flag(&local(a.slot).c_free[m], e, kCombineSend, a.slot, m);
    Local& there = peer->local(a.slot);
    const int g0 = m / s.tp * s.tp;
    for (int j = 0; j < s.tp; ++j) {
      const int src = g0 + j;
      if (off[src] + a.recv_counts[src] > Q)
        throw std::invalid_argument(format("host combine_send: %d rows from rank %d at combine offset %lld (offset + "
                                           "rows at most %d)", a.recv_counts[src], src, (long long)off[src], Q));
      std::memcpy(&there.c_rows[(int64_t(j) * Q + off[src]) * stride], c_send + int64_t(src) * P * stride,
                  int64_t(a.recv_counts[src]) * stride);
    }
    raise(&there.c_arrived[rank_], e + 1);
  }
  if (o_.proxied) {
    proxy::SlotCtrl& c = ctrl_->slot[a.slot];
    std::memcpy(c.rows_from, a.recv_counts, sizeof(int32_t) * N);
    c.c_stride = stride;
    c.c_from_slot = a.from_slot;
    raise(&c.c_packed, e + 1);
  } else if (me) {
    ex_->post_combine(a.slot, e, a.recv_counts, stride);
  }
  a.handle[0] = static_cast<int32_t>(e);
  a.handle[1] = a.slot;
  sl.c_epoch = e + 1;
}

void RankComm::combine_recv(const CombineRecvArgs& a) {
  OpTimer timer(*this, kCombineRecv);
  const MoeShape& s = o_.shape;
  const int N = s.N, K = s.K, T = s.T, H = s.H, tp = s.tp;
  const int Q = ex_->layout().Q;
  const uint8_t* c_recv = rows(a.slot, RowBuffer::kCRecv);
  const uint32_t e = static_cast<uint32_t>(a.handle[0]);
  if (a.handle[1] != a.slot) throw std::invalid_argument("host combine_recv: handle from another slot");
  const std::vector<uint8_t> alive = use_mask(a.slot, a.alive, kCombineRecv);
  const bool me = alive[rank_];
  // Pipelined (per_source_): no wait for every rank here; each token waits below for the ranks
  // its rows come from, the first time one is needed, so the reduction runs while later ranks'
  // rows are in flight, in the same order (token, k) as ever.
  if (o_.proxied && !per_source_) wait_flag(&in_->slot[a.slot].c_landed, e + 1, kCombineRecv, a.slot);
  else if (!o_.proxied && me) ex_->wait(ex_->expect_comb(a.slot, e), kCombineRecv, a.slot, "expert outputs");
  uint64_t landed = 0;  // per_source_: bit d, rank d's rows are here
  for (auto [d, peer] : node_) wait_flag(&local(a.slot).c_arrived[d], e + 1, kCombineRecv, a.slot, d);
  const int64_t stride = int64_t(H) * elem_bytes(a.y_kind);
  std::vector<float> acc(H);
  const int n = std::max(0, std::min(a.num_tokens, T));
  if (a.pairs) std::fill(a.pairs, a.pairs + int64_t(T) * K * H, 0.0f);
  for (int t = 0; t < T; ++t) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    if (t < n) {
      for (int k = 0; k < K; ++k) {
        const int64_t pk = int64_t(t) * K + k;
        const int d = a.dest[pk];
        if (d < 0 || d >= N || !me || !alive[d]) continue;  // masked: nothing came (the send stopped it)
        const int32_t j = a.pair_slot[pk];  // the compact index: sender's combine offset for d + slot
        if (j < 0 || j >= Q) throw std::invalid_argument("host combine_recv: routing arrays corrupted");
        if (per_source_ && o_.proxied && !(landed >> d & 1) && ex_->remote(rank_, d)) {
          wait_flag(&ctrl_->slot[a.slot].c_landed_from[d], e + 1, kCombineRecv, a.slot);
          landed |= 1ull << d;
        }
        const int64_t at = (int64_t(t % tp) * Q + j) * stride;
        const uint8_t* row = node_.count(d) ? &local(a.slot).c_rows[at] : c_recv + at;
        const float w = a.weights[pk];
        accumulate_row(acc.data(), row, a.y_kind, H, w);
        if (a.pairs) accumulate_row(a.pairs + pk * H, row, a.y_kind, H, 1.0f);
      }
    }
    if (a.out_in) add_row(acc.data(), a.out_in, int64_t(t) * H, a.out_in_kind, H);
    store_row(a.out, int64_t(t) * H, a.out_kind, acc.data(), H);
  }
  for (auto [d, peer] : node_) raise(&peer->local(a.slot).c_free[rank_], e + 1);
  if (o_.proxied) raise(&ctrl_->slot[a.slot].c_consumed, e + 1);
  else if (me) ex_->signal_free_c(a.slot, e);
}

// ---- recovery after a peer failure (docs/protocol.md "Recovery") ---------------------------------

void RankComm::recover_flush() {
  // Our writes of the failed step: those to survivors complete; those to a dead peer complete with
  // an error (dropped here: that peer is gone) or, on some providers, never (then we cannot reuse
  // our send buffers: refuse, naming the count).
  for (int attempt = 0; attempt < 2; ++attempt) {
    try {
      engine().flush(o_.timeout_s);
      return;
    } catch (const transfer::TimeoutError& e) {
      throw transfer::TimeoutError(format("jax_moe_a2a recover (rank %d): %s; writes to a dead peer never "
                                          "completed, the communicator cannot be recovered (create a new one)",
                                          rank_, e.what()),
                                   e.arrived, e.expected, e.missing);
    } catch (const transfer::TransferError&) {
      // completion errors (writes to the dead peer): dropped; flush again for what is still in flight
    }
  }
}

void RankComm::recover_post(const std::vector<uint8_t>& alive, uint32_t gen) {
  const int W = recover_words(o_.slots);
  recov_out_[0] = gen;
  for (int z = 0; z < o_.slots; ++z) {
    recov_out_[1 + 2 * z] = slots_[z]->d_epoch;
    recov_out_[2 + 2 * z] = slots_[z]->c_epoch;
  }
  const uint32_t imm = transfer::pack_imm(kRecoverTable, gen & transfer::kImmMaxEpoch, rank_);
  for (int r = 0; r < o_.shape.N; ++r)
    if (alive[r])
      recover_write(r, 0, [&] {
        engine().write(r, *recov_out_reg_, 0, uint64_t(W) * 4, &recov_peer_[r], uint64_t(rank_) * W * 4, imm);
      });
}

void RankComm::recover_write(int r, int phase, const std::function<void()>& write) {
  // A rank left in the mask whose process is gone may take no writes (over tcp;ofi_rxm the post
  // stays at -FI_EAGAIN): within timeout_s that is the same mistake as a rank that never joins.
  transfer::PostTimeout bound(o_.timeout_s);
  try {
    write();
  } catch (const transfer::TimeoutError& e) {
    throw transfer::TimeoutError(
        format("jax_moe_a2a recover (rank %d, %s): ranks [%d] did not join the recovery within %.1f s (our write "
               "to it was not taken: %s): rank_mask must mask every dead rank, and every survivor must call "
               "recover() with the same mask",
               rank_, phase ? "barrier" : "epoch exchange", r, o_.timeout_s, e.what()),
        e.arrived, e.expected, {r});
  }
}

void RankComm::recover_wait(const std::vector<uint8_t>& alive, uint32_t gen, int phase) {
  std::vector<int> ranks;
  for (int r = 0; r < o_.shape.N; ++r)
    if (alive[r]) ranks.push_back(r);
  try {
    engine().wait_ranks(phase ? kRecoverDone : kRecoverTable, gen & transfer::kImmMaxEpoch, ranks, o_.timeout_s);
  } catch (const transfer::TimeoutError& e) {
    throw transfer::TimeoutError(
        format("jax_moe_a2a recover (rank %d, %s): ranks [%s] did not join the recovery within %.1f s: "
               "rank_mask must mask every dead rank, and every survivor must call recover() with the same mask",
               rank_, phase ? "barrier" : "epoch exchange", transfer::join_ranks(e.missing).c_str(), o_.timeout_s),
        e.arrived, e.expected, e.missing);
  }
}

void RankComm::recover_apply(const std::vector<uint8_t>& alive, uint32_t gen) {
  const int W = recover_words(o_.slots);
  for (int r = 0; r < o_.shape.N; ++r)
    if (alive[r] && recov_in_[int64_t(r) * W] != gen)
      throw std::runtime_error(format("jax_moe_a2a recover (rank %d): rank %d is at recovery %u, we are at %u "
                                      "(every survivor must call recover() the same number of times)",
                                      rank_, r, recov_in_[int64_t(r) * W], gen));
  // Every survivor has flushed its writes of the failed step (it posted its table after its
  // flush): what they left in our counters is stale. Drop every protocol arrival (tags < 128),
  // and recovery arrivals of other generations.
  const uint32_t g = gen & transfer::kImmMaxEpoch;
  engine().discard_arrivals([g](uint32_t imm) {
    const transfer::ImmFields f = transfer::unpack_imm(imm);
    return f.tag < 128 || ((f.tag == kRecoverTable || f.tag == kRecoverDone) && f.epoch != g);
  });
  for (int z = 0; z < o_.slots; ++z) {
    Slot& sl = *slots_[z];
    uint32_t d = 0, c = 0;
    for (int r = 0; r < o_.shape.N; ++r) {
      if (!alive[r]) continue;
      d = std::max(d, recov_in_[int64_t(r) * W + 1 + 2 * z]);
      c = std::max(c, recov_in_[int64_t(r) * W + 2 + 2 * z]);
    }
    // The survivors' highest epochs: no survivor used them yet, and every arrival of an older
    // epoch was dropped. The first dispatch_send / combine_send waits for no FREE signal (the
    // barrier below stands for them: no survivor reads any slot any more): nobody owes one.
    sl.d_epoch = d;
    sl.c_epoch = c;
    ex_->forget_owed(z);
  }
}

void RankComm::recover_done(const std::vector<uint8_t>& alive, uint32_t gen) {
  const uint32_t imm = transfer::pack_imm(kRecoverDone, gen & transfer::kImmMaxEpoch, rank_);
  for (int r = 0; r < o_.shape.N; ++r)
    if (alive[r]) recover_write(r, 1, [&] { engine().write(r, *recov_out_reg_, 0, 0, nullptr, 0, imm); });
}

// ---- HostComm and the registry ---------------------------------------------------------------

HostComm::HostComm(const HostOptions& o, std::vector<std::shared_ptr<transfer::Engine>> engines,
                   std::vector<int> ranks)
    : o_(o), ranks_(std::move(ranks)) {
  if (engines.size() != ranks_.size()) throw std::invalid_argument("HostComm: one engine per local rank");
  for (size_t i = 0; i < ranks_.size(); ++i)
    comms_[ranks_[i]] = std::make_unique<RankComm>(o, ranks_[i], std::move(engines[i]));
}

RankComm& HostComm::rank(int r) {
  auto it = comms_.find(r);
  if (it == comms_.end()) throw std::invalid_argument(format("host backend: rank %d is not local to this process", r));
  return *it->second;
}

void HostComm::fail(const std::string& why, const std::vector<int>& missing) {
  std::lock_guard<std::mutex> lock(mu_);
  if (failure_.empty()) failure_ = why;
  for (int r : missing)
    if (std::find(missing_.begin(), missing_.end(), r) == missing_.end()) missing_.push_back(r);
  std::sort(missing_.begin(), missing_.end());
}

void HostComm::check_usable() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (!failure_.empty())
    throw std::runtime_error("jax_moe_a2a host communicator is unusable after an earlier failure (after a peer "
                             "failure every survivor calls comm.recover(rank_mask) with the dead ranks masked): " +
                             failure_);
}

std::string HostComm::failure() const {
  std::lock_guard<std::mutex> lock(mu_);
  return failure_;
}

std::vector<int> HostComm::failure_missing() const {
  std::lock_guard<std::mutex> lock(mu_);
  return missing_;
}

void HostComm::recover(const std::vector<uint8_t>& alive) {
  const int N = o_.shape.N;
  if (int(alive.size()) != N)
    throw std::invalid_argument(format("jax_moe_a2a recover: rank_mask of %zu entries (expected %d)", alive.size(), N));
  if (std::none_of(alive.begin(), alive.end(), [](uint8_t a) { return a != 0; }))
    throw std::invalid_argument("jax_moe_a2a recover: every rank is masked");
  for (auto& [r, c] : comms_)
    if (!c->inline_mode())
      throw std::invalid_argument("jax_moe_a2a recover: not supported by the host backend with proxied=True (the "
                                  "proxy thread waits for every rank; rank_mask needs the inline mode)");
  uint32_t gen;
  {
    std::lock_guard<std::mutex> lock(mu_);
    gen = ++generation_;
  }
  std::vector<RankComm*> mine;  // our survivors; a masked local rank takes no part (it touches no peer)
  for (auto& [r, c] : comms_)
    if (alive[r]) mine.push_back(c.get());
  try {
    for (RankComm* c : mine) c->recover_flush();
    for (RankComm* c : mine) c->recover_post(alive, gen);
    for (RankComm* c : mine) c->recover_wait(alive, gen, 0);
    for (RankComm* c : mine) c->recover_apply(alive, gen);
    for (RankComm* c : mine) c->recover_done(alive, gen);
    for (RankComm* c : mine) c->recover_wait(alive, gen, 1);
  } catch (const std::exception& e) {
    std::lock_guard<std::mutex> lock(mu_);
    failure_ = std::string("recover() failed: ") + e.what();
    throw;
  }
  std::lock_guard<std::mutex> lock(mu_);
  failure_.clear();
  missing_.clear();
}

void HostComm::close() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) return;
    closed_ = true;
  }
  // A failed communicator leaves peers mid-protocol: nothing to drain.
  if (failure().empty()) {
    try {
      for (auto& [r, c] : comms_) c->drain();
    } catch (const std::exception&) {
      // a peer never freed (dead, or it never ran the step's receive half): close all the same
    }
  }
  for (auto& [r, c] : comms_) c->stop();  // proxy threads first: they use the engines
  for (auto& [r, c] : comms_) c->engine().close();
}

namespace {
Registry<HostComm>& registry() {
  static Registry<HostComm> r("host");
  return r;
}
}  // namespace

void register_comm(int64_t id, std::shared_ptr<HostComm> comm, int group) {
  registry().add(id, std::move(comm), group);
}
std::shared_ptr<HostComm> find_comm(int64_t id, int group) { return registry().find(id, group); }
void unregister_comm(int64_t id) {
  for (auto& c : registry().remove(id)) c->close();
}

}  // namespace a2a::host
