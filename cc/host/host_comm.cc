#include "host/host_comm.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>

#include "core/fp8.h"
#include "core/registry.h"
#include "host/pack.h"
#include "transfer/errors.h"
#include "transfer/imm.h"

namespace a2a::host {

using transfer::Bytes;
using transfer::format;

namespace {

// Immediate tags: kind * 8 + slot; combine data: 64 + member * 8 + slot.
enum Kind { kCounts = 1, kPriv = 2, kOver = 3, kFreeD = 4, kFreeC = 5, kComb = 8 };

int64_t pad16(int64_t b) { return (b + 15) / 16 * 16; }

}  // namespace

SlotLayout::SlotLayout(const HostOptions& o) {
  const MoeShape& s = o.shape;
  const int N = s.num_ranks, L = s.local_experts();
  P = s.rows_per_peer();
  priv = o.priv_rows < 0 ? P : std::min(o.priv_rows, P);
  row = s.row_bytes();
  counts_bytes = pad16(int64_t(N) * N * L * 4);
  priv_off = counts_bytes;
  over_off = priv_off + int64_t(N) * priv * row;
  d_recv_bytes = over_off + int64_t(N) * (P - priv) * row;
  d_send_rows_off = pad16(int64_t(N) * L * 4);
  d_send_bytes = d_send_rows_off + int64_t(N) * P * row;
  c_row_stride_max = int64_t(s.hidden) * 4;
  c_send_bytes = int64_t(N) * P * c_row_stride_max;
  c_recv_bytes = int64_t(N) * s.tp * P * c_row_stride_max;
}

struct RankComm::Slot {
  std::vector<uint8_t> d_send, d_recv, c_send, c_recv;
  std::shared_ptr<transfer::Region> d_send_r, d_recv_r, c_send_r, c_recv_r;
  std::vector<transfer::RemoteRegion> d_recv_peer, c_recv_peer;  // [N]
  uint32_t d_epoch = 0, c_epoch = 0;
  SendPlan plan;  // from the last dispatch_send, used by dispatch_recv's overflow writes
  std::vector<uint8_t> pack_cache, pack_filled;  // RowPacker's per-token rows, reused per dispatch
};

RankComm::RankComm(const HostOptions& o, int rank, std::shared_ptr<transfer::Engine> engine)
    : o_(o), lay_(o), rank_(rank), engine_(std::move(engine)) {
  if (o.slots < 1 || o.slots > 8) throw std::invalid_argument("host backend: slots must be in [1, 8]");
  if (o.shape.tp < 1 || o.shape.tp > 8) throw std::invalid_argument("host backend: tp_size must be in [1, 8]");
  for (int r = 0; r < o.shape.num_ranks; ++r) all_ranks_.push_back(r);
  for (int z = 0; z < o.slots; ++z) {
    auto s = std::make_unique<Slot>();
    s->d_send.assign(lay_.d_send_bytes, 0);
    s->d_recv.assign(lay_.d_recv_bytes, 0);
    s->c_send.assign(lay_.c_send_bytes, 0);
    s->c_recv.assign(lay_.c_recv_bytes, 0);
    s->d_send_r = engine_->register_memory(s->d_send.data(), s->d_send.size());
    s->d_recv_r = engine_->register_memory(s->d_recv.data(), s->d_recv.size());
    s->c_send_r = engine_->register_memory(s->c_send.data(), s->c_send.size());
    s->c_recv_r = engine_->register_memory(s->c_recv.data(), s->c_recv.size());
    slots_.push_back(std::move(s));
  }
}

RankComm::~RankComm() = default;

std::vector<Bytes> RankComm::descriptors() const {
  std::vector<Bytes> out;
  for (auto& s : slots_) {
    out.push_back(s->d_recv_r->descriptor());
    out.push_back(s->c_recv_r->descriptor());
  }
  return out;
}

void RankComm::connect(const std::map<int, std::vector<Bytes>>& descs) {
  for (int z = 0; z < o_.slots; ++z) {
    slots_[z]->d_recv_peer.resize(o_.shape.num_ranks);
    slots_[z]->c_recv_peer.resize(o_.shape.num_ranks);
  }
  for (int r : all_ranks_) {
    auto it = descs.find(r);
    if (it == descs.end()) throw std::invalid_argument(format("host backend: no descriptors for rank %d", r));
    if (it->second.size() != size_t(2 * o_.slots))
      throw std::invalid_argument(format("host backend: rank %d sent %zu descriptors, expected %d", r,
                                         it->second.size(), 2 * o_.slots));
    for (int z = 0; z < o_.slots; ++z) {
      slots_[z]->d_recv_peer[r] = engine_->remote(it->second[2 * z]);
      slots_[z]->c_recv_peer[r] = engine_->remote(it->second[2 * z + 1]);
      if (slots_[z]->d_recv_peer[r].size < uint64_t(lay_.d_recv_bytes) ||
          slots_[z]->c_recv_peer[r].size < uint64_t(lay_.c_recv_bytes))
        throw std::invalid_argument(format("host backend: rank %d's buffers are smaller than ours (spec mismatch)", r));
    }
  }
  connected_ = true;
}

uint32_t RankComm::imm(int kind, int slot, uint32_t epoch, int sub) const {
  const uint32_t tag = kind == kComb ? 64 + sub * 8 + slot : kind * 8 + slot;
  return transfer::pack_imm(tag, epoch & transfer::kImmMaxEpoch, rank_);
}

void RankComm::wait_all(int kind, int slot, uint32_t epoch, const char* op, int sub) {
  const uint32_t tag = kind == kComb ? 64 + sub * 8 + slot : kind * 8 + slot;
  try {
    engine_->wait_ranks(tag, epoch & transfer::kImmMaxEpoch, all_ranks_, o_.timeout_s);
  } catch (const transfer::TimeoutError& e) {
    throw transfer::TimeoutError(
        format("jax_moe_a2a host %s (slot %d, rank %d): ranks [%s] did not arrive within %.1f s "
               "(crashed process, or calls out of order?) [%s]",
               op, slot, rank_, transfer::join_ranks(e.missing).c_str(), o_.timeout_s, e.what()),
        e.arrived, e.expected, e.missing);
  }
}

void RankComm::signal_all(int kind, int slot, uint32_t epoch) {
  const uint32_t v = imm(kind, slot, epoch);
  for (int r : all_ranks_) engine_->write(r, *slots_[slot]->d_send_r, 0, 0, nullptr, 0, v);
}

// ---- dispatch --------------------------------------------------------------------------------

void RankComm::dispatch_send(const DispatchSendArgs& a) {
  Slot& sl = *slots_[a.slot];
  const MoeShape& s = o_.shape;
  const int N = s.num_ranks, L = s.local_experts(), K = s.topk, T = s.max_tokens;
  const uint32_t e = sl.d_epoch;
  if (e > 0) wait_all(kFreeD, a.slot, e - 1, "dispatch_send (waiting for peers to free the slot)");
  engine_->flush(o_.timeout_s);  // our previous writes from this slot's send buffer are done

  sl.plan = plan_sends(s, rank_, a.ids, a.num_tokens);
  const SendPlan& p = sl.plan;
  std::memcpy(a.dest, p.dest.data(), sizeof(int32_t) * T * K);
  std::memcpy(a.pair_slot, p.slot.data(), sizeof(int32_t) * T * K);
  *a.dropped = p.dropped;
  a.handle[0] = static_cast<int32_t>(e);
  a.handle[1] = a.slot;

  // Our count matrix [N][L] goes at the start of the send buffer, the rows after it.
  std::memcpy(sl.d_send.data(), p.counts.data(), sizeof(int32_t) * N * L);
  RowPacker packer(o_, a.x, a.x_kind, a.x_scale, sl.pack_cache, sl.pack_filled);
  for (int d = 0; d < N; ++d) {
    uint8_t* base = sl.d_send.data() + lay_.d_send_rows_off + int64_t(d) * lay_.P * lay_.row;
    for (size_t j = 0; j < p.order[d].size(); ++j) {
      const auto [t, k] = p.order[d][j];
      packer.pack(t, a.weights[int64_t(t) * K + k], base + int64_t(j) * lay_.row);
    }
  }
  const int64_t cbytes = int64_t(N) * L * 4;
  for (int d = 0; d < N; ++d) {
    engine_->write(d, *sl.d_send_r, 0, cbytes, &sl.d_recv_peer[d], int64_t(rank_) * cbytes,
                   imm(kCounts, a.slot, e));
  }
  for (int d = 0; d < N; ++d) {
    const int64_t rows = std::min(p.rows_to[d], lay_.priv);
    engine_->write(d, *sl.d_send_r, lay_.d_send_rows_off + int64_t(d) * lay_.P * lay_.row, rows * lay_.row,
                   rows ? &sl.d_recv_peer[d] : nullptr, lay_.priv_off + int64_t(rank_) * lay_.priv * lay_.row,
                   imm(kPriv, a.slot, e));
  }
  sl.d_epoch = e + 1;
}

void RankComm::dispatch_recv(const DispatchRecvArgs& a) {
  Slot& sl = *slots_[a.slot];
  const MoeShape& s = o_.shape;
  const int N = s.num_ranks, L = s.local_experts();
  const uint32_t e = static_cast<uint32_t>(a.handle[0]);
  if (a.handle[1] != a.slot) throw std::invalid_argument("host dispatch_recv: handle from another slot");
  wait_all(kCounts, a.slot, e, "dispatch_recv (route counts)");

  // Every source's full count matrix: M[src][d][l].
  const int32_t* M = reinterpret_cast<const int32_t*>(sl.d_recv.data());
  auto rows_between = [&](int src, int d) {
    int64_t n = 0;
    for (int l = 0; l < L; ++l) n += M[(int64_t(src) * N + d) * L + l];
    return n;
  };
  // Our overflow: rows past `priv` go to each destination's overflow region at the exact offset
  // after the overflow of lower-ranked sources. One write per destination (zero-length if none).
  for (int d = 0; d < N; ++d) {
    const int64_t rows = sl.plan.rows_to[d];
    const int64_t over = std::max<int64_t>(0, rows - lay_.priv);
    int64_t off = 0;
    for (int src = 0; src < rank_; ++src) off += std::max<int64_t>(0, rows_between(src, d) - lay_.priv);
    engine_->write(d, *sl.d_send_r, lay_.d_send_rows_off + (int64_t(d) * lay_.P + lay_.priv) * lay_.row,
                   over * lay_.row, over ? &sl.d_recv_peer[d] : nullptr, lay_.over_off + off * lay_.row,
                   imm(kOver, a.slot, e));
  }
  wait_all(kPriv, a.slot, e, "dispatch_recv (private rows)");
  wait_all(kOver, a.slot, e, "dispatch_recv (overflow rows)");

  std::vector<int32_t> to_me(int64_t(N) * L);
  for (int src = 0; src < N; ++src)
    for (int l = 0; l < L; ++l) to_me[int64_t(src) * L + l] = M[(int64_t(src) * N + rank_) * L + l];
  RecvArrangement arr(s, to_me.data());
  const int64_t R = s.recv_rows_total();
  std::fill(a.weights, a.weights + R, 0.0f);
  std::fill(a.src, a.src + 2 * R, -1);
  std::fill(a.recv_slot, a.recv_slot + R, -1);
  RowUnpacker unpacker(o_, a.x, a.scale);
  int64_t over_base = 0;
  for (int src = 0; src < N; ++src) {
    a.recv_counts[src] = arr.rows_from(src);
    for (int l = 0; l < L; ++l) {
      const int32_t n = to_me[int64_t(src) * L + l];
      for (int i = 0; i < n; ++i) {
        const int64_t pos = arr.position(src, l, i);
        if (pos < 0) continue;
        const int32_t j = arr.src_expert_start(src, l) + i;
        const uint8_t* row = j < lay_.priv
                                 ? sl.d_recv.data() + lay_.priv_off + (int64_t(src) * lay_.priv + j) * lay_.row
                                 : sl.d_recv.data() + lay_.over_off + (over_base + j - lay_.priv) * lay_.row;
        int32_t tok;
        a.weights[pos] = unpacker.unpack(row, pos, &tok);
        a.src[2 * pos] = src;
        a.src[2 * pos + 1] = tok;
        a.recv_slot[pos] = j;
      }
    }
    over_base += std::max<int64_t>(0, arr.rows_from(src) - lay_.priv);
  }
  for (int l = 0; l < L; ++l) a.group_sizes[l] = arr.group_size(l);
  *a.overflow = static_cast<int32_t>(arr.overflow());
  signal_all(kFreeD, a.slot, e);
}

// ---- combine ---------------------------------------------------------------------------------

void RankComm::combine_send(const CombineSendArgs& a) {
  Slot& sl = *slots_[a.slot];
  const MoeShape& s = o_.shape;
  const int N = s.num_ranks, tp = s.tp;
  const uint32_t e = sl.c_epoch;
  if (e > 0) wait_all(kFreeC, a.slot, e - 1, "combine_send (waiting for peers to free the slot)");
  engine_->flush(o_.timeout_s);
  const int64_t stride = int64_t(s.hidden) * elem_bytes(a.y_kind);
  for (int src = 0; src < N; ++src)  // dropped rows (capacity) come back as zeros
    std::memset(sl.c_send.data() + int64_t(src) * lay_.P * stride, 0, int64_t(a.recv_counts[src]) * stride);
  const int64_t R = s.recv_rows_total();
  const uint8_t* y = static_cast<const uint8_t*>(a.y);
  for (int64_t pos = 0; pos < R; ++pos) {
    const int32_t src = a.recv_src[pos * a.recv_src_stride];
    if (src < 0) continue;
    const int32_t j = a.recv_slot[pos];
    if (src >= N || j < 0 || j >= lay_.P || j >= a.recv_counts[src])
      throw std::invalid_argument(format("host combine_send: routing arrays corrupted at row %lld", (long long)pos));
    std::memcpy(sl.c_send.data() + (int64_t(src) * lay_.P + j) * stride, y + pos * stride, stride);
  }
  // To every rank m: the rows of each member j of m's tp group, into m's region [us][j].
  for (int m = 0; m < N; ++m) {
    const int g0 = m / tp * tp;
    for (int j = 0; j < tp; ++j) {
      const int src = g0 + j;
      const int64_t bytes = int64_t(a.recv_counts[src]) * stride;
      engine_->write(m, *sl.c_send_r, int64_t(src) * lay_.P * stride, bytes, bytes ? &sl.c_recv_peer[m] : nullptr,
                     (int64_t(rank_) * tp + j) * lay_.P * stride, imm(kComb, a.slot, e, j));
    }
  }
  a.handle[0] = static_cast<int32_t>(e);
  a.handle[1] = a.slot;
  sl.c_epoch = e + 1;
}

void RankComm::combine_recv(const CombineRecvArgs& a) {
  Slot& sl = *slots_[a.slot];
  const MoeShape& s = o_.shape;
  const int N = s.num_ranks, K = s.topk, T = s.max_tokens, H = s.hidden, tp = s.tp;
  const uint32_t e = static_cast<uint32_t>(a.handle[0]);
  if (a.handle[1] != a.slot) throw std::invalid_argument("host combine_recv: handle from another slot");
  for (int j = 0; j < tp; ++j) wait_all(kComb, a.slot, e, "combine_recv (expert outputs)", j);
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
        if (d < 0 || d >= N) continue;
        const int32_t j = a.pair_slot[pk];
        if (j < 0 || j >= lay_.P) throw std::invalid_argument("host combine_recv: routing arrays corrupted");
        const uint8_t* row = sl.c_recv.data() + ((int64_t(d) * tp + t % tp) * lay_.P + j) * stride;
        const float w = a.weights[pk];
        accumulate_row(acc.data(), row, a.y_kind, H, w);
        if (a.pairs) accumulate_row(a.pairs + pk * H, row, a.y_kind, H, 1.0f);
      }
    }
    if (a.out_in) {
      for (int h = 0; h < H; ++h) acc[h] += load_elem(a.out_in, int64_t(t) * H + h, a.out_in_kind);
    }
    for (int h = 0; h < H; ++h) store_elem(a.out, int64_t(t) * H + h, a.out_kind, acc[h]);
  }
  signal_all(kFreeC, a.slot, e);
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

void HostComm::fail(const std::string& why) {
  std::lock_guard<std::mutex> lock(mu_);
  if (failure_.empty()) failure_ = why;
}

void HostComm::check_usable() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (!failure_.empty())
    throw std::runtime_error("jax_moe_a2a host communicator is unusable after an earlier failure: " + failure_);
}

void HostComm::close() {
  for (auto& [r, c] : comms_) c->engine().close();
}

namespace {
Registry<HostComm>& registry() {
  static Registry<HostComm> r("host");
  return r;
}
}  // namespace

void register_comm(int64_t id, std::shared_ptr<HostComm> comm) { registry().add(id, std::move(comm)); }
std::shared_ptr<HostComm> find_comm(int64_t id) { return registry().find(id); }
void unregister_comm(int64_t id) {
  if (auto c = registry().remove(id)) c->close();
}

}  // namespace a2a::host
