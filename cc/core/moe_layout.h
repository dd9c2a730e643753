// MoE all-to-all layout math shared by the backends: sizes, the routing of one rank's pairs, and
// the canonical arrangement at a receiver. Plain C++, no JAX, no CUDA, no transport.
//
// Canonical arrangement (the contract, mirrored by jax_moe_a2a/oracle.py): a pair (t, k) exists
// when t < num_tokens, 0 <= id < E and id is not repeated earlier in the token's row; it is sent
// by tp member t % tp; rows reach the receiver ordered by (local expert, source rank, token).
// Ragged: canonical position >= capacity is dropped; expert_major: index within the expert >= C.
#pragma once

#include <cstdint>
#include <vector>

#include "core/shape.h"

namespace a2a {

// Where one rank's pairs go. dest/slot are [T, K]; dest == N marks a pair that is not routed by
// this rank (not routed at all, or sent by another tp member for tp > 1 is still recorded so that
// combine can find it: see `mine`).
struct SendPlan {
  std::vector<int32_t> dest;     // [T*K] destination rank, N if the pair does not exist
  std::vector<int32_t> slot;     // [T*K] row index within (sending member, dest), sorted by (local expert, token)
  // [T*K] the pair's row in the combine region's part of its sending member m = t % tp (MoeShape::Q
  // rows): combine_offset(m's counts, dest) + slot, 0 if the pair does not exist. dispatch_send's
  // `pair_slot` output; combine_recv reads the pair's row at (m * Q + comb_slot) * stride.
  std::vector<int32_t> comb_slot;
  std::vector<int32_t> counts;   // [N*L] rows this rank sends to (dest, local expert)
  std::vector<int32_t> rows_to;  // [N] rows this rank sends to each dest
  // order[d] lists (token, k) of this rank's rows to d in slot order.
  std::vector<std::vector<std::pair<int32_t, int32_t>>> order;
  int32_t dropped = 0;           // this rank's pairs with bad ids (out of range or repeated)
};

// Plans the sends of `rank` (ids [T*K] int32, row-major). Every tp member computes the dest/slot
// of every pair of its group (so combine can read any member's rows), but counts, rows_to, order
// and dropped cover only the pairs this rank sends.
SendPlan plan_sends(const MoeShape& s, int rank, const int32_t* ids, int num_tokens);

// The combine offset (docs/protocol.md, "One combine"): rows a source sends to ranks below `dest`
// in one dispatch, from its count matrix `counts` [N dest][L] (exactly what it publishes as
// COUNTS). The source's rows for `dest` occupy [offset, offset + rows to dest) of the source's
// part ([Q] rows) of the combine region at every member of its tp group; offset + rows <= Q.
int64_t combine_offset(const int32_t* counts, int L, int dest);

// Position of the i-th row that source `src` sends for local expert `l`, in the receiver's
// output, given counts[src][l] (rows each source sends this receiver per local expert, [N*L]).
// Returns -1 when the row is dropped by the capacity rule.
class RecvArrangement {
 public:
  RecvArrangement(const MoeShape& s, const int32_t* counts_from_sources);
  int64_t position(int src, int l, int i) const;
  int32_t group_size(int l) const { return group_sizes_[l]; }
  int64_t overflow() const { return overflow_; }
  int32_t rows_from(int src) const { return rows_from_[src]; }
  // First slot of local expert l within the rows that src sends (its rows are sorted by expert).
  int32_t src_expert_start(int src, int l) const { return src_start_[int64_t(src) * L_ + l]; }

 private:
  MoeShape s_;
  int L_;
  std::vector<int64_t> expert_offset_;  // [L] ragged: first canonical position of expert l
  std::vector<int64_t> before_src_;     // [N*L] rows of expert l from sources < src
  std::vector<int32_t> src_start_;      // [N*L]
  std::vector<int32_t> rows_from_;      // [N]
  std::vector<int32_t> group_sizes_;    // [L] after the capacity rule
  int64_t overflow_ = 0;
};

}  // namespace a2a
