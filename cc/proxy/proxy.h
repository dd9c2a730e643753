// The proxy: one worker thread per rank that drives the route-exchange protocol
// (protocol::Exchange) for the rank's remote peers, reacting to the flags its packer raises in the
// Ctrl block (cc/core/ctrl.h) and raising flags back. Used by the cuda backend for peers on other
// nodes (the kernels pack and unpack pinned host memory) and by the host backend's proxied mode
// (C++ packs), which is how the state machine is tested on machines without GPUs.
//
// Each slot runs two independent pipelines of steps, advanced without ever blocking:
//   dispatch: FREE (FREE_D(e-1) in, writes flushed) -> raise d_send_ok | on d_counts: COUNTS out |
//             on d_packed: PRIV out | COUNTS in: the combine offsets' snapshot
//             (Exchange::take_combine_offsets; a combine already packed is posted first), OVER
//             out, over_base + c_off | PRIV+OVER in: raise d_landed | on d_consumed: FREE_D(e) out, next epoch
//   combine:  FREE (FREE_C(c-1) in, flushed) -> raise c_send_ok | on c_packed: COMB out |
//             COMB in: raise c_landed | on c_consumed: FREE_C(c) out, next epoch
// With row staging (proxy/staging.h: the packer's rows live apart from the registered buffers) four
// steps copy before they go on: d_packed -> copy d_send -> PRIV out; PRIV+OVER in -> copy d_recv ->
// d_landed; c_packed -> copy c_send -> COMB out; COMB in -> copy c_recv -> c_landed. Each copy is
// started once and polled.
// Failure: a step whose kernel waits (Ctrl::waiting) longer than the timeout, or any transport
// error, writes Ctrl::error (op, slot, missing ranks, message) and stops the machine; waiters see
// the error code. Idle: polls for spin_us after the last progress and while a packer waits for a
// flag not yet raised (Ctrl::waiting; at most 10 s without progress), then sleeps from 1 us
// growing to max_sleep_us, and after idle_ms up to idle_sleep_us (a communicator nobody uses costs
// ~nothing); never spins forever; a packer's wake() ends a sleep and counts as progress.
// Shutdown: stop() (idempotent) joins the thread.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "protocol/exchange.h"
#include "core/ctrl.h"
#include "proxy/staging.h"
#include "proxy/timeline.h"

