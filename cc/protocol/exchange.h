// The route-exchange protocol of the EFA design over the TransferEngine (docs/protocol.md): buffer
// layout, immediates and the steps of one dispatch / combine, written once and driven two ways:
// inline by the host backend (cc/host, blocking waits on the calling thread) and by the cuda
// backend's proxy thread (cc/proxy, non-blocking polls between GPU flags). It knows the MoE layout
// of the buffers but not who packs them (C++ on CPUs, or GPU kernels writing pinned host memory or,
// where the NIC reaches GPU memory, device memory).
//
// Pairs of ranks: with node_size 0 every pair (a rank and itself included) goes through the engine
// (the host backend). With node_size > 0, ranks a and b share a node iff a / node_size ==
// b / node_size and such pairs never touch the engine (the cuda backend's NVLink path); only the
// count matrices go to every rank, because exact overflow offsets at a remote receiver depend on
// the counts of every sender remote to it, our node-local peers included.
//
// Steps of dispatch (slot z, epoch e) at rank r, sources and destinations "remote" as above:
//   wait FREE_D(e-1) from remote ranks; flush      -> our send buffer and their regions are reusable
//     (under a rank mask: from each live rank the FREE_D it owes, that of the last dispatch of the
//     slot both took part in; expect_owed_free_d)
//   post_counts: our [N, L] count matrix (counts_send) to every rank                   (COUNTS)
//   post_private: first `priv` rows for each remote destination into our private region (PRIV)
//   wait COUNTS from every rank; post_overflow: rows past `priv` at the exact offset      (OVER)
//     (a PRIV or OVER with no rows is not written, nor awaited: the counts tell the receiver)
//   wait PRIV and OVER from remote ranks; the rows have landed; read them; signal FREE_D(e).
//   (after COUNTS, before FREE_D(e): take_combine_offsets, the snapshot combine uses.)
// Combine (slot z, epoch c): wait FREE_C(c-1); post_combine (COMB, one write per (remote rank,
// member of its tp group)); wait COMB from remote ranks for every member; read; signal FREE_C(c).
//
// The combine region is compact: [tp member j][Q][c_row] (MoeShape::Q = ceil(T/tp) * K, the most
// rows one member sends all destinations together). Expert rank d's rows for source s (member
// j = s % tp of its group) go to every member of s's group at rows [j*Q + off_s[d], + rows), where
// off_s[d] = combine_offset(s's count matrix, d) (core/moe_layout.h): the rows s sends to ranks
// below d. Every member computes the same index for each pair of its group (SendPlan::comb_slot).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/config.h"
#include "core/half.h"
#include "core/moe_layout.h"
#include "transfer/engine.h"

