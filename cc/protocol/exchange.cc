#include "protocol/exchange.h"

#include <algorithm>
#include <stdexcept>

#include "core/align.h"
#include "core/env.h"
#include "transfer/errors.h"
#include "transfer/imm.h"

namespace a2a::protocol {

using transfer::Bytes;
using transfer::format;

namespace {

// Immediate tags: kind * 8 + slot; combine data: 64 + tp member * 8 + slot.
enum Kind : uint32_t { kCounts = 1, kPriv = 2, kOver = 3, kFreeD = 4, kFreeC = 5 };
uint32_t tag_of(uint32_t kind, int z) { return kind * 8 + z; }
uint32_t comb_tag(int member, int z) { return 64 + member * 8 + z; }

// Appends [off, off + len) to `out`, merged into the last range when it starts where that ends.
void append(std::vector<ByteRange>& out, int64_t off, int64_t len) {
  if (len <= 0) return;
  if (!out.empty() && out.back().off + out.back().len == off) out.back().len += len;
  else out.push_back({off, len});
}

}  // namespace

const char* op_name(int op) {
  Half h;
  return half_of(op, &h) ? half_name(h) : "?";
}

SlotLayout::SlotLayout(const ExchangeOptions& o) {
  const MoeShape& s = o.shape;
  const int N = s.N, L = s.L;
  P = s.rows_per_peer();
  Q = s.Q;
  priv = o.priv_rows < 0 ? P : std::min(o.priv_rows, P);
  row = s.row_bytes();
  counts_send_bytes = pad16(int64_t(N) * L * 4);
  counts_bytes = pad16(int64_t(N) * N * L * 4);
  over_off = int64_t(N) * priv * row;
  d_recv_bytes = over_off + int64_t(N) * (P - priv) * row;
  d_send_bytes = int64_t(N) * P * row;
  c_row_stride_max = s.c_row;  // the combine dtype: wider y is cast to it before combine_send
  c_send_bytes = int64_t(N) * P * c_row_stride_max;
  c_recv_bytes = int64_t(s.tp) * Q * c_row_stride_max;
}

std::vector<int> Arrivals::missing() const {
  std::vector<int> out;
  for (const Part& p : parts)
    for (size_t i = 0; i < p.ranks.size(); ++i)
      if (!p.seen[i]) out.push_back(p.rank_at(i));
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

uint64_t Arrivals::missing_mask() const {
  uint64_t m = 0;
  for (const Part& p : parts)
    for (size_t i = 0; i < p.ranks.size(); ++i)
      if (!p.seen[i]) m |= 1ull << p.rank_at(i);
  return m;
}

void Arrivals::keep_only(const std::vector<uint8_t>& keep) {
  for (Part& p : parts) {
    std::vector<int> ranks;
    std::vector<uint8_t> seen;
    for (size_t i = 0; i < p.ranks.size(); ++i)
      if (p.rank_at(i) < int(keep.size()) && keep[p.rank_at(i)]) {
        ranks.push_back(p.ranks[i]);
        seen.push_back(p.seen[i]);
      }
    p.ranks.swap(ranks);
    p.seen.swap(seen);
  }
}

struct Exchange::Regions {
  std::shared_ptr<transfer::Region> k_send, k_recv, d_send, d_recv, c_send, c_recv;  // k: the count matrices
  std::vector<transfer::RemoteRegion> k_recv_peer, d_recv_peer, c_recv_peer;  // [N]
};

int most_remote_peers(const TransportOptions& o, int num_ranks) {
  if (num_ranks <= 0) return 0;
  if (o.node_size <= 0) return num_ranks - 1;
  // The smallest node's ranks see the most remote peers: the last node, when node_size does not
  // divide the ranks, else any.
  const int smallest = num_ranks % o.node_size ? num_ranks % o.node_size : std::min(o.node_size, num_ranks);
  return num_ranks - smallest;
}

Exchange::Exchange(const ExchangeOptions& o, int rank, std::shared_ptr<transfer::Engine> engine,
                   const std::vector<SlotBuffers>& buffers)
    : o_(o), lay_(o), rank_(rank), engine_(std::move(engine)), bufs_(buffers) {
  if (o.slots < 1 || o.slots > 8) throw std::invalid_argument("jax_moe_a2a: slots must be in [1, 8]");
  if (o.shape.tp < 1 || o.shape.tp > 8) throw std::invalid_argument("jax_moe_a2a: tp_size must be in [1, 8]");
  if (o.node_size < 0) throw std::invalid_argument("jax_moe_a2a: node_size must be >= 0");
  if (int(buffers.size()) != o.slots) throw std::invalid_argument("Exchange: one SlotBuffers per slot");
  const double chunk_kib = env::get_double("JAX_MOE_A2A_WRITE_CHUNK_KIB", o.chunk_kib_default);
  if (!(chunk_kib >= 0) || chunk_kib > 1 << 30)
    throw std::invalid_argument(format("JAX_MOE_A2A_WRITE_CHUNK_KIB=%g: expected KiB >= 0 (0: one write a peer)", chunk_kib));
  chunk_ = static_cast<int64_t>(chunk_kib * 1024);
  rails_ = std::max(1, engine_->num_domains());
  const double comb_split = env::get_double("JAX_MOE_A2A_COMB_PIECES", o.comb_pieces_default);
  if (!(comb_split >= 1 && comb_split <= 64) || comb_split != static_cast<int>(comb_split))
    throw std::invalid_argument(format("JAX_MOE_A2A_COMB_PIECES=%g: expected an integer in [1, 64]", comb_split));
  comb_split_ = static_cast<int>(comb_split);
  // Every piece's immediate carries piece * N + rank in its 16-bit rank field (piece_imm).
  const int64_t most_rows = std::max(lay_.priv, lay_.P - lay_.priv);
  const int64_t most_pieces = std::max<int64_t>(pieces(most_rows * lay_.row), comb_pieces());
  if (most_pieces * o.shape.N > int64_t(transfer::kImmMaxRank) + 1)
    throw std::invalid_argument(format("JAX_MOE_A2A_WRITE_CHUNK_KIB=%g: a write of %lld bytes would go in %lld pieces; "
                                       "with %d ranks at most %lld (a larger chunk)", chunk_kib,
                                       (long long)(most_rows * lay_.row), (long long)most_pieces, o.shape.N,
                                       (long long)((int64_t(transfer::kImmMaxRank) + 1) / o.shape.N)));
  for (WriteCounts* w : {&rows_w_, &comb_w_}) {
    w->bytes.reset(new std::atomic<uint64_t>[o.shape.N]);
    w->writes.reset(new std::atomic<uint64_t>[o.shape.N]);
    for (int r = 0; r < o.shape.N; ++r) {
      w->bytes[r].store(0, std::memory_order_relaxed);
      w->writes[r].store(0, std::memory_order_relaxed);
    }
  }
  for (int r = 0; r < o.shape.N; ++r) {
    all_.push_back(r);
    if (remote(rank_, r)) remote_.push_back(r);
  }
  alive_.assign(o.slots, std::vector<uint8_t>(o.shape.N, 1));
  comb_off_.assign(o.slots, std::vector<int64_t>(o.shape.N, 0));
  comb_runs_.assign(o.slots, std::vector<std::vector<ByteRange>>(o.shape.N));
  comb_nominal_.assign(o.slots, std::vector<int64_t>(o.shape.N, 0));
  owed_d_.assign(o.slots, std::vector<uint32_t>(o.shape.N, 0));
  owed_c_.assign(o.slots, std::vector<uint32_t>(o.shape.N, 0));
  for (const SlotBuffers& b : bufs_) {
    Regions g;
    g.k_send = engine_->register_memory(b.counts_send, lay_.counts_send_bytes);
    g.k_recv = engine_->register_memory(b.counts_recv, lay_.counts_bytes);
    g.d_send = engine_->register_memory(b.d_send, lay_.d_send_bytes, b.rows_memory, b.device);
    g.d_recv = engine_->register_memory(b.d_recv, lay_.d_recv_bytes, b.rows_memory, b.device);
    g.c_send = engine_->register_memory(b.c_send, lay_.c_send_bytes, b.rows_memory, b.device);
    g.c_recv = engine_->register_memory(b.c_recv, lay_.c_recv_bytes, b.rows_memory, b.device);
    regions_.push_back(std::move(g));
  }
}

Exchange::~Exchange() {
  for (Regions& g : regions_)
    for (auto* r : {&g.k_send, &g.k_recv, &g.d_send, &g.d_recv, &g.c_send, &g.c_recv})
      if (*r) (*r)->close();
}

std::string Exchange::pieces_text() const {
  return format("PRIV/OVER pieces of at most %lld B (0: whole), COMB in %d pieces, %d rail(s)", (long long)chunk_,
                comb_pieces(), rails_);
}

std::vector<Bytes> Exchange::descriptors() const {
  std::vector<Bytes> out;
  for (const Regions& g : regions_) {  // kDescriptorsPerSlot
    out.push_back(g.k_recv->descriptor());
    out.push_back(g.d_recv->descriptor());
    out.push_back(g.c_recv->descriptor());
  }
  const std::string t = pieces_text();
  out.emplace_back(t.begin(), t.end());
  return out;
}

void Exchange::check_peers(const std::map<int, std::vector<Bytes>>& descs) const {
  const std::string ours = pieces_text();
  for (int r : all_) {
    auto it = descs.find(r);
    if (it == descs.end()) throw std::invalid_argument(format("jax_moe_a2a: no descriptors for rank %d", r));
    if (it->second.size() != descriptor_count())
      throw std::invalid_argument(format("jax_moe_a2a: rank %d sent %zu descriptors, expected %zu", r,
                                         it->second.size(), descriptor_count()));
    const std::string theirs(it->second.back().begin(), it->second.back().end());
    if (theirs != ours)
      throw std::invalid_argument(format("jax_moe_a2a: rank %d cuts its row writes otherwise than rank %d: theirs "
                                         "'%s', ours '%s' (JAX_MOE_A2A_WRITE_CHUNK_KIB, JAX_MOE_A2A_COMB_PIECES and "
                                         "JAX_MOE_A2A_RAILS must be alike on every process; on the cuda backend "
                                         "their defaults follow the row path: JAX_MOE_A2A_STAGING and "
                                         "CUDA_MODULE_LOADING too)",
                                         r, rank_, theirs.c_str(), ours.c_str()));
  }
}

void Exchange::connect(const std::map<int, std::vector<Bytes>>& descs) {
  constexpr int D = kDescriptorsPerSlot;
  check_peers(descs);
  for (Regions& g : regions_) {
    g.k_recv_peer.resize(o_.shape.N);
    g.d_recv_peer.resize(o_.shape.N);
    g.c_recv_peer.resize(o_.shape.N);
  }
  for (int r : all_) {
    const auto it = descs.find(r);
    for (int z = 0; z < o_.slots; ++z) {
      Regions& g = regions_[z];
      g.k_recv_peer[r] = engine_->remote(it->second[D * z]);
      g.d_recv_peer[r] = engine_->remote(it->second[D * z + 1]);
      g.c_recv_peer[r] = engine_->remote(it->second[D * z + 2]);
      if (g.k_recv_peer[r].size < uint64_t(lay_.counts_bytes) || g.d_recv_peer[r].size < uint64_t(lay_.d_recv_bytes) ||
          g.c_recv_peer[r].size < uint64_t(lay_.c_recv_bytes))
        throw std::invalid_argument(format("jax_moe_a2a: rank %d's buffers are smaller than ours (spec mismatch)", r));
    }
  }
}

// ---- waits -----------------------------------------------------------------------------------

uint32_t Exchange::imm(uint32_t tag, uint32_t epoch) const {
  return transfer::pack_imm(tag, epoch & transfer::kImmMaxEpoch, rank_);
}

void Exchange::set_alive(int z, const std::vector<uint8_t>& alive) {
  if (z < 0 || z >= o_.slots || int(alive.size()) != o_.shape.N)
    throw std::invalid_argument(format("jax_moe_a2a: rank mask of %zu entries for slot %d (expected %d)", alive.size(),
                                       z, o_.shape.N));
  alive_[z] = alive;
}

Arrivals Exchange::expect(std::vector<uint32_t> tags, const std::vector<int>& ranks, uint32_t epoch) const {
  Arrivals a;
  for (uint32_t t : tags)
    a.parts.push_back({t, epoch & transfer::kImmMaxEpoch, ranks, std::vector<uint8_t>(ranks.size(), 0)});
  return a;
}

Arrivals Exchange::expect_free_d(int z, uint32_t e) const { return live(z, expect({tag_of(kFreeD, z)}, remote_, e)); }
Arrivals Exchange::expect_counts(int z, uint32_t e) const { return live(z, expect({tag_of(kCounts, z)}, all_, e)); }
Arrivals Exchange::expect_rows(int z, uint32_t e) const {
  Arrivals a = live(z, expect({tag_of(kPriv, z), tag_of(kOver, z)}, remote_, e));
  // A write in pieces arrives as that many immediates, piece i's naming i * N + the source
  // (piece_imm; post_private_to's and post_overflow's sizes, from the source's count matrix, which
  // came with its COUNTS); an empty PRIV or OVER is never written, so not awaited (row_pieces).
  for (Arrivals::Part& p : a.parts) {
    const int part = p.tag == tag_of(kPriv, z) ? 0 : 1;
    std::vector<int> ranks;
    for (int r : p.ranks) {
      const int n = row_pieces(landed_write_bytes(z, part, r));
      for (int i = 0; i < n; ++i) ranks.push_back(i * o_.shape.N + r);
    }
    p.ranks = std::move(ranks);
    p.seen.assign(p.ranks.size(), 0);
    p.piece_stride = o_.shape.N;
  }
  return a;
}
Arrivals Exchange::expect_free_c(int z, uint32_t c) const { return live(z, expect({tag_of(kFreeC, z)}, remote_, c)); }
Arrivals Exchange::expect_comb(int z, uint32_t c) const {
  std::vector<uint32_t> tags;
  for (int j = 0; j < o_.shape.tp; ++j) tags.push_back(comb_tag(j, z));
  Arrivals a = live(z, expect(tags, remote_, c));
  for (Arrivals::Part& p : a.parts) {  // each source's COMB in comb_pieces() writes (piece_imm)
    std::vector<int> ranks;
    for (int r : p.ranks)
      for (int i = 0; i < comb_pieces(); ++i) ranks.push_back(i * o_.shape.N + r);
    p.ranks = std::move(ranks);
    p.seen.assign(p.ranks.size(), 0);
    p.piece_stride = o_.shape.N;
  }
  return a;
}

Arrivals Exchange::live(int z, Arrivals a) const {
  a.keep_only(alive_[z]);
  return a;
}

// The FREE waits of a send half (exchange.h, "elastic EP"). In a slot's full cycle other waits
// order our writes after a peer's reads too (our combine_recv waits for every live rank's COMB,
// sent after its dispatch_recv; our dispatch_recv for its COUNTS, sent after its combine_recv),
// but a slot reused by dispatch-only steps has FREE_D alone: our dispatch_recv of a step returns
// once rank r's COUNTS and PRIV came (posted by r's dispatch_send) and, where rows overflow, its
// OVER (posted at the start of r's dispatch_recv), while r may still be reading the step before.
// So a rank that sat out the slot's last dispatch must still be awaited for the one before it
// (tests/test_elastic.py::test_unmasked_rank_still_reading).
Arrivals Exchange::expect_owed(int z, uint32_t tag, const std::vector<uint32_t>& owed, bool even_if_masked) const {
  Arrivals a;
  if (!even_if_masked && !alive(z, rank_)) return a;  // masked ourselves: we write nobody now
  for (int r : remote_) {
    if (!alive(z, r) || owed[r] == 0) continue;  // masked now, or it owes nothing (never took part with us)
    const uint32_t e = (owed[r] - 1) & transfer::kImmMaxEpoch;
    auto part = std::find_if(a.parts.begin(), a.parts.end(), [e](const Arrivals::Part& p) { return p.epoch == e; });
    if (part == a.parts.end()) part = a.parts.insert(a.parts.end(), {tag, e, {}, {}});
    part->ranks.push_back(r);
    part->seen.push_back(0);
  }
  return a;  // without a mask: one part, every remote rank, epoch e - 1
}

void Exchange::owe(int z, uint32_t epoch, std::vector<uint32_t>& owed) {
  if (!alive(z, rank_)) return;  // we posted nothing: every rank keeps what it owed
  for (int r : remote_)
    if (alive(z, r)) owed[r] = epoch + 1;  // it frees this epoch for us (its receive half, same mask)
}

Arrivals Exchange::expect_owed_free_d(int z) const { return expect_owed(z, tag_of(kFreeD, z), owed_d_[z]); }
Arrivals Exchange::expect_owed_free_c(int z) const { return expect_owed(z, tag_of(kFreeC, z), owed_c_[z]); }
void Exchange::owe_free_d(int z, uint32_t e) { owe(z, e, owed_d_[z]); }
void Exchange::owe_free_c(int z, uint32_t c) { owe(z, c, owed_c_[z]); }
Arrivals Exchange::expect_all_owed(int z) const {
  Arrivals a = expect_owed(z, tag_of(kFreeD, z), owed_d_[z], true);
  for (Arrivals::Part& p : expect_owed(z, tag_of(kFreeC, z), owed_c_[z], true).parts) a.parts.push_back(std::move(p));
  return a;
}
void Exchange::forget_owed(int z) {
  std::fill(owed_d_[z].begin(), owed_d_[z].end(), 0);
  std::fill(owed_c_[z].begin(), owed_c_[z].end(), 0);
}

uint64_t Exchange::counts_waiting(int z, uint32_t e) const {
  uint64_t bits = 0;
  for (int r : all_)
    if (r < 64 && engine_->count(transfer::pack_imm(tag_of(kCounts, z), e & transfer::kImmMaxEpoch,
                                                    static_cast<uint32_t>(r))) > 0)
      bits |= 1ull << r;
  return bits;
}

bool Exchange::poll(Arrivals& a) {
  bool all = true;
  for (Arrivals::Part& p : a.parts)
    if (!engine_->poll_ranks(p.tag, p.epoch, p.ranks, p.seen)) all = false;
  return all;
}

void Exchange::timed_out(const Arrivals& a, int op, int z, const char* what, const std::string& detail) const {
  const std::vector<int> missing = a.missing();
  throw transfer::TimeoutError(
      format("jax_moe_a2a %s (%s; slot %d, rank %d): ranks [%s] did not arrive within %.1f s "
             "(crashed process, or calls out of order?)%s%s",
             op_name(op), what, z, rank_, transfer::join_ranks(missing).c_str(), o_.timeout_s,
             detail.empty() ? "" : " ", detail.c_str()),
      0, 0, missing);
}

void Exchange::wait(Arrivals a, int op, int z, const char* what) {
  const auto deadline = transfer::Clock::now() + std::chrono::duration_cast<transfer::Clock::duration>(
                                                     std::chrono::duration<double>(o_.timeout_s));
  for (Arrivals::Part& p : a.parts) {
    const double left = std::chrono::duration<double>(deadline - transfer::Clock::now()).count();
    try {
      engine_->wait_ranks(p.tag, p.epoch, p.ranks, std::max(0.0, left));
      std::fill(p.seen.begin(), p.seen.end(), 1);
    } catch (const transfer::TimeoutError& e) {
      for (size_t i = 0; i < p.ranks.size(); ++i)
        p.seen[i] = std::find(e.missing.begin(), e.missing.end(), p.ranks[i]) == e.missing.end();
      timed_out(a, op, z, what, std::string("[") + e.what() + "]");
    }
  }
}

// ---- steps -----------------------------------------------------------------------------------

void Exchange::post_counts(int z, uint32_t e) {
  const int64_t cbytes = int64_t(o_.shape.N) * o_.shape.local_experts() * 4;
  for (int d : all_)
    if (alive(z, d))
      engine_->write(d, *regions_[z].k_send, 0, cbytes, &regions_[z].k_recv_peer[d], int64_t(rank_) * cbytes,
                     imm(tag_of(kCounts, z), e));
}

int64_t Exchange::rows_we_send(int z, int d) const {
  const int L = o_.shape.local_experts();
  const int32_t* mine = reinterpret_cast<const int32_t*>(bufs_[z].counts_send) + int64_t(d) * L;
  int64_t n = 0;
  for (int l = 0; l < L; ++l) n += mine[l];
  return n;
}

void Exchange::post_private(int z, uint32_t e) {
  for (int d : remote_) post_private_to(z, e, d);
}

ByteRange Exchange::private_write(int z, int d) const {
  return {int64_t(d) * lay_.P * lay_.row, priv_rows(rows_we_send(z, d)) * lay_.row};
}

void Exchange::post_private_to(int z, uint32_t e, int d) {
  if (!alive(z, d) || !remote(rank_, d)) return;
  const ByteRange w = private_write(z, d);
  write_pieces(d, *regions_[z].d_send, w.off, w.len, &regions_[z].d_recv_peer[d], int64_t(rank_) * lay_.priv * lay_.row,
               imm(tag_of(kPriv, z), e));
}

int Exchange::private_pieces(int z, int d) const {
  if (!alive(z, d) || !remote(rank_, d) || rows_we_send(z, d) == 0) return 0;
  return pieces(private_write(z, d).len);  // no PRIV rows (priv 0) but OVER rows: one piece to stage them
}

void Exchange::post_private_piece(int z, uint32_t e, int d, int i) {
  const ByteRange w = private_write(z, d);
  const int n = private_pieces(z, d);
  if (i < 0 || i >= n)
    throw std::logic_error(format("post_private_piece: piece %d of %d (rank %d)", i, n, d));
  if (w.len == 0) return;  // only OVER rows (priv 0): this piece staged them; nothing to write
  write_piece(d, *regions_[z].d_send, w.off, w.len, &regions_[z].d_recv_peer[d], int64_t(rank_) * lay_.priv * lay_.row,
              imm(tag_of(kPriv, z), e), n, i, rows_w_);
}

int Exchange::row_pieces(int64_t bytes) const { return bytes == 0 ? 0 : pieces(bytes); }

int Exchange::pieces(int64_t bytes) const {
  int n = chunk_ <= 0 || bytes <= chunk_ ? 1 : static_cast<int>((bytes + chunk_ - 1) / chunk_);
  if (rails_ > 1 && bytes >= kRailSplitBytes) n = std::max(n, rails_);
  return n;
}

ByteRange Exchange::piece_of(int64_t bytes, int n, int i) {
  const int64_t each = (bytes + n - 1) / n;
  const int64_t at = std::min(bytes, i * each);
  return {at, std::min(each, bytes - at)};
}

ByteRange Exchange::comb_piece_of(int64_t bytes, int64_t nominal, int n, int i) {
  const ByteRange p = piece_of(nominal, n, i);
  return {std::min(p.off, bytes), std::clamp<int64_t>(bytes - p.off, 0, p.len)};
}

void Exchange::write_pieces(int d, const transfer::Region& src, int64_t src_off, int64_t bytes,
                            const transfer::RemoteRegion* dst, int64_t dst_off, uint32_t im, int n,
                            WriteCounts& counts) {
  for (int i = 0; i < n; ++i) write_piece(d, src, src_off, bytes, dst, dst_off, im, n, i, counts);
}

void Exchange::write_piece(int d, const transfer::Region& src, int64_t src_off, int64_t bytes,
                           const transfer::RemoteRegion* dst, int64_t dst_off, uint32_t im, int n, int i,
                           WriteCounts& counts) {
  write_range(d, src, src_off, n <= 1 ? ByteRange{0, bytes} : piece_of(bytes, n, i), dst, dst_off, im, n, i, counts);
}

void Exchange::write_range(int d, const transfer::Region& src, int64_t src_off, const ByteRange& p,
                           const transfer::RemoteRegion* dst, int64_t dst_off, uint32_t im, int n, int i,
                           WriteCounts& counts) {
  counts.bytes[d].fetch_add(uint64_t(p.len), std::memory_order_relaxed);
  counts.writes[d].fetch_add(1, std::memory_order_relaxed);
  if (p.len == 0) dst = nullptr;  // the immediate alone
  if (n <= 1) {  // one write: the peer's own rail
    engine_->write(d, src, src_off + p.off, p.len, dst, dst_off + p.off, im);
    return;
  }
  if (i > 0) counts.extra.fetch_add(1, std::memory_order_relaxed);
  engine_->write_on(i % rails_, d, src, src_off + p.off, p.len, dst, dst_off + p.off, piece_imm(im, i));
}

const int32_t* Exchange::counts_of(int z, int src) const {
  const int64_t NL = int64_t(o_.shape.N) * o_.shape.local_experts();
  return reinterpret_cast<const int32_t*>(bufs_[z].counts_recv) + src * NL;
}

int64_t Exchange::rows_between(int z, int src, int dst) const {
  if (!alive(z, src) || !alive(z, dst)) return 0;  // a masked rank's count matrix is stale
  const int L = o_.shape.local_experts();
  const int32_t* m = counts_of(z, src) + int64_t(dst) * L;
  int64_t n = 0;
  for (int l = 0; l < L; ++l) n += m[l];
  return n;
}

void Exchange::post_overflow(int z, uint32_t e, uint64_t skip) {
  for (int d : remote_)
    if (!(skip >> d & 1)) post_overflow_to(z, e, d);
}

void Exchange::post_overflow_to(int z, uint32_t e, int d) {
  // Rows past `priv` go to each remote destination's overflow region right after the overflow of
  // the lower-ranked sources remote to it: one write per destination, none if no rows overflow
  // (the destination knows from our count matrix and awaits none: expect_rows).
  if (!alive(z, d) || !remote(rank_, d)) return;
  const int64_t over = over_rows(rows_between(z, rank_, d));
  int64_t off = 0;
  for (int src = 0; src < rank_; ++src)
    if (remote(src, d)) off += over_rows(rows_between(z, src, d));
  write_pieces(d, *regions_[z].d_send, (int64_t(d) * lay_.P + lay_.priv) * lay_.row, over * lay_.row,
               &regions_[z].d_recv_peer[d], lay_.over_off + off * lay_.row, imm(tag_of(kOver, z), e));
}

bool Exchange::overflow_offset_known(int z, int d, uint64_t missing) const {
  if (missing >> rank_ & 1) return false;  // our own count matrix, as the receiver reads it
  for (int src = 0; src < rank_; ++src)
    if (remote(src, d) && alive(z, src) && (missing >> src & 1)) return false;
  return true;
}

void Exchange::overflow_bases(int z, int64_t* over_base) const {
  int64_t base = 0;
  for (int src = 0; src < o_.shape.N; ++src) {
    over_base[src] = remote(src, rank_) ? base : 0;
    if (remote(src, rank_)) base += over_rows(rows_between(z, src, rank_));
  }
}

int64_t Exchange::landed_offset(int src, int64_t j, int64_t over_base) const {
  return j < lay_.priv ? (int64_t(src) * lay_.priv + j) * lay_.row : lay_.over_off + (over_base + j - lay_.priv) * lay_.row;
}

void Exchange::take_combine_offsets(int z) {
  const int L = o_.shape.local_experts();
  std::vector<int64_t>& off = comb_off_[z];
  for (int src = 0; src < o_.shape.N; ++src) {  // a masked rank's count matrix is stale: zeros
    off[src] = alive(z, src) && alive(z, rank_) ? combine_offset(counts_of(z, src), L, rank_) : 0;
    comb_nominal_[z][src] = rows_between(z, src, rank_);
  }
  // Where remote expert ranks d will put the rows of our group's member j (source g0 + j): rows
  // [j * Q + combine_offset(source's counts, d), + rows the source sent d) of c_recv.
  const int tp = o_.shape.tp, g0 = rank_ / tp * tp;
  for (int d : remote_) {
    std::vector<ByteRange>& runs = comb_runs_[z][d];
    runs.assign(tp, ByteRange{0, 0});
    for (int j = 0; j < tp && alive(z, rank_); ++j) {
      const int src = g0 + j;
      if (alive(z, src))
        runs[j] = {int64_t(j) * lay_.Q + combine_offset(counts_of(z, src), L, d), rows_between(z, src, d)};
    }
  }
}

void Exchange::adopt_combine_offsets(int z, int from) {
  if (from < 0 || from >= o_.slots)
    throw std::invalid_argument(format("jax_moe_a2a combine on slot %d: the dispatch's slot %d is not in [0, %d)", z,
                                       from, o_.slots));
  if (from == z) return;
  comb_off_[z] = comb_off_[from];
  comb_nominal_[z] = comb_nominal_[from];
  comb_runs_[z] = comb_runs_[from];
}

std::vector<ByteRange> Exchange::send_rows_of_piece(int z, int d, int i) const {
  std::vector<ByteRange> out;
  const int n = private_pieces(z, d);
  if (i < 0 || i >= n) return out;
  const ByteRange w = private_write(z, d);
  const ByteRange p = piece_of(w.len, n, i);
  // the last piece runs to the end of every row for d (its OVER rows follow PRIV's in d_send)
  const int64_t end = i + 1 < n ? p.off + p.len : rows_we_send(z, d) * lay_.row;
  append(out, w.off + p.off, end - p.off);
  return out;
}

int64_t Exchange::landed_write_bytes(int z, int part, int src) const {
  const int64_t n = rows_between(z, src, rank_);  // as post_private_to and post_overflow_to count
  return (part == 0 ? priv_rows(n) : over_rows(n)) * lay_.row;
}

ByteRange Exchange::landed_piece(int z, int part, int src, int piece, const int64_t* over_base) const {
  if (!remote(src, rank_) || !alive(z, src) || part < 0 || part > 1) return {0, 0};
  const int64_t bytes = landed_write_bytes(z, part, src);
  const int64_t base = part == 0 ? int64_t(src) * lay_.priv * lay_.row : lay_.over_off + over_base[src] * lay_.row;
  const ByteRange p = piece_of(bytes, pieces(bytes), piece);
  return {base + p.off, p.len};
}

std::vector<ByteRange> Exchange::combine_send_rows_of_piece(int z, int m, const int32_t* rows_from, int64_t stride,
                                                            int i) const {
  std::vector<ByteRange> out;
  if (!remote(rank_, m) || !alive(z, m) || i < 0 || i >= comb_pieces()) return out;
  const int tp = o_.shape.tp, g0 = m / tp * tp;
  for (int j = 0; j < tp; ++j) {
    const int64_t bytes = std::clamp<int64_t>(rows_from[g0 + j], 0, lay_.P) * stride;
    const ByteRange p = comb_piece_of(bytes, comb_nominal_[z][g0 + j] * stride, comb_pieces(), i);
    append(out, int64_t(g0 + j) * lay_.P * stride + p.off, p.len);
  }
  return out;
}

std::vector<ByteRange> Exchange::combine_landed_runs(int z, int d, int64_t stride) const {
  std::vector<ByteRange> out(o_.shape.tp, ByteRange{0, 0});
  const std::vector<ByteRange>& runs = comb_runs_[z].at(d);
  for (size_t j = 0; j < runs.size(); ++j) out[j] = {runs[j].off * stride, runs[j].len * stride};
  return out;
}

void Exchange::signal_remote(int z, uint32_t tag, uint32_t epoch) {
  const uint32_t v = imm(tag, epoch);
  for (int r : remote_)
    if (alive(z, r)) engine_->write(r, *regions_[z].k_send, 0, 0, nullptr, 0, v);
}

void Exchange::signal_free_d(int z, uint32_t e) { signal_remote(z, tag_of(kFreeD, z), e); }
void Exchange::signal_free_c(int z, uint32_t c) { signal_remote(z, tag_of(kFreeC, z), c); }

void Exchange::post_combine(int z, uint32_t c, const int32_t* rows_from, int64_t stride) {
  for (int m : remote_) post_combine_to(z, c, m, rows_from, stride);
}

void Exchange::check_combine(int z, int m, const int32_t* rows_from, int64_t stride) const {
  if (stride <= 0 || stride > lay_.c_row_stride_max)
    throw std::invalid_argument(format("jax_moe_a2a combine: row stride %lld outside (0, %lld]",
                                       (long long)stride, (long long)lay_.c_row_stride_max));
  if (!remote(rank_, m) || !alive(z, m)) return;  // nothing written to m: its rows are not read
  const int64_t* off = comb_off_[z].data();
  const int tp = o_.shape.tp, g0 = m / tp * tp;
  for (int src = g0; src < g0 + tp; ++src)
    if (rows_from[src] < 0 || rows_from[src] > comb_nominal_[z][src] || off[src] + rows_from[src] > lay_.Q)
      throw std::invalid_argument(format("jax_moe_a2a combine: %d rows from rank %d at combine offset %lld (at "
                                         "most the %lld it sent, and offset + rows at most %d)", rows_from[src], src,
                                         (long long)off[src], (long long)comb_nominal_[z][src], lay_.Q));
}

void Exchange::post_combine_to(int z, uint32_t c, int m, const int32_t* rows_from, int64_t stride) {
  // piece 0 checks the rows and the stride
  for (int i = 0; i < comb_pieces(); ++i) post_combine_piece(z, c, m, rows_from, stride, i);
}

void Exchange::post_combine_piece(int z, uint32_t c, int m, const int32_t* rows_from, int64_t stride, int i) {
  if (i < 0 || i >= comb_pieces())
    throw std::logic_error(format("post_combine_piece: piece %d of %d (rank %d)", i, comb_pieces(), m));
  if (i == 0) check_combine(z, m, rows_from, stride);
  if (!remote(rank_, m) || !alive(z, m)) return;
  // The rows of each member j of m's tp group (source src = g0 + j), into m's region at row
  // j * Q + off[src] (the rows src sends ranks below us come first there).
  const int64_t* off = comb_off_[z].data();
  const int tp = o_.shape.tp, g0 = m / tp * tp;
  const int n = comb_pieces();
  for (int j = 0; j < tp; ++j) {
    const int src = g0 + j;
    const int64_t bytes = int64_t(rows_from[src]) * stride;
    write_range(m, *regions_[z].c_send, int64_t(src) * lay_.P * stride,
                comb_piece_of(bytes, comb_nominal_[z][src] * stride, n, i), &regions_[z].c_recv_peer[m],
                (int64_t(j) * lay_.Q + off[src]) * stride, imm(comb_tag(j, z), c), n, i, comb_w_);
  }
}

}  // namespace a2a::protocol