namespace a2a::proxy {

// The flag block (core/ctrl.h) that the proxy drives, under the proxy's names.
using ctrl::Ctrl;
using ctrl::error_code;
using ctrl::kMaxRanks;
using ctrl::kMaxSlots;
using ctrl::load_acquire;
using ctrl::ProxyError;
using ctrl::SlotCtrl;
using ctrl::store_release;

struct ProxyOptions {
  double spin_us = 20;        // JAX_MOE_A2A_PROXY_SPIN_US: keep polling this long after progress
  double max_sleep_us = 100;  // JAX_MOE_A2A_PROXY_MAX_SLEEP_US: longest sleep in the first idle_ms
  double idle_ms = 20;        // JAX_MOE_A2A_PROXY_IDLE_MS: after this long without progress ...
  double idle_sleep_us = 2000;  // JAX_MOE_A2A_PROXY_IDLE_SLEEP_US: ... sleeps grow up to this
  bool spin = false;          // JAX_MOE_A2A_PROXY=spin: never sleep (a dedicated core)
  // JAX_MOE_A2A_PROXY=adaptive (the default): also poll, not sleep, while a transfer is under way
  // (Proxy::op_under_way: its next step waits on a peer or a copy, which wake nobody) and after a
  // wake until a step moves (at most idle_ms); `backoff`: sleep by the back-off whenever no packer waits on us
  // (the behaviour before 2026-12-05, twentieth session; measured against `poll` in
  // benchmarks/proxy.py's modes).
  bool poll_in_flight = true;
  int cpu = -1;               // pin the thread to this CPU (-1: leave it to the scheduler)
  // JAX_MOE_A2A_COPY_DEPTH: row staging's copies of one buffer in flight at once, 1..kCopyDepth
  // (1: each copy waits for the one before; fewer copies queue on the copy engines when several
  // processes share a GPU).
  int copy_depth = kCopyDepth;
  // JAX_MOE_A2A_PROXY_PIPELINE: `peer` (default) posts each remote peer's PRIV write as soon as the
  // packer raised that peer's d_packed_to (one write per peer still) and, with source_flags, raises
  // d_placed / d_landed_from[src] and c_landed_from[d] for a receiver that unpacks per source; `off`
  // waits for d_packed and posts every peer's write together, and raises only d_landed (the series
  // behaviour before). `peer` also posts each OVER write as soon as its offset is known
  // (over_early: Exchange::overflow_offset_known, before every peer's COUNTS arrived); `priv` is
  // `peer` with the OVER writes after every COUNTS, as before 2026-12-07.
  bool pipeline = true;
  bool over_early = true;
  // JAX_MOE_A2A_PROXY_REPORT_S: a slot with an op in flight whose steps have not moved for this
  // many seconds prints its flags and our steps once to stderr (a report, not an error: see
  // Proxy::report_stalls); negative (unset): the exchange's timeout_s; 0: never.
  double report_s = -1;
  // JAX_MOE_A2A_PROXY_TIMELINE=<prefix>: record every step's time and write them when the proxy
  // stops (proxy/timeline.h); empty: off.
  std::string timeline;
  // Not from the environment: the packer opts in when its receiver reads the per-source landing
  // flags (the host backend's does; the cuda kernels read only d_landed and c_landed).
  bool source_flags = false;
  // JAX_MOE_A2A_PROXY_CPUS="3,7" gives local rank i the i-th CPU, "none" pins nothing; unset, a
  // GPU's proxy (device_bus_id, as cudaDeviceGetPCIBusId writes it) goes to a CPU of the GPU's
  // NUMA node (proxy/topology.h), the (local_index + node-local process rank)-th from the highest,
  // and a proxy without a GPU is not pinned.
  static ProxyOptions from_env(int local_index, const std::string& device_bus_id = "");
};

// Where the proxy raises its flags for the kernels. By default in the Ctrl block itself (mapped
// pinned host memory on GPUs, plain memory on CPUs). With `mirror` (GDRCopy, proxy/gdrcopy.h: a
// Ctrl in GPU memory mapped through the BAR) every proxy-written field (d_send_ok, d_landed,
// c_send_ok, c_landed, over_base, c_off, the error record) is stored there too, with a store fence
// between data and flag and after the flag; the kernels read the mirror, the proxy never does.
struct FlagPath {
  Ctrl* mirror = nullptr;
  std::string name = "mapped-host";  // proxy_stats()["flag_path"]: "gdrcopy" or "mapped-host: <why>"
  // Called before the proxy raises d_landed or c_landed: makes the rows the transport delivered
  // visible to the kernels where its copies may still be in flight (the cuda path with rows in GPU
  // memory: copies a provider queued on the CUDA legacy stream). Throws on failure. Empty: none.
  std::function<void()> landing_fence;
};

// Counters a benchmark reads (nanoseconds of steady_clock, summed over steps).
struct ProxyStats {
  uint64_t dispatches = 0, combines = 0;              // steps finished (the FREE signal sent)
  uint64_t dispatches_landed = 0, combines_landed = 0;  // d_landed / c_landed raised (rows readable)
  uint64_t polls = 0, sleeps = 0;
  uint64_t woken = 0;  // sleeps a packer's wake() cut short
  // Sleeps taken while a transfer was under way (Proxy::op_under_way): 0 under the default
  // JAX_MOE_A2A_PROXY=adaptive unless 10 s passed without progress; `backoff` takes them whenever
  // no packer waits, each delaying the step after it by up to the sleep.
  uint64_t sleeps_under_way = 0;
  uint64_t counts_to_landed_ns = 0;  // from our COUNTS out to d_landed raised, per dispatch
  uint64_t comb_to_landed_ns = 0;    // from our COMB out to c_landed raised, per combine
  int cpu = -1;                      // the CPU the thread was pinned to (-1: not pinned)
  std::string flag_path;             // FlagPath::name
  std::string row_path;              // cuda inter-node path: "host", "copy" or "device" (JAX_MOE_A2A_STAGING); "" elsewhere
  int rails = 1;                     // the engine's domains (JAX_MOE_A2A_RAILS or the backend's default)
  uint64_t staged_bytes = 0;         // bytes the row staging copied (both directions)
  uint64_t staging_ns = 0;           // from each copy's start to the poll that saw it done, summed
  // The same copies' wall time: how long at least one copy was in flight (any slot, buffer or
  // direction). Up to copy_depth copies overlap, so staging_ns can exceed it many times over.
  uint64_t staging_busy_ns = 0;
  // The packer's side, per op (protocol::Op order), host backend's proxied mode only (the cuda
  // path's are its kernel times): time in the calls and the part spent waiting for the proxy's
  // flags, summed. pack / unpack = call - wait.
  uint64_t packer_call_ns[kNumHalves] = {}, packer_wait_ns[kNumHalves] = {};
  bool pipeline = true;              // ProxyOptions::pipeline
  uint64_t priv_early = 0;           // PRIV writes posted before the whole pack (d_packed) was done
  uint64_t over_early = 0;           // OVER writes posted before every rank's COUNTS arrived
  uint64_t counts_to_priv_ns = 0;    // from our COUNTS out to our last PRIV write posted, per dispatch
  // Host backend's proxied mode under `peer`: remote sources whose rows dispatch_recv unpacked
  // before d_landed was raised (the rest still in flight). 0 when it waits for d_landed.
  uint64_t recv_early = 0;
  // Row staging: copies of landed dispatch rows to the packer's buffer started while other rows
  // were still in flight (the landed rows are copied as they land: each copy takes every piece of
  // every source's writes that landed since the last one).
  uint64_t staged_early = 0;
  uint64_t comb_staged_early = 0;  // the same for the landed COMB rows of remote expert ranks
  // Of those (both), copies holding a piece of a write whose later pieces were still in flight
  // (writes in pieces: JAX_MOE_A2A_WRITE_CHUNK_KIB, COMB_PIECES, RAILS).
  uint64_t pieces_copied_early = 0;
  // Row staging: the most copies of one buffer in flight at once (up to ProxyOptions::copy_depth).
  uint64_t copies_in_flight_max = 0;
  // The engine's time in posts and the part of it retrying on a full queue (Engine::post_ns,
  // post_blocked_ns): whether the proxy thread waits in its writes.
  uint64_t post_ns = 0, post_blocked_ns = 0;
  // The engine's progress threads: completions they handled, and their polls while this proxy
  // held them polling (a transfer under way; Engine::hold_progress; 0 under PROGRESS=backoff).
  uint64_t progress_events = 0, progress_held_polls = 0;
  // The proxy's polls that moved the transport themselves (Engine::progressing_polls; 0 with
  // POLL_PROGRESS=0, the default).
  uint64_t progressing_polls = 0;
  // Row staging with PRIV (JAX_MOE_A2A_WRITE_CHUNK_KIB) or COMB (JAX_MOE_A2A_COMB_PIECES) in pieces:
  // pieces posted while the copy of the same destination's next piece ran (the wire overlapping the
  // copies; 0 with one piece a write).
  uint64_t pieces_behind_copy = 0;
  // PRIV / OVER writes posted beyond one per peer (JAX_MOE_A2A_WRITE_CHUNK_KIB: written in pieces).
  uint64_t write_pieces = 0;
  uint64_t comb_pieces = 0;  // COMB writes posted beyond one per (rank, tp member) (JAX_MOE_A2A_RAILS)
  // Bytes of rows written to each rank [N]: PRIV + OVER (dispatch) and COMB (combine), summed over
  // steps (protocol::Exchange::row_bytes_to / comb_bytes_to): the wire's share of the rows.
  std::vector<uint64_t> row_bytes_to, comb_bytes_to;
  // Writes this rank posted to each rank (Exchange::row_writes_to / comb_writes_to): PRIV and OVER,
  // every piece counted, none for an empty one; COMB, every piece.
  std::vector<uint64_t> row_writes_to, comb_writes_to;
};

class Proxy {
 public:
  // Starts the thread. `ex` (connected), `ctrl` and `staging` (null: the packer writes the
  // registered buffers itself) outlive the proxy. Returns after staging->prepare() ran on the
  // thread (rethrows its failure).
  Proxy(protocol::Exchange& ex, Ctrl* ctrl, const ProxyOptions& o, FlagPath flags = {}, RowStaging* staging = nullptr);
  ~Proxy();
  Proxy(const Proxy&) = delete;
  Proxy& operator=(const Proxy&) = delete;