namespace a2a::protocol {

// The four halves, as error records and messages name them (the values of core/half.h's Half).
enum Op : int { kDispatchSend = 0, kDispatchRecv = 1, kCombineSend = 2, kCombineRecv = 3 };
static_assert(kDispatchSend == int(Half::kDispatchSend) && kDispatchRecv == int(Half::kDispatchRecv) &&
                  kCombineSend == int(Half::kCombineSend) && kCombineRecv == int(Half::kCombineRecv),
              "protocol::Op numbers the halves as core/half.h does (SlotCtrl::waiting is indexed by either)");
const char* op_name(int op);

// The transport fields (core/config.h) with these meanings here: priv_rows -1 is rows_per_peer
// (nothing overflows); node_size 0 sends every pair through the engine, else ranks a, b share a
// node iff a / node_size == b / node_size; provider is the caller's (the exchange takes an engine).
struct ExchangeOptions : TransportOptions {
  MoeShape shape{};    // shape_of(the Config)
  // The piece settings where JAX_MOE_A2A_WRITE_CHUNK_KIB / JAX_MOE_A2A_COMB_PIECES are unset (the
  // caller's default for its row path: RemotePath's pieces_default); alike on every process (checked).
  double chunk_kib_default = 0;  // 0: one PRIV / OVER write a peer
  int comb_pieces_default = 1;
};

// The most ranks remote to any one rank under o.node_size (the same on every process).
int most_remote_peers(const TransportOptions& o, int num_ranks);

// Byte offsets inside one slot's buffers (identical on every rank). The count matrices live in
// buffers of their own (host memory: the proxy and the inline driver read them), the rows in
// buffers that may be host or device memory (SlotBuffers::rows_memory).
struct SlotLayout {
  explicit SlotLayout(const ExchangeOptions& o);
  int64_t counts_send_bytes;  // counts_send: our [N dest][L] int32 count matrix (16-byte padded)
  int64_t counts_bytes;       // counts_recv: [N src][N][L] int32 count matrices, one per source (padded)
  int64_t over_off;           // d_recv: private [N src][priv][row] from 0, then overflow [N*(P-priv)][row]
  int64_t d_recv_bytes;
  int64_t d_send_bytes;       // d_send: [N dest][P][row]
  int64_t c_row_stride_max;   // MoeShape::c_row = H * itemsize(combine dtype): the widest y row
  int64_t c_send_bytes;       // [N src][P][c_row]
  int64_t c_recv_bytes;       // [tp member][Q][c_row] (compact: see the top of this file)
  int P, Q, priv;
  int64_t row;
};

// One slot's buffers, owned by the caller. Sizes as in SlotLayout. The count matrices are always
// host memory (host vectors, or pinned host memory that GPU kernels reach through mapped
// pointers); the four row buffers are host memory too, or device memory (rows_memory kCuda, on
// CUDA device `device`), which the engine must be able to register (FI_HMEM with CUDA).
// The protocol never reads or writes a row itself.
struct SlotBuffers {
  uint8_t* counts_send;
  uint8_t* counts_recv;
  uint8_t* d_send;
  uint8_t* d_recv;
  uint8_t* c_send;
  uint8_t* c_recv;
  transfer::MemoryKind rows_memory = transfer::MemoryKind::kHost;
  int device = 0;
};

// A byte range [off, off + len) of one of a slot's row buffers.
struct ByteRange {
  int64_t off, len;
};

// One wait in progress: arrivals of (tag, epoch, rank) for sets of tags and ranks, each part
// with its own epoch (the owed FREE waits of elastic EP wait for different epochs per rank).
struct Arrivals {
  struct Part {
    uint32_t tag;
    uint32_t epoch;  // as the immediates carry it (transfer::kImmMaxEpoch bits)
    std::vector<int> ranks;  // the immediates' rank fields, one entry per arrival awaited
    std::vector<uint8_t> seen;
    // > 0 (the rows' parts, N): a write in pieces, ranks[i] = piece * piece_stride + rank (piece i
    // of a write carries its index in the immediate: Exchange::piece_imm); 0: ranks[i] is the rank.
    int piece_stride = 0;
    int rank_at(size_t i) const { return piece_stride > 0 ? ranks[i] % piece_stride : ranks[i]; }
    int piece_at(size_t i) const { return piece_stride > 0 ? ranks[i] / piece_stride : 0; }
  };
  std::vector<Part> parts;
  std::vector<int> missing() const;  // ranks not yet seen in some part, ascending, unique
  // The same as bits (bit r: rank r not yet seen in some part; ranks < 64, as the proxy's masks),
  // without allocating: the proxy asks it on every poll while a step waits.
  uint64_t missing_mask() const;
  // Drops the ranks r with !keep[r] from every part (elastic EP: the ranks a slot's mask leaves
  // out now; Exchange::live).
  void keep_only(const std::vector<uint8_t>& keep);
};

class Exchange {
 public:
  // Registers every slot's buffers with the engine.
  Exchange(const ExchangeOptions& o, int rank, std::shared_ptr<transfer::Engine> engine,
           const std::vector<SlotBuffers>& buffers);
  ~Exchange();
  Exchange(const Exchange&) = delete;
  Exchange& operator=(const Exchange&) = delete;

