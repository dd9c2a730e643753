// The `host` backend: the route-exchange protocol of the EFA design executed by C++ on CPUs
// (docs/protocol.md), over any TransferEngine (LocalEngine inside one process,
// libfabric between processes). One HostComm per (communicator, process) holds one RankComm per
// local rank; the FFI handlers (cc/ffi/host_handlers.cc) find them by communicator id and rank.
//
// RankComm plans, packs and unpacks (the work the cuda backend's kernels do); the protocol between
// packing and unpacking is protocol::Exchange (cc/protocol/exchange.h, docs/protocol.md), driven
// either inline on the calling thread (the default) or, with `proxied`, by a proxy thread
// (cc/proxy) exactly as the cuda backend drives it for remote peers: RankComm then plays the
// kernels' part, raising and waiting on the flags of a Ctrl block in plain memory. That mode is
// how the proxy's state machine is tested on machines without GPUs. With node_size > 0 it also
// plays the cuda backend's node-local path: ranks of one node (all in this process) copy rows
// straight into each other's memory with epoch flags, and only pairs on different nodes go
// through the proxy.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "core/config.h"
#include "core/floats.h"
#include "core/moe_layout.h"
#include "protocol/exchange.h"
#include "proxy/proxy.h"
#include "proxy/staging.h"
#include "transfer/engine.h"

namespace a2a::ctrl {
struct Ctrl;  // core/ctrl.h
}  // namespace a2a::ctrl

namespace a2a::proxy {
class Proxy;
struct ProxyStats;
}  // namespace a2a::proxy

namespace a2a::host {

// Transport (core/config.h): priv_rows -1 is rows_per_peer (never overflows); node_size counts
// only when proxied (0: no two ranks share a node).
struct HostOptions : TransportOptions {
  MoeShape shape{};
  ElemKind wire = ElemKind::kBF16;  // dispatch wire dtype
  bool pow2_scale = false;
  bool proxied = false;             // run the protocol on a proxy thread (cc/proxy), as the cuda backend does
};

// The host backend's options from the communicator's Config (shape_of(c) and its transport).
HostOptions host_options(const Config& c);

// Bytes per rank of each buffer region the host backend allocates for `c` (all slots), in
// allocation order: the one place these sizes are computed (Python reports them, never recomputes).
std::vector<std::pair<std::string, int64_t>> buffer_regions(const Config& c);

using protocol::SlotLayout;

// One dispatch's inputs on one rank (views of XLA buffers).
struct DispatchSendArgs {
  const void* x;              // [T, H] in x_kind (or fp8 with x_scale)
  ElemKind x_kind;
  const float* x_scale;       // [T, S] when x is already fp8, else null
  const int32_t* ids;         // [T, K]
  const float* weights;       // [T, K]
  int num_tokens;
  int slot;
  // outputs
  int32_t* handle;            // [2]: epoch, slot
  int32_t* dest;              // [T, K]
  int32_t* pair_slot;         // [T, K] compact combine index (SendPlan::comb_slot), 0 if not routed
  int32_t* dropped;           // []
  const int32_t* alive = nullptr;  // [N] rank mask (elastic EP; 0 = masked), null: every rank alive
};

struct DispatchRecvArgs {
  const int32_t* handle;      // [2]
  int slot;
  void* x;                    // [R', H] wire dtype
  float* scale;               // [R', S] or null
  int32_t* group_sizes;       // [L]
  float* weights;             // [R']
  int32_t* src;               // [R', 2]
  int32_t* recv_slot;         // [R']
  int32_t* recv_counts;       // [N]
  int32_t* overflow;          // []
  const int32_t* alive = nullptr;  // [N] rank mask of the dispatch, or null
};

struct CombineSendArgs {
  const void* y;              // [R', H] in y_kind
  ElemKind y_kind;
  const int32_t* recv_src;    // [R'] source rank per row, -1 past the counts (row stride 2: src[:, 0])
  int64_t recv_src_stride;
  const int32_t* recv_slot;   // [R']
  const int32_t* recv_counts; // [N]
  int slot;
  int from_slot;              // the slot of the dispatch whose rows these are (may differ from slot)
  int32_t* handle;            // [2]
  const int32_t* alive = nullptr;  // [N] rank mask of the dispatch, or null
};

struct CombineRecvArgs {
  const int32_t* handle;      // [2]
  ElemKind y_kind;
  const int32_t* dest;        // [T, K]
  const int32_t* pair_slot;   // [T, K]: the row of (t, k) is at ((t % tp) * Q + pair_slot) * stride
  const float* weights;       // [T, K]
  int num_tokens;
  const void* out_in;         // [T, H] or null
  ElemKind out_in_kind;
  int slot;
  void* out;                  // [T, H] in out_kind
  ElemKind out_kind;
  float* pairs;               // [T, K, H] f32 unweighted row of every pair (0 if none), or null
  const int32_t* alive = nullptr;  // [N] rank mask of the dispatch, or null
};

class RankComm {
 public:
  RankComm(const HostOptions& o, int rank, std::shared_ptr<transfer::Engine> engine);
  ~RankComm();