  void stop();  // idempotent; joins the thread (a sleep in progress is cut short)
  // Called by a packer after it raised a flag the proxy reads (or when it is about to: the cuda
  // backend's launches): a sleep of the idle back-off ends now, and the thread treats the call as
  // progress (it polls for spin_us, then sleeps at most max_sleep_us for idle_ms) instead of
  // noticing the flag after up to idle_sleep_us. Cheap when the thread is awake (one atomic
  // increment and load); any thread may call it at any time.
  void wake();
  bool failed() const { return error_code(ctrl_) != 0; }
  std::string error_text() const;  // "" while healthy
  ProxyStats stats() const;

 private:
  // k*Copy: the row staging's copies of the step before are in flight; without staging the step
  // before falls through to it at once.
  enum DStage { kDFree, kDCounts, kDPriv, kDSendCopy, kDCountsIn, kDRowsIn, kDRecvCopy, kDConsumed };
  enum CStage { kCFree, kCPacked, kCSendCopy, kCLanded, kCRecvCopy, kCConsumed };
  struct SlotState {
    DStage d = kDFree;
    CStage c = kCFree;
    uint32_t de = 0, ce = 0;
    protocol::Arrivals d_wait, c_wait;
    bool d_armed = false, c_armed = false;  // d_wait / c_wait built for the current stage
    std::chrono::steady_clock::time_point d_since{}, c_since{};  // kernel started waiting (0: not yet)
    std::chrono::steady_clock::time_point counts_out{}, comb_out{};
    // staging: c_recv's runs each remote rank writes [N][tp member], taken when our combine was packed
    std::vector<std::vector<protocol::ByteRange>> comb_in;
    // Per epoch (cleared by next_dispatch / next_combine, the only places an epoch ends):
    bool c_adopted = false;  // the packed combine took its dispatch's combine offsets (adopt())
    uint64_t priv_posted = 0;  // bit d: our PRIV write of this epoch to remote rank d is posted
    uint64_t over_posted = 0;  // bit d: our OVER write of this epoch to remote rank d went out early
    uint64_t src_landed = 0;   // bit src: d_landed_from[src] raised for this epoch
    uint64_t comb_landed = 0;  // bit d: c_landed_from[d] raised for this combine epoch
    // Row staging of landed rows (stage_by_source), per entry of the step's wait (one piece of one
    // remote rank's write): state[part][k], entry k of that part not yet in a copy (0), in a copy
    // in flight (1) or copied, or with nothing to copy (2); `in_flight`, the copies started, in
    // order, each with its entries ({part, k}).
    struct LandedCopies {
      struct Copy {
        uint64_t ticket;
        std::vector<std::pair<int, size_t>> entries;
      };
      std::vector<std::vector<uint8_t>> state;
      std::deque<Copy> in_flight;
    };
    LandedCopies d_src;  // the dispatch's landed rows
    // Row staging of one kind of send in pieces (Exchange::private_pieces / combine_pieces; one piece
    // for a write in one): `queued`, pieces whose copies were started (ticket; 0: nothing to copy),
    // in order, not yet posted; `who`, the peer whose pieces are still being started, from piece
    // `next` (-1: none); bit d of `started`, every piece of peer d started this epoch.
    struct SendPieces {
      struct Piece {
        int who, piece;
        uint64_t ticket;
      };
      std::deque<Piece> queued;
      int who = -1, next = 0;
      uint64_t started = 0;
    };
    SendPieces d_send_pieces;  // our PRIV (and OVER) rows for each destination
    uint64_t comb_posted = 0;  // bit m: our COMB writes of this combine epoch to remote rank m are posted
    LandedCopies c_src;        // the combine's landed COMB rows
    SendPieces c_send_pieces;  // our COMB rows for each remote rank (its tp group's, once per group)
    uint64_t comb_groups_started = 0;  // row staging, bit g0: the COMB rows of tp group g0.. are being copied
    uint64_t comb_groups_copied = 0;   // ... are copied
    // Row staging: each buffer's copies started and not yet seen done, in order (at most copy_depth).
    struct Copy {
      uint64_t ticket, bytes;
      std::chrono::steady_clock::time_point since;
    };
    std::deque<Copy> copies[kRowBuffers];
    // Stall reports (report_stalls): the steps as last seen, since when, and whether this stall
    // was reported (once per stall; a step re-arms it).
    int seen_d = -1, seen_c = -1;
    uint32_t seen_de = 0, seen_ce = 0;
    std::chrono::steady_clock::time_point steps_since{}, stall_checked{};
    std::chrono::steady_clock::time_point busy_since{};  // first look that found an op in flight (0: none yet)
    bool stall_reported = false;
    // The dispatch (combine) of this epoch is done (its FREE signal sent): the next epoch starts
    // at kDFree (kCFree) with that pipeline's per-epoch bits clear.
    void next_dispatch();
    void next_combine();
  };