  int rank() const { return rank_; }
  const ExchangeOptions& options() const { return o_; }
  const SlotLayout& layout() const { return lay_; }
  transfer::Engine& engine() { return *engine_; }
  const SlotBuffers& buffers(int z) const { return bufs_[z]; }
  // Does the pair (a, b) go through the engine?
  bool remote(int a, int b) const { return o_.node_size <= 0 || a / o_.node_size != b / o_.node_size; }
  const std::vector<int>& remote_ranks() const { return remote_; }  // ranks remote to us, ascending
  bool any_remote() const { return !remote_.empty(); }

  // Descriptors of our remotely written regions, [slot0 counts_recv, slot0 d_recv, slot0 c_recv,
  // slot1 ...] (kDescriptorsPerSlot per slot), then our piece settings (pieces_text()).
  static constexpr int kDescriptorsPerSlot = 3;
  std::vector<transfer::Bytes> descriptors() const;
  size_t descriptor_count() const { return size_t(kDescriptorsPerSlot) * o_.slots + 1; }
  // Peers' descriptors in the same order, for every rank (ours included); check_peers first.
  void connect(const std::map<int, std::vector<transfer::Bytes>>& descriptors);
  // Throws std::invalid_argument for a rank missing or sending the wrong number of descriptors, or
  // one that cuts its writes into pieces otherwise than we do, naming both settings: its pieces
  // would land where we do not wait for them (a wrong result, not a timeout). Call it before the
  // engines connect (they exchange messages in rank order): every rank has every rank's
  // descriptors, so if any two differ every rank sees a difference and refuses, none waits.
  void check_peers(const std::map<int, std::vector<transfer::Bytes>>& descriptors) const;
  // The piece settings in effect, as text ("PRIV/OVER pieces of at most 0 B (0: whole), ...").
  std::string pieces_text() const;

  // ---- elastic EP: the rank mask of slot z ------------------------------------------------------
  // alive[r] == 0: rank r is masked (dead) for slot z's current dispatch and combine. Every wait
  // below leaves it out, nothing is posted to it, and its count matrix (stale) reads as zeros in
  // rows_between / overflow_bases. Default: every rank alive (the proxy never sets it).
  void set_alive(int z, const std::vector<uint8_t>& alive);
  bool alive(int z, int r) const { return alive_[z][r] != 0; }

  // ---- elastic EP: the FREE signals owed to slot z's send halves (the inline driver) -----------
  // Rank r owes us the FREE_D / FREE_C of slot z's last dispatch / combine in which both of us took
  // part (it signals FREE only for a step it was alive in, and only to ranks alive there): kept as
  // that epoch + 1, 0 when none. A send half waits for it from every rank alive in slot z's mask
  // now, then owe_free_d / owe_free_c records its own epoch for every rank of that mask; a masked
  // rank keeps what it owed. So a rank masked for a step and unmasked the next is still awaited for
  // the step before, which it may still be reading (a "last op's mask" rule would skip it: it was
  // masked then). Without a mask every rank owes e - 1 at epoch e: the same wait as
  // expect_free_d(z, e - 1) (the proxy's, which never has a mask).
  Arrivals expect_owed_free_d(int z) const;  // nothing when we are masked in slot z (we write nobody)
  Arrivals expect_owed_free_c(int z) const;
  void owe_free_d(int z, uint32_t e);  // dispatch e went out under slot z's mask (no-op when we are masked)
  void owe_free_c(int z, uint32_t c);
  // Recovery (RankComm::recover_apply): nobody owes slot z anything; the survivors' barrier stands
  // for the FREE signals of the failed step.
  void forget_owed(int z);
  // Close (RankComm::drain): every FREE_D and FREE_C owed to us in slot z by the ranks alive in its
  // mask now, also when we are masked ourselves (a peer may still be reading the last step we took
  // part in, and signals its FREE after we finished ours). A masked peer is not awaited (it may be
  // dead: no wait ever waits for a masked rank), nor one that owes nothing.
  Arrivals expect_all_owed(int z) const;