  int rank() const { return rank_; }
  transfer::Engine& engine() { return ex_->engine(); }
  double timeout_s() const { return o_.timeout_s; }
  // Descriptors: the Exchange's (its regions, then its piece settings), then the recovery table's.
  std::vector<transfer::Bytes> descriptors() const;
  // Peers' descriptors in the same order, for every rank (ours included); `locals`: this process's
  // ranks (the node-local path needs every rank of our node among them). Starts the proxy.
  void connect(const std::map<int, std::vector<transfer::Bytes>>& descriptors, const std::map<int, RankComm*>& locals);
  // Before the engines connect: the exchange's descriptors of every rank (Exchange::check_peers).
  void check_peers(const std::map<int, std::vector<transfer::Bytes>>& descriptors) const;
  bool connected() const { return connected_; }
  // Before the engine closes (HostComm::close): waits until every peer signalled the FREE_D /
  // FREE_C it still owes us (a peer may still be reading the last step's rows we wrote it, and
  // signals FREE after: into a closed engine its write could never complete) and our own writes
  // are done. Inline mode: what Exchange::expect_all_owed lists, every slot (not from a masked peer); proxied
  // mode: the proxy raised every slot's d_send_ok / c_send_ok for the next epoch (it got the FREE
  // signals of the last one and flushed). Throws transfer::TimeoutError past timeout_s (a peer
  // that died, or never ran the step's receive half).
  void drain();
  // Stops the proxy thread (if any); idempotent.
  void stop();
  // The proxy thread's counters and flag path (proxied mode; zeros and "" without a proxy).
  proxy::ProxyStats proxy_stats() const;

  void dispatch_send(const DispatchSendArgs& a);
  void dispatch_recv(const DispatchRecvArgs& a);
  void combine_send(const CombineSendArgs& a);
  void combine_recv(const CombineRecvArgs& a);

  // ---- recovery after a peer failure (HostComm::recover drives the phases on every local rank) --
  // alive: the survivors (this rank among them; a masked rank does none of this). gen: the
  // recovery's generation, the same on every survivor.
  void recover_flush();                                              // our writes done, dead peers' errors dropped
  void recover_post(const std::vector<uint8_t>& alive, uint32_t gen);  // our epochs to every survivor
  void recover_wait(const std::vector<uint8_t>& alive, uint32_t gen, int phase);  // phase 0 tables, 1 done
  void recover_apply(const std::vector<uint8_t>& alive, uint32_t gen);  // drop stale arrivals, agree epochs
  void recover_done(const std::vector<uint8_t>& alive, uint32_t gen);   // "I have dropped mine"
  // Runs `write` (a recovery write to rank r) with its posting bounded by timeout_s: a full queue
  // past it (r's process gone) raises the recovery's timeout naming r. phase as recover_wait's.
  void recover_write(int r, int phase, const std::function<void()>& write);
  bool inline_mode() const { return !o_.proxied && node_.empty(); }

