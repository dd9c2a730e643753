// The nvshmem backend's per-slot memory layout and kernel parameters. The kernels reuse the cuda
// backend's Geometry (shapes, wire row, private staging/scratch offsets) and parameter structs
// (of which only these kernels use dest_counts: dispatch_send writes the rows each expert rank
// owes our combine, and combine_recv waits for them; they travel with the dispatch's data, not
// in a slot); this adds what differs: NVSHMEM signals, per-source metadata blocks, PE numbers.
//
// Per rank, one block of the NVSHMEM symmetric heap; per slot (all symmetric: peers write the
// shared part, puts read the private part):
//   shared:  Signals | meta [N src][L + 1 + 2P] int32 | rows [N src][P][row] | c_rows [tp][Q][c_row]
//   private: cuda private area (staging [T][row], scratch, Epochs) | meta_stage [N dest][L + 1 + 2P]
//            int32 | seen [2][N] uint64 | zero row [c_row]
// Apart from the block, only when a peer is remote (taken from the arena at connect, per slot):
//   bounce [kBounceWarps][c_row]
// The bounce rows make combine_send's puts to remote peers legal: a put over a remote transport
// (IBGDA, IBRC, UCX, libfabric) must read a symmetric (registered) source, and the expert outputs
// y are XLA's buffer. Each warp copies its row into its bounce row, then puts it with the blocking
// put (the row is reusable when it returns); peers reached by loads and stores (NVLink, the same
// GPU) get the row straight from y, and dropped rows come from the zero row (symmetric already).
// Which peers are remote is decided at connect (NvSlot::remote); a communicator whose peers are
// all load/store reachable allocates no bounce rows.
// Everything else a kernel puts (dispatch rows, meta blocks, the zero row) is read from the
// private area, which is symmetric, and every signal goes through NVSHMEM's signal operations, so
// no kernel needs a load or store into a peer's memory.
// seen[0][s] / seen[1][x]: the dispatch rows consumed from source s / combine rows from expert
// rank x, over every epoch; they move with the cumulative Signals::d_rows / c_rows and stand
// still while the rank is masked (elastic EP: nvshmem/device.cuh says why that keeps them in step).
// The d_free / c_free value each rank owes us (elastic EP) is kept in the cuda private area
// (Epochs::d_lagging / c_lagging and the owed array after Epochs: gpu/mask.cuh FreeDue).
// meta block of one (source -> receiver) pair: counts [L] (rows per local expert), the source's
// combine offset for the receiver (rows it sends lower ranks: where the receiver's combine rows
// start in its member's part of c_rows), then (token int32, weight f32 bits) for each of the
// source's P row slots; only the first rows_from are sent.
#pragma once

#include <cstdint>

#include "gpu/params.h"

namespace a2a::nvshmem {

using gpu::kMaxRanks;

// Bounce rows per slot (N > 1): one per warp of combine_send, whose grid is capped to
// kBounceWarps warps when a peer is remote (launch_combine_send).
constexpr int kBounceWarps = 1024;

// Written by peers with NVSHMEM signal operations (put-with-signal or nvshmemx_signal_op).
struct Signals {
  uint64_t d_meta[kMaxRanks];  // source s put its meta block for epoch e: SET e + 1
  uint64_t d_rows[kMaxRanks];  // rows landed from source s: ADD 1 per row, cumulative over epochs (vs seen[0])
  uint64_t d_free[kMaxRanks];  // receiver d finished reading our rows and meta of epoch e: SET e + 1
                               // (elastic EP: not from ranks masked in e; awaited as FreeDue)
  uint64_t c_rows[kMaxRanks];  // combine rows landed from expert rank x: ADD 1 per row, cumulative (vs seen[1])
  uint64_t c_free[kMaxRanks];  // rank m finished reading our combine rows of epoch c: SET c + 1
                               // (elastic EP: not from ranks masked in c; awaited as FreeDue)
};

// Byte offsets inside one slot of a rank's symmetric block (see the header comment).
struct Layout {
  int64_t meta_stride;                      // 4 * (L + 1 + 2P), padded to 16
  int64_t off_meta, off_rows, off_c_rows;   // shared part, from the slot start
  int64_t off_priv;                         // start of the private part (cuda private area)
  int64_t off_meta_stage, off_seen, off_zero;  // from the private start
  int64_t slot_bytes;
  int64_t bounce_slot_bytes;                // kBounceWarps rows of c_row per slot (0 when N == 1)
};

// What the kernels need beyond the cuda parameter structs.
struct NvSlot {
  Layout lay;
  int pe[kMaxRanks];  // NVSHMEM PE of every EP rank
  uint64_t remote;    // bit r: rank r takes the remote path (combine rows through the bounce rows)
  uint8_t* bounce;    // slot z's bounce rows at bounce + z * lay.bounce_slot_bytes (nullptr: no remote peer)
};

// A meta block [L + 1 + 2P] int32: counts per local expert, the source's combine offset for the
// receiver (its rows for lower ranks), then token and weight per row.
__host__ __device__ inline int64_t meta_head_words(const gpu::Geometry& g) { return int64_t(g.L) + 1; }
__host__ __device__ inline int64_t meta_words(const gpu::Geometry& g) { return meta_head_words(g) + 2 * int64_t(g.P); }

}  // namespace a2a::nvshmem