  // ---- what each step waits for ------------------------------------------------------------
  Arrivals expect_free_d(int z, uint32_t e) const;  // FREE_D(e) from remote ranks
  Arrivals expect_counts(int z, uint32_t e) const;  // COUNTS(e) from every rank
  // PRIV(e) and OVER(e) from remote ranks: parts [PRIV, OVER], an entry per piece of each write
  // (none for a write with no rows, which is never posted: row_pieces)
  Arrivals expect_rows(int z, uint32_t e) const;
  Arrivals expect_free_c(int z, uint32_t c) const;  // FREE_C(c) from remote ranks
  // COMB(c) from remote ranks: part j for tp member j's rows, an entry per piece (combine_pieces)
  Arrivals expect_comb(int z, uint32_t c) const;
  // Non-blocking: true when everything arrived (arrivals are consumed as they are seen).
  bool poll(Arrivals& a);
  // Bit r: rank r's COUNTS(e) of slot z arrived and nobody consumed it yet (nothing is consumed
  // or polled here: what the engine's progress has counted). For reports: a peer already in
  // epoch e's dispatch while we have not started it.
  uint64_t counts_waiting(int z, uint32_t e) const;
  // Blocking, up to timeout_s; throws transfer::TimeoutError naming op, slot and missing ranks.
  void wait(Arrivals a, int op, int z, const char* what);
  // Throws TimeoutError with the message the inline and the proxied paths share.
  [[noreturn]] void timed_out(const Arrivals& a, int op, int z, const char* what, const std::string& detail) const;

  // ---- the steps (writes return at once; completion is counted at the receiver) ----------------
  void post_counts(int z, uint32_t e);    // our count matrix (counts_send) to every rank
  void post_private(int z, uint32_t e);   // needs our count matrix in counts_send
  void post_private_to(int z, uint32_t e, int d);  // post_private's write to remote rank d alone
  // post_private_to's write in its pieces (JAX_MOE_A2A_WRITE_CHUNK_KIB, rails: what the receiver
  // counts, from the counts): how many there are (0 where d is not remote, masked, or gets no rows
  // from us; 1 for a write in one piece, and for no PRIV rows but OVER rows: that piece only stages
  // them, nothing is posted), and piece i alone. For a packer whose rows live
  // elsewhere (row staging): piece i's rows copied, then posted, while piece i + 1's copy runs.
  int private_pieces(int z, int d) const;
  void post_private_piece(int z, uint32_t e, int d, int i);
  // Our OVER writes to every remote rank whose bit in `skip` is clear (skip: those posted early);
  // needs every rank's count matrix (after COUNTS).
  void post_overflow(int z, uint32_t e, uint64_t skip = 0);
  // post_overflow's write to remote rank d alone: needs our count matrix and those of the sources
  // below us that are remote to d (overflow_offset_known).
  void post_overflow_to(int z, uint32_t e, int d);
  // Whether our OVER write to d can go before every COUNTS arrived: its offset in d's overflow
  // region sums the overflow of the live sources below us remote to d, so their COUNTS must be in
  // (`missing`: bit r set while rank r's COUNTS of this dispatch are still to come). Always true for
  // the lowest remote source of d, e.g. both ranks at N = 2.
  bool overflow_offset_known(int z, int d, uint64_t missing) const;
  void signal_free_d(int z, uint32_t e);
  // rows_from[src]: rows we received from src in the matching dispatch; c_send holds them at
  // [src][P][stride] (stride = H * output itemsize). Src's run goes to every remote member m of
  // its tp group at row (src % tp) * Q + combine_offsets(z)[src] of m's region (the snapshot of
  // the matching dispatch); refused unless that offset + rows_from[src] <= Q and rows_from[src] is at
  // most the rows src sent us in that dispatch.
  void post_combine(int z, uint32_t c, const int32_t* rows_from, int64_t stride);
  // post_combine's writes to remote rank m alone.
  void post_combine_to(int z, uint32_t c, int m, const int32_t* rows_from, int64_t stride);
  // post_combine_to's writes in pieces: each member's COMB write is combine_pieces() writes (the
  // receiver expects that many: rails, JAX_MOE_A2A_COMB_PIECES); piece i of every member's write
  // alone. For row staging: piece i's rows copied (combine_send_rows_of_piece), then posted.
  int combine_pieces() const { return comb_pieces(); }
  void post_combine_piece(int z, uint32_t c, int m, const int32_t* rows_from, int64_t stride, int i);
  void signal_free_c(int z, uint32_t c);