 private:
  struct Slot;
  // Proxied mode: wait until *flag >= want, a flag the proxy raises (peer < 0) or node-local rank
  // `peer` raises; else throw the proxy's error or, past the timeout (plus a margin for the proxy's
  // flags, which the proxy times out itself), our own naming the peer. The wait's time is added to
  // wait_ns_[op] when `timed` (the call of op waits; drain's waits are in no call).
  void wait_flag(const uint64_t* flag, uint64_t want, int op, int slot, int peer = -1, bool timed = true);
  // Proxied mode, for benchmarks/proxy.py's breakdown (ProxyStats' packer_* fields): per op
  // (protocol::Op) the time in the call and the part of it spent in wait_flag, summed. Atomic adds:
  // two ops of one rank may run at once on different XLA threads.
  uint64_t op_ns_[4] = {}, wait_ns_[4] = {};
  uint64_t recv_early_ = 0;  // ProxyStats::recv_early (atomic adds)
  // Proxied, JAX_MOE_A2A_PROXY_PIPELINE=peer and no flag mirror: dispatch_recv unpacks each remote
  // source's rows once the proxy raised its d_landed_from (after d_placed), not after d_landed, and
  // combine_recv reduces each token once the ranks its rows come from raised c_landed_from.
  bool per_source_ = false;
  struct OpTimer;  // times one call into op_ns_ (host_comm.cc)
  void raise(uint64_t* flag, uint64_t value);
  bool on_node(int r) const { return !ex_->remote(rank_, r); }  // a node-local peer (proxied, node_size > 0)
  struct Local;
  Local& local(int z) const;
  // Elastic EP: the rank mask of this call (every rank alive when null), set as slot z's mask of
  // the Exchange. A masked peer is never waited for nor written to; when this rank itself is
  // masked the call touches no peer at all (it sends and receives nothing). Refused in proxied
  // mode unless every rank is alive (the proxy thread waits for every rank).
  std::vector<uint8_t> use_mask(int z, const int32_t* alive, int op);

