// MoeShape: the static shape of one MoE all-to-all, the one shape struct of the library. Made
// only by shape_of(Config) (core/config.h), which also fills the derived fields (L, P, row,
// payload); every backend reads it: the host side (cc/host, cc/protocol, cc/proxy) as MoeShape,
// the GPU kernels as the base of gpu::Geometry (which adds the byte offsets of one slot). The
// short field names are the kernels'. Plain data (no constructors), host and device visible.
#pragma once

#include <cstdint>

#include "core/dtype.h"

namespace a2a {

enum class Layout : int { kRagged = 0, kExpertMajor = 1 };

struct MoeShape {
  int N;             // ranks of one EP group
  int E;             // experts (E % N == 0)
  int L;             // local experts per rank, E / N
  int K;             // experts per token (top-K)
  int H;             // hidden (values per row)
  int T;             // max tokens per rank
  int tp;            // tp_size: consecutive ranks holding the same tokens
  int S;             // fp8 scales per row, ceil(H / scale_block) (the last block partial), else 0
  int scale_block;   // values per fp8 scale
  int P;             // worst-case rows from one source to one destination: ceil(T / tp) * min(K, L)
  int Q;             // worst-case rows one tp member sends to all destinations together: ceil(T / tp) * K
                     // (the combine region holds [tp][Q] rows: a pair's row at off[member][dest] + slot)
  ElemKind wire_kind;  // element kind of the dispatch wire (int-sized)
  Layout layout;     // receive layout (int-sized)
  int capacity;      // receive rows: R (ragged) or C per local expert (expert_major)
  int pow2;          // fp8 scales rounded up to powers of two
  int64_t row;       // bytes of one wire row: payload, scales, token, weight; 16-byte multiple
  int64_t payload;   // H * wire element bytes
  int64_t c_row;     // bytes of one combine row: H * itemsize(combine dtype); combine_send's y travels
                     // in its own dtype when no wider, else Python casts it to the combine dtype first

  A2A_HD int local_experts() const { return L; }
  A2A_HD int tokens_per_member() const { return (T + tp - 1) / tp; }
  A2A_HD int rows_per_peer() const { return P; }
  A2A_HD bool ragged() const { return layout == Layout::kRagged; }
  A2A_HD int64_t recv_rows_total() const {  // rows of Dispatched.x without H
    return ragged() ? capacity : int64_t(L) * capacity;
  }
  A2A_HD int64_t row_bytes() const { return row; }
  A2A_HD int64_t payload_bytes() const { return payload; }
  A2A_HD ElemKind wire() const { return wire_kind; }
  A2A_HD bool wire_is_fp8() const { return wire_kind == ElemKind::kF8E4M3; }
};

}  // namespace a2a