  // ---- reading what landed -------------------------------------------------------------------
  // Count matrix of source src: [N dest][L] in counts_recv (valid after COUNTS).
  const int32_t* counts_of(int z, int src) const;
  // Rows src sends dst in this dispatch (sum over local experts).
  int64_t rows_between(int z, int src, int dst) const;
  // Writes this exchange posted beyond one per PRIV / OVER write (JAX_MOE_A2A_WRITE_CHUNK_KIB and
  // JAX_MOE_A2A_RAILS split them), and beyond one per COMB write (RAILS); any thread may read them.
  uint64_t pieces_posted() const { return rows_w_.extra.load(std::memory_order_relaxed); }
  uint64_t comb_pieces_posted() const { return comb_w_.extra.load(std::memory_order_relaxed); }
  // Bytes of rows this exchange wrote to rank d, summed over its steps: PRIV and OVER (row_bytes_to)
  // and COMB (comb_bytes_to); any thread may read them. What the wire carried of the rows, per peer.
  uint64_t row_bytes_to(int d) const { return rows_w_.bytes[d].load(std::memory_order_relaxed); }
  uint64_t comb_bytes_to(int d) const { return comb_w_.bytes[d].load(std::memory_order_relaxed); }
  // Writes this exchange posted to rank d, every piece counted: PRIV and OVER (row_writes_to; none
  // for an empty one) and COMB (comb_writes_to).
  uint64_t row_writes_to(int d) const { return rows_w_.writes[d].load(std::memory_order_relaxed); }
  uint64_t comb_writes_to(int d) const { return comb_w_.writes[d].load(std::memory_order_relaxed); }
  // over_base[src] (N entries): first row of src's overflow in our overflow region, for sources
  // remote to us (0 for others). Valid after COUNTS.
  void overflow_bases(int z, int64_t* over_base) const;
  // Byte offset of row j of remote source src in d_recv (or the packer's copy of it), given its
  // overflow base.
  int64_t landed_offset(int src, int64_t j, int64_t over_base) const;

  // ---- the combine offsets of slot z (a snapshot per slot) --------------------------------------
  // Records off[src] = combine_offset(src's count matrix, our rank) for every source (0 for a
  // source masked in slot z, or for all when we are masked ourselves): where src's rows start in
  // its part of the combine region. Call after COUNTS arrived from every live rank and before
  // FREE_D(e) goes out (after it a source may overwrite its count matrix in our d_recv with its
  // next dispatch's COUNTS, possibly before our combine_send): the inline driver in dispatch_recv,
  // the proxy at its "counts in" step. post_combine (and the host backend's node-local copy) read it.
  void take_combine_offsets(int z);
  const int64_t* combine_offsets(int z) const { return comb_off_[z].data(); }
  // A combine on slot z of the dispatch that ran on slot `from` (Communicator.combine_send's
  // `slot` argument): slot z's snapshot becomes slot from's (offsets and c_recv ranges). Call it
  // before the combine's post_combine / combine_landed_runs on z, and before slot from's next
  // take_combine_offsets (the proxy: at the combine's "packed" step, or at that dispatch's "counts
  // in" step if that comes first). No-op when from == z.
  void adopt_combine_offsets(int z, int from);