  HostOptions o_;
  int rank_;
  std::vector<std::vector<uint8_t>> storage_;  // every slot's six buffers (SlotBuffers)
  std::unique_ptr<protocol::Exchange> ex_;
  std::vector<std::unique_ptr<Slot>> slots_;
  std::unique_ptr<ctrl::Ctrl> ctrl_;          // proxied mode
  std::unique_ptr<ctrl::Ctrl> mirror_;        // JAX_MOE_A2A_HOST_FLAG_MIRROR=1: the proxy's flags also here
  const ctrl::Ctrl* in_ = nullptr;            // where we read the proxy's flags: ctrl_ or mirror_
  std::unique_ptr<proxy::Proxy> proxy_;
  // Proxied: read at creation, so that a bad setting is refused there, not in connect() after the
  // engines began to connect (a peer would then wait for us until its timeout).
  proxy::ProxyOptions proxy_opts_;
  // Per slot, the row buffers we pack and unpack (proxy::RowBuffer order): the registered ones, or
  // under JAX_MOE_A2A_HOST_STAGED=1 (proxied) our own, which staging_ copies (host/staged_rows.h).
  std::vector<std::array<uint8_t*, proxy::kRowBuffers>> rows_;
  uint8_t* rows(int z, proxy::RowBuffer b) const { return rows_[z][static_cast<int>(b)]; }
  std::unique_ptr<proxy::RowStaging> staging_;
  std::vector<std::unique_ptr<Local>> local_;  // per slot: what node-local peers write into us
  std::map<int, RankComm*> node_;              // node-local ranks (ourselves included)
  // descs without the recovery table's descriptor (the last of each rank's), counts checked.
  std::map<int, std::vector<transfer::Bytes>> exchange_descriptors(
      const std::map<int, std::vector<transfer::Bytes>>& descs) const;
  bool connected_ = false;
  // JAX_MOE_A2A_HOST_RECV_PAUSE_S (tests only, read at creation; 0: none): each dispatch_recv sleeps
  // this long after its rows arrived, before it reads them, so that a test can hold a receiver in
  // the middle of its read while peers run on (tests/test_elastic.py::test_unmasked_rank_still_reading).
  double recv_pause_s_ = 0;
  // JAX_MOE_A2A_HOST_PACK_PAUSE_S (tests only, read at creation; 0: none): proxied dispatch_send
  // sleeps this long after publishing each remote destination's rows (d_packed_to) but the last.
  double pack_pause_s_ = 0;
  // Recovery table: [N][kRecoverWords(slots)] uint32 rows that survivors write into us (generation,
  // then d_epoch, c_epoch per slot), and our own row (the source of those writes).
  std::vector<uint32_t> recov_in_, recov_out_;
  std::shared_ptr<transfer::Region> recov_in_reg_, recov_out_reg_;
  std::vector<transfer::RemoteRegion> recov_peer_;  // [N]
};

// Every local rank of one communicator's EP group in this process.
class HostComm {
 public:
  HostComm(const HostOptions& o, std::vector<std::shared_ptr<transfer::Engine>> engines,
           std::vector<int> ranks);
  RankComm& rank(int r);
  const std::vector<int>& ranks() const { return ranks_; }
  const HostOptions& options() const { return o_; }
  // Marks the communicator unusable after a failure (timeouts leave peers mid-protocol); `missing`:
  // the ranks the timed-out wait named (a hint: a live peer that itself failed is named too).
  void fail(const std::string& why, const std::vector<int>& missing = {});
  void check_usable() const;
  // The recorded failure ("" if none) and its missing ranks (union over this process's failures).
  std::string failure() const;
  std::vector<int> failure_missing() const;
  // Elastic EP recovery (inline mode): every survivor calls it, with the same mask (1 = survivor),
  // no step of this communicator in flight. Flushes our writes (dropping the dead peers' write
  // errors), exchanges every slot's epochs among the survivors through the engines, drops every
  // stale protocol arrival, sets each slot to the survivors' highest epochs with the first FREE
  // wait skipped, and barriers; then the communicator is usable again. Bounded by timeout_s; a
  // survivor that never joins (a mask that still includes a dead rank) raises TimeoutError naming
  // it and leaves the communicator failed.
  void recover(const std::vector<uint8_t>& alive);
  // Collective in effect (every process closes its communicator): unless the communicator failed,
  // first drains every local rank (RankComm::drain: the FREE signals peers still owe us, our
  // writes), so that no peer is left writing into a closed engine; a drain that times out (a dead
  // peer) only delays the close by timeout_s. Then stops the proxy threads and closes the engines.
  // Idempotent; never throws.
  void close();

 private:
  HostOptions o_;
  std::vector<int> ranks_;
  std::map<int, std::unique_ptr<RankComm>> comms_;
  mutable std::mutex mu_;
  std::string failure_;
  std::vector<int> missing_;
  uint32_t generation_ = 0;  // recover() calls so far (every survivor counts the same)
  bool closed_ = false;
};

// Process-wide table: (communicator id, EP group) -> HostComm. A communicator over one axis of a
// larger mesh has one HostComm per EP group this process holds ranks of; each is a communicator of
// its own (peers, engines, buffers), and the handlers pick theirs by the group operand.
void register_comm(int64_t id, std::shared_ptr<HostComm> comm, int group = 0);
std::shared_ptr<HostComm> find_comm(int64_t id, int group = 0);  // throws std::invalid_argument if unknown
void unregister_comm(int64_t id);  // every group of `id`

}  // namespace a2a::host
