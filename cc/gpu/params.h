// Named parameter structs of the cuda backend's kernels (host and device visible), and the
// layout of one rank's communication memory. Shapes and dtypes are given per field.
//
// Per rank, one device allocation shared with peers (CUDA IPC, or peer access in-process):
//   for each slot: SyncFlags | counts [N src][L + 1] int32 | rows [N src][P][row] | c_rows [tp][Q][c_row]
// counts[s][L] is where s's combine region part expects our rows (rows s sends to ranks below us);
// c_rows[j] holds the rows coming back for member j of our tp group, the pair (t, k) of member
// j = t % tp at row pair_slot[t, k] (gpu/route.cuh combine_slot: j's rows for lower ranks first).
// and one private allocation: for each slot: staging [T][row] | scratch (int32) | Epochs | owed
// [2][N] uint64 (elastic EP: the FREE flag values ranks that sat out the slot's last dispatch /
// combine owe us; Epochs::d_lagging says where they count, gpu/mask.cuh FreeDue).
#pragma once

#include <cstdint>

#include "core/half.h"
#include "core/shape.h"
#include "core/ctrl.h"

namespace a2a::gpu {

using ctrl::kMaxRanks;  // core/ctrl.h: one limit for every rank mask and per-rank array (64-bit masks)
// Shared memory a block-routed kernel's routing tables may take (gpu/block_route.cuh): past it
// (large T), the grid-routed kernels.
constexpr int64_t kBlockRoutingSmem = 48 * 1024;

// Flags written by peers into our shared memory (monotonic epoch + 1 values).
struct SyncFlags {
  uint64_t d_arrived[kMaxRanks];  // source s wrote its rows and counts for epoch e: e + 1
  uint64_t d_free[kMaxRanks];     // receiver d finished reading our rows of epoch e: e + 1
  uint64_t c_arrived[kMaxRanks];  // expert rank e wrote our combine rows for epoch c: c + 1
  uint64_t c_free[kMaxRanks];     // rank m finished reading our combine rows of epoch c: c + 1
  uint64_t timing[kMaxRanks];     // rank r reached its b-th timing barrier: b (slot 0 only; cuda/timing_barrier.cu)
};

struct Epochs {  // device-side counters so that kernels need no per-call host parameters
  uint64_t d_send, c_send;
  uint64_t failed;  // nonzero once an op of this slot timed out: later kernels of the slot end at once
  uint32_t done[kNumHalves];  // blocks of each half that finished this launch (last_block_done); 0 between launches
  A2A_HD uint32_t* done_of(Half h) { return &done[static_cast<int>(h)]; }
  int32_t dropped;   // dispatch_send: bad pairs counted by every block before its grid sync; 0 between launches
  int32_t pad_;
  // Elastic EP: bit r = rank r took no part in this slot's last dispatch / combine (every bit when
  // we were masked ourselves), so the FREE flag it owes us is older than the next call's epoch:
  // that of the last one both of us took part in, kept in the slot's owed array (after Epochs).
  // A clear bit (every bit, without a mask) means it owes the call's epoch. Written by the send
  // half's last block (gpu/mask.cuh owe_free).
  uint64_t d_lagging, c_lagging;
  // The cuda inter-node path: the proxy's four flags of this slot (d_send_ok, d_landed, c_send_ok,
  // c_landed) as block 0 of a kernel last saw them in host memory (cuda/remote.cuh wait_proxy):
  // the other blocks wait on this copy in GPU memory instead of each reading host memory.
  uint64_t proxy_seen[4];
  // ... and, with d_landed, each remote source's overflow base (ctrl::SlotCtrl::over_base), gathered by
  // dispatch_recv's block 0 with the remote count records (cuda/remote.cuh gather_landing).
  int64_t over_base[kMaxRanks];
};

// ErrorRecord::code values besides 0 (none): a peer that did not arrive in time, and (nvshmem)
// a row counter found ahead of what its receiver consumed (ranks passing different rank masks).
constexpr int32_t kErrorTimeout = 1;
constexpr int32_t kErrorCounterAhead = 2;

// Error record in mapped host memory: set by a kernel that timed out (the host raises it at the
// next call).
struct ErrorRecord {
  int32_t code;      // 0: none, kErrorTimeout, kErrorCounterAhead
  Half op;           // the half that failed (int-sized)
  int32_t slot;
  int32_t rank;
  uint64_t missing;  // bit r: rank r never arrived (ranks < 64)
};

// The static shape of the all-to-all (MoeShape, core/shape.h: N, E, L, K, H, T, tp, S,
// scale_block, P, wire_kind, layout, capacity, pow2, row, payload) plus the byte offsets of one
// slot's regions. Made only by make_geometry (cuda/comm.h) from shape_of(the Config).
struct Geometry : MoeShape {
  // shared slot area
  int64_t off_counts, off_rows, off_c_rows, shared_slot_bytes;
  // private slot area
  int64_t off_staging, off_scratch, off_epochs, private_slot_bytes;
  int64_t c_stride_max;  // bytes of the widest combine row: c_row = H * itemsize(combine dtype)
};

// Row stride of the counts records and of recv_counts: L counts, then the source's combine offset.
A2A_HD int counts_stride(const MoeShape& g) { return g.L + 1; }

// The inter-node path of one slot (device functions in cuda/remote.cuh, host side in
// cuda/remote_path.h): pinned host memory registered with the TransferEngine that kernels read and
// write through mapped pointers, in the layout of protocol::SlotLayout, and the flag block shared
// with the rank's proxy thread. mask == 0: every peer is node-local and nothing here is used.
struct RemotePtrs {
  uint64_t mask;                   // bit r: rank r is on another node (its rows go through the proxy)
  ctrl::SlotCtrl* ctrl;           // this slot's flags (mapped host memory): the kernel writes its own here
  const ctrl::SlotCtrl* in;       // where the kernel reads the proxy's flags (d_send_ok, d_landed, c_send_ok,
                                   // c_landed, over_base): == ctrl, or GPU memory under GDRCopy (proxy/gdrcopy.h)
  const ctrl::ProxyError* error;  // the proxy's failure record (beside `in`)
  int32_t* counts_send;            // our count matrix [N dest][L] (mapped host memory)
  const int32_t* counts_recv;      // [N src][N][L]: every source's count matrix (mapped host memory)
  // The rows: mapped host memory, or GPU memory where the engine registers it (JAX_MOE_A2A_STAGING)
  uint8_t* d_send;                 // [N dest][P][row]
  const uint8_t* d_recv;           // private [N src][priv][row] | overflow [N*(P-priv)][row] from over_off
  uint8_t* c_send;                 // [N src][P][H * itemsize(y)]
  const uint8_t* c_recv;           // [tp][Q][H * itemsize(y)] (rows of remote expert ranks, protocol::SlotLayout)
  int64_t over_off;
  int priv;
};

// Pointers for one rank and one slot.
struct SlotPtrs {
  uint8_t* peer_shared[kMaxRanks];  // every rank's shared slot area, as mapped here (ours included)
  uint8_t* priv;                    // our private slot area
  ErrorRecord* err;                 // mapped host memory
  int rank;
  int slot;
  int64_t timeout_ns;
  RemotePtrs remote;                // peers on other nodes (cuda backend with node_size < N)
  const int32_t* alive;             // elastic EP: [N] device array, nonzero = alive; null: every rank
                                    // (this call's operand; gpu/mask.cuh)
};

struct DispatchSendParams {
  Geometry g;
  SlotPtrs p;
  const void* x;            // [T, H] x_kind (or fp8 with x_scale)
  ElemKind x_kind;          // f32, bf16, f16, or fp8 with x_scale
  const float* x_scale;     // [T, S] or null
  const int32_t* ids;       // [T, K]
  const float* weights;     // [T, K]
  const int32_t* num_tokens;  // [] device scalar
  int32_t* handle;          // [2] out: epoch, slot
  int32_t* dest;            // [T, K] out
  int32_t* pair_slot;       // [T, K] out: the pair's row in the combine region's part of its member
  int32_t* dropped;         // [] out
  int32_t* dest_counts;     // [N] out, or null: routed pairs of the whole tp group per destination
                            // rank (pairs of tokens < num_tokens with dest == r), the rows each
                            // expert rank owes our combine_recv. Written by the nvshmem kernel
                            // (its combine_recv waits for them); null on the cuda backend.
};

struct DispatchRecvParams {
  Geometry g;
  SlotPtrs p;
  const int32_t* handle;    // [2]
  void* x;                  // [R', H] x_kind
  ElemKind x_kind;          // the wire's kind, or a float kind with fp8 on the wire: rows
                            // dequantised on receive (Spec.recv_dtype, gpu/dequant.cuh)
  float* scale;             // [R', S] (fp8 rows) or null
  int32_t* group_sizes;     // [L]
  float* weights;           // [R']
  int32_t* src;             // [R', 2]
  int32_t* recv_slot;       // [R']
  int32_t* recv_counts;     // [N, L + 1] rows per (source, local expert), then the source's
                            // combine offset for us (rows it sends ranks below us)
  int32_t* overflow;        // []
};

struct CombineSendParams {
  Geometry g;
  SlotPtrs p;
  const void* y;            // [R', H] y_kind
  ElemKind y_kind;
  const int32_t* recv_counts;  // [N, L + 1] from dispatch_recv
  int32_t* handle;          // [2] out
  int from_slot;            // the dispatch's slot (for the proxy's combine offsets: ctrl::SlotCtrl::c_from_slot)
};

struct CombineRecvParams {
  Geometry g;
  SlotPtrs p;
  const int32_t* handle;    // [2]
  ElemKind y_kind;
  const int32_t* dest;      // [T, K]
  const int32_t* dest_counts;  // [N] from dispatch_send (nvshmem: the rows each expert rank owes
                               // us); null on the cuda backend and on the EP = 1 path
  const int32_t* pair_slot; // [T, K]: row in c_rows[t % tp]
  const float* weights;     // [T, K]
  const int32_t* num_tokens;  // []
  const void* out_in;       // [T, H] or null
  ElemKind out_in_kind;
  void* out;                // [T, H] out_kind
  ElemKind out_kind;
  float* pairs;             // [T, K, H] or null
};

// EP = 1 (one rank on the EP axis): the "local path" of the GPU backends (gpu/local/), which
// moves nothing between ranks and so needs no communication memory. One dispatch kernel reads
// dispatch_send's operands and writes dispatch_send's and dispatch_recv's results; one combine
// kernel reads the expert outputs y where they are.
struct LocalDispatchParams {
  DispatchSendParams s;  // x, x_scale, ids, weights, num_tokens -> handle, dest, pair_slot, dropped
  DispatchRecvParams r;  // -> x, scale, group_sizes, weights, src, recv_slot, recv_counts, overflow
};

struct LocalCombineParams {
  CombineRecvParams c;         // dest, pair_slot, weights, num_tokens, out_in -> out, pairs
  const void* y;               // [R', H] c.y_kind: the expert outputs in got.x's layout
  const int32_t* recv_counts;  // [1, L + 1] from the dispatch: rows per local expert (then 0)
};

}  // namespace a2a::gpu