  // ---- the bytes each step moves, peer by peer (a packer whose rows live elsewhere: proxy/staging.h)
  // Ascending, adjacent ranges merged, empty ones left out; none for a rank that is not remote or
  // that slot z's mask leaves out. d_send: the rows for remote destination d that PRIV piece i of
  // private_pieces(z, d) reads (from counts_send, so after the packer wrote it); the last piece's
  // also holds d's OVER rows, so every row for d is copied once PRIV is out, before OVER may go.
  std::vector<ByteRange> send_rows_of_piece(int z, int d, int i) const;
  // c_send: what post_combine_piece(z, c, m, rows_from, stride, i) reads: piece i of the runs of m's
  // tp group's members.
  std::vector<ByteRange> combine_send_rows_of_piece(int z, int m, const int32_t* rows_from, int64_t stride,
                                                    int i) const;
  // d_recv: where piece `piece` of remote source src's PRIV (part 0 of expect_rows) or OVER (part 1)
  // landed (valid after COUNTS; over_base: overflow_bases(z)'s, or the proxy's published copy). A
  // packer whose rows live elsewhere copies each piece as it lands.
  ByteRange landed_piece(int z, int part, int src, int piece, const int64_t* over_base) const;
  // c_recv: where remote expert rank d writes the rows of our tp group's member j, [tp] runs, in the
  // combine of the dispatch whose offsets take_combine_offsets took last (at most: a rank that
  // dropped rows over capacity sends fewer), at `stride` bytes a row.
  std::vector<ByteRange> combine_landed_runs(int z, int d, int64_t stride) const;
  // Where piece i of a COMB write into `run` (one of combine_landed_runs) lands: the writer splits
  // by the run the receiver expects, not by the rows it has (it may have fewer), so the receiver
  // knows each piece's bytes.
  ByteRange combine_landed_piece(const ByteRange& run, int i) const {
    const ByteRange p = piece_of(run.len, comb_pieces(), i);
    return {run.off + p.off, p.len};
  }