  void run();
  bool step_dispatch(int z, SlotState& s);
  // Row staging of landed rows (buffer b: kDRecv or kCRecv) as they land: each poll starts one copy
  // of every entry of `wait` (a piece of a remote rank's write) seen and in no copy yet, its bytes
  // ranges_of(part, rank, piece), while earlier copies still run (up to copy_depth). Once every
  // entry of rank r landed and is copied, flags[r] (d_landed_from / c_landed_from) for a packer that
  // reads them; `early` counts the copies started while other writes were still missing. True once
  // every entry is copied. Never blocks; `moved` is set when it started or finished a copy.
  bool stage_by_source(int z, SlotState& s, uint32_t e, RowBuffer b, int op, const protocol::Arrivals& wait,
                       SlotState::LandedCopies& lc, uint64_t& flagged, uint64_t* flags,
                       const std::function<protocol::ByteRange(int, int, int)>& ranges_of,
                       uint64_t ProxyStats::*early, bool* moved);
  // stage_by_source for the dispatch's landed PRIV / OVER rows and the combine's landed COMB rows.
  bool stage_landed(int z, SlotState& s, uint32_t e, bool* moved);
  bool stage_comb_landed(int z, SlotState& s, uint32_t e, bool* moved);
  // Posts PRIV to each remote destination whose rows are packed (every one once d_packed is up,
  // d's alone under `peer` once its d_packed_to is). Under row staging each destination's rows are
  // copied to the registered buffer first, piece by piece (pump_pieces), its last copy with its
  // OVER rows (which go out later). True once every remote destination's PRIV is posted; *moved:
  // whether a write went out or a copy started or ended. Never blocks.
  bool post_sends(int z, SlotState& s, uint32_t e, bool* moved);
  // Row staging's sends of the combine (pump_pieces): each remote rank's COMB rows copied once per
  // tp group, piece by piece (Exchange::combine_pieces), each piece posted as its copy ends; the
  // group's other members get every piece once the group's copies are done. True once every COMB is
  // posted. Never blocks.
  bool stage_combine_sends(int z, SlotState& s, uint32_t e, bool* moved);
  bool step_combine(int z, SlotState& s);
  // Whether the kernel of `op` waits for epoch e; starts / checks its clock. Throws on timeout.
  void check_late(int op, int z, uint32_t e, const protocol::Arrivals& a, const char* what,
                  std::chrono::steady_clock::time_point& since);
  void fail(int code, int op, int z, const std::vector<int>& missing, const std::string& text);
  // Slot z's flags as the proxy sees them and our steps: what a timeout and a stall report print,
  // enough to tell a packer that never raised a flag from an arrival that never came.
  std::string slot_state(int z) const;
  // Why slot z has an op in flight, "" when it rests. Resting: the dispatch waits for our packer's
  // d_counts (kDCounts) and the combine for its c_packed (kCPacked), with no sign of an op: no
  // kernel of ours waits on that half (Ctrl::waiting) and no peer's COUNTS of that epoch came.
  std::string in_flight(int z) const;
  // Every slot whose steps have not moved for report_s while in_flight: prints slot_state once to
  // stderr (no GIL, no kernel needed: the report of a rank whose packer never came, which no
  // timeout of ours names, as its kernel never waited). From run()'s idle path.
  void report_stalls();
  // Raises slot z's proxy-written flag `field` to v (release) in ctrl_ and, with a mirror, there
  // after a store fence (earlier mirror stores land first), followed by one (sent now).
  void raise(int z, uint64_t SlotCtrl::*field, uint64_t v);
  // Does a packer wait for a flag we have not raised yet (Ctrl::waiting[op] past the flag of op)?
  bool packer_waiting() const;
  // Has any slot a transfer under way: a dispatch between our packer's d_counts and its landing,
  // or a combine between c_packed and its landing, whose next step waits on a peer's write or a
  // copy (neither wakes us) or on our kernel's d_packed, raised right after its d_counts.
  bool op_under_way() const;
  // Slot z's packed combine takes the combine offsets of its dispatch's slot (c_from_slot), once.
  void adopt(int z, SlotState& s);
  void publish_landing(int z);  // slot z's over_base and c_off (and their mirror), before d_landed
  // Per-source flags (source_flags_): raises flags[r] = e + 1 (d_landed_from of a dispatch's wait,
  // c_landed_from of a combine's) for the remote ranks whose rows all arrived in `wait` (every
  // remote rank when `all`), once each per epoch: bit r of `raised` records it.
  void raise_landed(const protocol::Arrivals& wait, uint64_t& raised, uint64_t* flags, uint32_t e, bool all);
  // Whether destination d's rows of epoch e are packed: every destination's once d_packed is up
  // (`all`), d's alone under `peer` once its d_packed_to is.
  bool rows_packed_for(const SlotCtrl& c, uint32_t e, int d, bool all) const;
  // Posts our PRIV write of epoch e to d (timeline marks, priv_posted); `early`: before the whole
  // pack was done (counted in priv_early).
  void post_priv(int z, SlotState& s, uint32_t e, int d, bool early);
  // Row staging of one kind of send in pieces (PRIV, COMB), never blocking: posts every queued piece
  // whose copy is done, in order (post(who, i); finish(who) after a peer's last piece, or at once
  // for a peer with none), then starts copies, back to back while copy_depth allows, of the current
  // peer's remaining pieces (ranges_of(who, i); count(who) pieces) and then of the peers next_peer()
  // returns (-1: none now), then posts again. So piece i of a peer is on the wire while the copies
  // of its later pieces run. *moved: whether a piece was posted or a copy started.
  template <class NextPeer, class Count, class Ranges, class Post, class Finish>
  void pump_pieces(int z, SlotState& s, uint32_t e, RowBuffer b, int op, SlotState::SendPieces& q,
                   const NextPeer& next_peer, const Count& count, const Ranges& ranges_of, const Post& post,
                   const Finish& finish, bool* moved);
  void priv_out(SlotState& s, int d, bool early);  // PRIV to d is out: priv_posted, priv_early
  // Every PRIV write of the dispatch is posted (pipelined or not): counts_to_priv_ns, then on to
  // the counts-in step.
  void privs_out(SlotState& s);
  // While slot z's COUNTS are still coming (kDCountsIn): posts the OVER write of every remote rank
  // whose PRIV is out and whose overflow offset is known already (ProxyOptions::over_early).
  // Returns whether it posted any.
  bool post_overflow_early(int z, SlotState& s, uint32_t e);
  // Starts a copy of `ranges` of (z, b) after the ones in flight; returns its ticket. Only while
  // can_stage(s, b): fewer than o_.copy_depth of (z, b)'s copies in flight.
  uint64_t stage(int z, SlotState& s, RowBuffer b, const std::vector<protocol::ByteRange>& ranges);
  // Row copies in flight over every slot and buffer (their queues' lengths).
  size_t copies_in_flight() const {
    size_t n = 0;
    for (const SlotState& s : slots_)
      for (const auto& q : s.copies) n += q.size();
    return n;
  }
  bool can_stage(const SlotState& s, RowBuffer b) const {
    return s.copies[static_cast<int>(b)].size() < size_t(o_.copy_depth);
  }
  // Polls copy `ticket` of (z, b): true once it (and every older one) is done, counting their bytes
  // and time. Past the timeout while our kernel of `op` (the receive half that spins behind the
  // copy) waits for epoch e, throws naming the buffer (a copy engine that never finishes: no peer
  // is missing).
  bool staged(int z, SlotState& s, RowBuffer b, int op, uint32_t e, uint64_t ticket);
  // Throws as staged() does when (z, b)'s oldest copy in flight is older than the timeout and our
  // kernel of op waits for epoch e.
  void copy_late(int z, const SlotState& s, RowBuffer b, int op, uint32_t e) const;

