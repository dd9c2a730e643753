// The `host` backend: the route-exchange protocol of the EFA design executed by C++ on CPUs
// (DESIGN.md sections 5.1 and 5.3), over any TransferEngine (LocalEngine inside one process,
// libfabric between processes). One HostComm per (communicator, process) holds one RankComm per
// local rank; the FFI handlers (cc/ffi/host_handlers.cc) find them by communicator id and rank.
//
// Protocol of one dispatch on slot z, epoch e, seen from rank r (imm = tag | epoch | sender):
//   send: wait FREE_D(z, e-1) from every peer (they have read the previous use of our rows
//         there); plan the routing; pack rows per destination sorted by (local expert, token);
//         write our full [N, L] count matrix to every peer (COUNTS); write the first `priv` rows
//         for each peer into our private region there (PRIV, zero-length if none).
//   recv: wait COUNTS from every peer; now the exact overflow offsets are known: write the rows
//         past `priv` to each peer's overflow region with one write (OVER, zero-length if none);
//         wait PRIV and OVER from every peer; lay rows out canonically; signal FREE_D.
// Combine on slot z, epoch c: send waits FREE_C(z, c-1), packs outputs per source in the
// source's slot order and writes them back with one write per (member, source) (COMB); recv
// waits COMB from every expert rank, reduces in f32, signals FREE_C. Completions are counted by
// immediate value per sender; nothing assumes ordering between writes.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/floats.h"
#include "core/moe_layout.h"
#include "transfer/engine.h"

namespace a2a::host {

struct HostOptions {
  MoeShape shape;
  ElemKind wire = ElemKind::kBF16;  // dispatch wire dtype
  bool pow2_scale = false;
  int slots = 2;
  int priv_rows = -1;               // private rows per sender; -1: rows_per_peer (never overflows)
  double timeout_s = 60.0;
};

// Byte offsets inside one slot's buffers (identical on every rank).
struct SlotLayout {
  explicit SlotLayout(const HostOptions& o);
  int64_t counts_bytes;   // [N][N*L] int32 count matrices, one per source (16-byte padded)
  int64_t priv_off;       // [N][priv][row]
  int64_t over_off;       // [N*(P-priv)][row]
  int64_t d_recv_bytes;
  int64_t d_send_rows_off;  // d_send: our [N*L] counts, then [N][P][row]
  int64_t d_send_bytes;
  int64_t c_row_stride_max;  // H * 4 (f32 outputs at most)
  int64_t c_send_bytes;      // [N][P][H*4]
  int64_t c_recv_bytes;      // [N][tp][P][H*4]
  int P, priv;
  int64_t row;
};

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
  int32_t* pair_slot;         // [T, K]
  int32_t* dropped;           // []
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
};

struct CombineSendArgs {
  const void* y;              // [R', H] in y_kind
  ElemKind y_kind;
  const int32_t* recv_src;    // [R'] source rank per row, -1 past the counts (row stride 2: src[:, 0])
  int64_t recv_src_stride;
  const int32_t* recv_slot;   // [R']
  const int32_t* recv_counts; // [N]
  int slot;
  int32_t* handle;            // [2]
};

struct CombineRecvArgs {
  const int32_t* handle;      // [2]
  ElemKind y_kind;
  const int32_t* dest;        // [T, K]
  const int32_t* pair_slot;   // [T, K]
  const float* weights;       // [T, K]
  int num_tokens;
  const void* out_in;         // [T, H] or null
  ElemKind out_in_kind;
  int slot;
  void* out;                  // [T, H] in out_kind
  ElemKind out_kind;
  float* pairs;               // [T, K, H] f32 unweighted row of every pair (0 if none), or null
};

class RankComm {
 public:
  RankComm(const HostOptions& o, int rank, std::shared_ptr<transfer::Engine> engine);
  ~RankComm();

  int rank() const { return rank_; }
  transfer::Engine& engine() { return *engine_; }
  double timeout_s() const { return o_.timeout_s; }
  // Descriptors of our remotely written regions, [slot0 d_recv, slot0 c_recv, slot1 ...].
  std::vector<transfer::Bytes> descriptors() const;
  // Peers' descriptors in the same order, for every rank (ours included).
  void connect(const std::map<int, std::vector<transfer::Bytes>>& descriptors);
  bool connected() const { return connected_; }

  void dispatch_send(const DispatchSendArgs& a);
  void dispatch_recv(const DispatchRecvArgs& a);
  void combine_send(const CombineSendArgs& a);
  void combine_recv(const CombineRecvArgs& a);

 private:
  struct Slot;
  uint32_t imm(int kind, int slot, uint32_t epoch, int sub = 0) const;
  void wait_all(int kind, int slot, uint32_t epoch, const char* op, int sub = 0);
  void signal_all(int kind, int slot, uint32_t epoch);

  HostOptions o_;
  SlotLayout lay_;
  int rank_;
  std::shared_ptr<transfer::Engine> engine_;
  std::vector<std::unique_ptr<Slot>> slots_;
  std::vector<int> all_ranks_;
  bool connected_ = false;
};

// Every local rank of one communicator in this process.
class HostComm {
 public:
  HostComm(const HostOptions& o, std::vector<std::shared_ptr<transfer::Engine>> engines,
           std::vector<int> ranks);
  RankComm& rank(int r);
  const std::vector<int>& ranks() const { return ranks_; }
  const HostOptions& options() const { return o_; }
  // Marks the communicator unusable after a failure (timeouts leave peers mid-protocol).
  void fail(const std::string& why);
  void check_usable() const;
  void close();

 private:
  HostOptions o_;
  std::vector<int> ranks_;
  std::map<int, std::unique_ptr<RankComm>> comms_;
  mutable std::mutex mu_;
  std::string failure_;
};

// Process-wide table: communicator id -> HostComm.
void register_comm(int64_t id, std::shared_ptr<HostComm> comm);
std::shared_ptr<HostComm> find_comm(int64_t id);  // throws std::invalid_argument if unknown
void unregister_comm(int64_t id);

}  // namespace a2a::host