 private:
  uint32_t imm(uint32_t tag, uint32_t epoch) const;
  int64_t rows_we_send(int z, int d) const;  // from our count matrix in counts_send
  // Bytes of source src's PRIV (part 0) or OVER (part 1) write to us, from its count matrix.
  int64_t landed_write_bytes(int z, int part, int src) const;
  // How a source's `rows` for one destination split between its private block (PRIV) and the
  // destination's shared overflow region (OVER): every sender and receiver computes it alike.
  int64_t priv_rows(int64_t rows) const { return std::min<int64_t>(rows, lay_.priv); }
  int64_t over_rows(int64_t rows) const { return std::max<int64_t>(0, rows - lay_.priv); }
  // PRIV and OVER writes in pieces of at most chunk_ bytes (JAX_MOE_A2A_WRITE_CHUNK_KIB; 0: one
  // write each) and, with rails_ > 1, at least rails_ pieces from kRailSplitBytes on, piece i on rail
  // i % rails_; every piece carries the write's immediate: pieces(bytes) writes, which the receiver
  // expects as that many arrivals of the immediate (it knows the bytes from the counts).
  int pieces(int64_t bytes) const;
  // A PRIV or OVER write's pieces: pieces(bytes), or 0 for no bytes. An empty row write is never
  // posted: the receiver knows each source's PRIV and OVER bytes from its count matrix (COUNTS
  // precede every wait for rows), so it awaits none, and each dispatch spares a message per peer
  // (OVER is empty unless rows overflow the private block; by default nothing overflows).
  int row_pieces(int64_t bytes) const;
  // Piece i of n of a write of `bytes`: equal pieces, the last one shorter, empty ones carrying only
  // the immediate. {offset in the write, length}.
  static ByteRange piece_of(int64_t bytes, int n, int i);
  // The bytes of piece i of n of a COMB write of `bytes` into a run of `nominal` bytes (the rows
  // the source sent us, which the receiver expects back): piece_of(nominal) cut to `bytes`.
  static ByteRange comb_piece_of(int64_t bytes, int64_t nominal, int n, int i);
  // Piece i's immediate: the write's immediate `im` (our rank in its rank field) with the rank field
  // i * N + rank, so the receiver tells the pieces apart (Arrivals::Part::piece_stride). Piece 0's
  // is the write's own. The constructor refuses sizes whose pieces would not fit 16 bits.
  uint32_t piece_imm(uint32_t im, int i) const { return im + uint32_t(i) * uint32_t(o_.shape.N); }
  // Our PRIV write to d: its source offset in d_send and its bytes (0 rows: 0).
  ByteRange private_write(int z, int d) const;
  // What a kind of row write posted: writes past the first of each split write, and per rank the
  // bytes and the writes (every piece counted).
  struct WriteCounts {
    std::atomic<uint64_t> extra{0};
    std::unique_ptr<std::atomic<uint64_t>[]> bytes;   // [N]
    std::unique_ptr<std::atomic<uint64_t>[]> writes;  // [N]: writes posted, every piece counted
  };
  // n pieces, counted in `counts` (rows_w_ or comb_w_).
  void write_pieces(int d, const transfer::Region& src, int64_t src_off, int64_t bytes,
                    const transfer::RemoteRegion* dst, int64_t dst_off, uint32_t imm, int n, WriteCounts& counts);
  // Piece i of n of that write alone (write_pieces posts every i in order).
  void write_piece(int d, const transfer::Region& src, int64_t src_off, int64_t bytes,
                   const transfer::RemoteRegion* dst, int64_t dst_off, uint32_t imm, int n, int i, WriteCounts& counts);
  // Piece i of n as the bytes p of the write (offsets from src_off / dst_off), with piece i's
  // immediate (piece_imm); n <= 1: the whole write on the peer's own rail.
  void write_range(int d, const transfer::Region& src, int64_t src_off, const ByteRange& p,
                   const transfer::RemoteRegion* dst, int64_t dst_off, uint32_t imm, int n, int i, WriteCounts& counts);
  void write_pieces(int d, const transfer::Region& src, int64_t src_off, int64_t bytes,
                    const transfer::RemoteRegion* dst, int64_t dst_off, uint32_t imm) {
    write_pieces(d, src, src_off, bytes, dst, dst_off, imm, row_pieces(bytes), rows_w_);
  }
  // COMB writes: a fixed count, rails_ or JAX_MOE_A2A_COMB_PIECES if more (zero-length ones too: a
  // receiver cannot know the bytes, a rank may have dropped rows over capacity), else one.
  int comb_pieces() const { return std::max(rails_, comb_split_); }
  // post_combine_to's check of the rows and offsets it would write (throws std::invalid_argument).
  void check_combine(int z, int m, const int32_t* rows_from, int64_t stride) const;
  static constexpr int64_t kRailSplitBytes = 64 << 10;
  int64_t chunk_ = 0;
  int rails_ = 1;  // the engine's domains (JAX_MOE_A2A_RAILS)
  int comb_split_ = 1;  // JAX_MOE_A2A_COMB_PIECES
  WriteCounts rows_w_;  // PRIV / OVER writes
  WriteCounts comb_w_;  // COMB writes
  Arrivals expect(std::vector<uint32_t> tags, const std::vector<int>& ranks, uint32_t epoch) const;
  Arrivals live(int z, Arrivals a) const;  // without the ranks slot z's mask marks dead
  // even_if_masked: also when slot z's mask marks us dead (else nothing then: we write nobody)
  Arrivals expect_owed(int z, uint32_t tag, const std::vector<uint32_t>& owed, bool even_if_masked = false) const;
  void owe(int z, uint32_t epoch, std::vector<uint32_t>& owed);
  void signal_remote(int z, uint32_t tag, uint32_t epoch);

  ExchangeOptions o_;
  SlotLayout lay_;
  int rank_;
  std::shared_ptr<transfer::Engine> engine_;
  std::vector<SlotBuffers> bufs_;
  struct Regions;
  std::vector<Regions> regions_;
  std::vector<int> all_, remote_;
  std::vector<std::vector<uint8_t>> alive_;  // [slot][N]
  std::vector<std::vector<int64_t>> comb_off_;  // [slot][N src]: take_combine_offsets
  // [slot][remote rank d][tp member j]: take_combine_offsets' c_recv run that d writes for our
  // group's member j, in rows
  std::vector<std::vector<std::vector<ByteRange>>> comb_runs_;
  // [slot][N src]: take_combine_offsets' rows src sent us, the run each COMB write of ours to src's
  // group fills (comb_piece_of's nominal)
  std::vector<std::vector<int64_t>> comb_nominal_;
  // [slot][N]: the FREE_D / FREE_C epoch + 1 each rank owes us (expect_owed_free_d; 0: none)
  std::vector<std::vector<uint32_t>> owed_d_, owed_c_;
};

}  // namespace a2a::protocol