  protocol::Exchange& ex_;
  Ctrl* ctrl_;
  ProxyOptions o_;
  FlagPath flags_;
  RowStaging* staging_;
  // Since when a row copy has been in flight, over every slot and buffer (staging_busy_ns); the
  // proxy thread's only.
  std::chrono::steady_clock::time_point busy_since_{};
  // Fixed at construction: raise d_placed and the per-source landing flags (pipeline and
  // source_flags), and raise each as its rows arrive, on the polls before d_landed / c_landed (not
  // under staging: staged rows are readable after their copy; nor with a landing fence: device rows
  // are readable after it), rather than all together with d_landed / c_landed.
  bool source_flags_ = false, source_flags_early_ = false;
  std::vector<SlotState> slots_;
  Timeline timeline_;  // the proxy thread's marks; written by stop() after the join
  std::atomic<bool> stop_{false};
  // wake(): wakes_ counts the calls; the thread sleeps on wake_cv_ (under wake_mu_) with
  // sleeping_ set, and wake() takes the lock and notifies only then (seq_cst on both sides: a
  // wake between the thread's last poll and its wait is never lost).
  std::atomic<uint64_t> wakes_{0};
  std::atomic<bool> sleeping_{false};
  std::mutex wake_mu_;
  std::condition_variable wake_cv_;
  // Sleeps up to `us` or until wake() / stop() after `seen` wakes: true when a wake ended it.
  bool sleep_unless_woken(double us, uint64_t seen);
  std::thread thread_;
  int pinned_ = -1;  // the CPU the thread runs on, when pinning succeeded
  mutable std::mutex stats_mu_;
  ProxyStats stats_;
  int cur_op_ = -1, cur_slot_ = -1;  // the step being run (error attribution)
};

}  // namespace a2a::proxy
