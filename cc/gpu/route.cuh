// Sender-side routing and staging shared by the GPU backends' dispatch_send kernels (cuda, nvshmem):
// which pairs are routed, their order per (member, expert), their slot in the destination's
// region, and our tokens' wire rows (payload, then fp8 scales) in the private staging area. Every
// helper spreads its work over the whole cooperative grid (a decode batch has too little work for
// one block or one warp per token).
#pragma once

#include "core/fp8.h"
#include "gpu/copy.cuh"
#include "gpu/elems.cuh"
#include "gpu/fp8_code.cuh"
#include "gpu/grid.cuh"
#include "gpu/params.h"
#include "gpu/warp.cuh"

namespace a2a::gpu {

struct SendScratch {
  int32_t* pair_expert;  // [T*K] expert id of a routed pair, -1 otherwise
  int32_t* pos_in;       // [T*K] index among (member, expert)'s pairs in token order
  int32_t* cnt;          // [tp*E]
  int32_t* start;        // [tp*E] first slot of (member, expert) within (member, dest)
  int32_t* c_off;        // [tp*N] rows member m sends to ranks below d: where d's rows start in the
                         // combine region's part of m ([tp][Q] rows, combine_slot)
};

__device__ inline SendScratch send_scratch(const Geometry& g, uint8_t* priv) {
  int32_t* base = reinterpret_cast<int32_t*>(priv + g.off_scratch);
  SendScratch s;
  const int64_t tk = int64_t(g.T) * g.K;
  s.pair_expert = base;
  s.pos_in = base + tk;
  s.cnt = base + 2 * tk;
  s.start = s.cnt + int64_t(g.tp) * g.E;
  s.c_off = s.start + int64_t(g.tp) * g.E;
  return s;
}

// The routing runs over the whole cooperative grid in two phases with one grid sync between them:
//   route_pairs (phase 1, every thread):   pair_expert, dest; drops added to Epochs::dropped
//   scan_experts (phase 1, every warp):    pos_in, cnt, start, c_off (from ids directly: validity
//                                          and dedup again, so that it need not wait for route_pairs)
//   pair_slot (phase 2, anyone):           slot of a pair within (member, dest) from start and pos_in
//   combine_slot (phase 2, anyone):        its row in the combine region's part of the member: + c_off
// Phase 1 reads only ids; phase 2 reads what phase 1 wrote. No atomics decide a position; every
// scratch word has one writer (the drop count is an integer sum).

// Phase 1: validity and dedup of every pair [T*K] -> pair_expert (expert or -1), dest (rank or N);
// pairs of our member whose id is out of range or repeated within its token (-1 is no drop) are
// added to *dropped (zero before the launch; dispatch_send's block 0 reads and clears it after
// the grid sync).
__device__ inline void route_pairs(const DispatchSendParams& P, const SendScratch& s, int n, const GridIdx& ix,
                                   int32_t* dropped) {
  const Geometry& g = P.g;
  const int member = P.p.rank % g.tp;
  int bad = 0;
  for (int64_t q = ix.gtid; q < int64_t(g.T) * g.K; q += ix.gstride) {
    const int t = static_cast<int>(q / g.K), k = static_cast<int>(q % g.K);
    const int32_t id = P.ids[q];
    bool routed = t < n && id >= 0 && id < g.E;
    for (int j = 0; routed && j < k; ++j) routed = P.ids[int64_t(t) * g.K + j] != id;
    s.pair_expert[q] = routed ? id : -1;
    P.dest[q] = routed ? id / g.L : g.N;
    bad += !routed && t < n && id != -1 && t % g.tp == member;
  }
  bad = warp_sum(bad);
  if ((threadIdx.x & 31) == 0 && bad) atomicAdd(dropped, bad);
}

// Phase 1, one warp per (member m, expert e): scans m's tokens in order, 32 at a time, straight
// from ids (a pair counts when its id is e, or in e's rank below e, and not repeated earlier in
// its token). Gives each of the expert's pairs its index in token order (pos_in), the expert's
// count (cnt) and its first slot within (m, dest of e) (start: m's pairs for the dest's lower
// local experts, counted in the same pass, so no prefix over cnt needs a grid sync). The warp of
// a rank's local expert 0 also counts m's pairs for lower ranks (c_off).
__device__ inline void scan_experts(const DispatchSendParams& P, const SendScratch& s, int n, const GridIdx& ix) {
  const Geometry& g = P.g;
  const int lane = ix.lane;
  for (int me_e = ix.gwarp; me_e < g.tp * g.E; me_e += ix.nwarps) {
    const int m = me_e / g.E, e = me_e % g.E, first = e / g.L * g.L;  // first: local expert 0 of e's rank
    const int lowest = e == first ? 0 : first;  // ids counted: [lowest, e]
    int running = 0, before = 0, below = 0;
    for (int t0 = 0; t0 < n; t0 += 32) {
      const int t = t0 + lane;
      int hit_k = -1;
      if (t < n && t % g.tp == m) {
        const int32_t* row = P.ids + int64_t(t) * g.K;
        for (int k = 0; k < g.K; ++k) {
          const int x = __ldg(row + k);
          if (x < lowest || x > e) continue;
          bool dup = false;
          for (int j = 0; j < k; ++j) dup |= __ldg(row + j) == x;
          if (dup) continue;
          if (x == e) hit_k = k; else if (x >= first) ++before; else ++below;
        }
      }
      const unsigned ballot = __ballot_sync(0xffffffffu, hit_k >= 0);
      if (hit_k >= 0) s.pos_in[int64_t(t) * g.K + hit_k] = running + __popc(ballot & ((1u << lane) - 1));
      running += __popc(ballot);
    }
    before = warp_sum(before);
    below = warp_sum(below);
    if (lane == 0) {
      s.cnt[me_e] = running;
      s.start[me_e] = before;
      if (e == first) s.c_off[int64_t(m) * g.N + e / g.L] = below;
    }
  }
}

// Phase 2: row index of routed pair q (token t, expert e) within (member t % tp, dest e / L).
__device__ __forceinline__ int32_t pair_slot(const Geometry& g, const SendScratch& s, int64_t q, int t, int e) {
  return s.start[int64_t(t % g.tp) * g.E + e] + s.pos_in[q];
}

// Phase 2: row of routed pair q (token t, expert e) in the combine region's part of member t % tp
// ([tp][Q] rows at every member of the group): the member's rows for lower ranks come first.
__device__ __forceinline__ int32_t combine_slot(const Geometry& g, const SendScratch& s, int64_t q, int t, int e) {
  return s.c_off[int64_t(t % g.tp) * g.N + e / g.L] + pair_slot(g, s, q, t, e);
}

// Phase 2, every thread: the pair_slot output (combine_slot) for every pair of the group
// (combine_recv reads any member's rows), 0 for pairs that are not routed.
__device__ inline void write_pair_slots(const DispatchSendParams& P, const SendScratch& s, const GridIdx& ix) {
  const Geometry& g = P.g;
  for (int64_t q = ix.gtid; q < int64_t(g.T) * g.K; q += ix.gstride) {
    const int e = s.pair_expert[q];
    P.pair_slot[q] = e >= 0 ? combine_slot(g, s, q, static_cast<int>(q / g.K), e) : 0;
  }
}

// One warp copies bytes [seg * 512, seg * 512 + 512) (clipped to `bytes`) of src to dst: one 16-byte
// vector per lane when both rows are 16-byte aligned (warp_copy), bytewise otherwise.
constexpr int kStageSeg = 512;
__device__ __forceinline__ void warp_copy_segment(uint8_t* dst, const uint8_t* src, int64_t bytes, int64_t seg,
                                                  int lane) {
  const int64_t lo = seg * kStageSeg;
  warp_copy(dst + lo, src + lo, min(bytes, lo + kStageSeg) - lo, lane);
}

// The calling warp's segment 0 of a wire row: the body's last bytes past its 16-byte multiple
// (body16 <= body < body16 + 16, from src), then token t and router weight w after the body
// (4-byte aligned only when body % 4 == 0).
__device__ __forceinline__ void write_row_tail(uint8_t* dst, const uint8_t* src, int64_t body, int64_t body16, int t,
                                               float w, int lane) {
  if (lane < body - body16) dst[body16 + lane] = src[body16 + lane];
  if (lane == 0) {
    store_u32(dst + body, static_cast<uint32_t>(t));
    store_f32(dst + body + 4, w);
  }
}

// Max over the `group` consecutive lanes holding v (groups aligned to multiples of `group`, group <= 32).
__device__ __forceinline__ float group_max(float v, int group, int lane) {
  if ((group & (group - 1)) == 0) {
    for (int off = group / 2; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
    return v;
  }
  const int g0 = min(lane / group * group, 32 - group);  // lanes past the last whole group: any group
  float m = v;
  for (int j = 0; j < group; ++j) m = fmaxf(m, __shfl_sync(0xffffffffu, v, g0 + j));
  return m;
}

// Tokens -> wire rows (payload in the wire dtype, then fp8 scales). Work items are small so that a
// decode batch spreads over every warp of the grid: (token, group of scale blocks) for in-kernel fp8 quantisation (8 elements per
// lane, 16-byte loads), (token, 512-byte segment) for copies, (token, 256 elements) for conversions;
// element by element when sizes or alignment rule the vectors out.
//
// The work is spread over warps [warp0, warp0 + nw) stepping by nw and threads likewise (the
// whole grid: GridIdx; one block: its own warps), for tokens token(0 .. nm) into rows row_of(t)
// (global staging, or a block's shared-memory row).
struct StageWorkers {
  int lane;
  int64_t warp0, nw, tid0, nthreads;
};

template <typename TokenFn, typename RowFn>
__device__ inline void stage_rows(const DispatchSendParams& P, int64_t nm, TokenFn token, RowFn row_of,
                                  const StageWorkers& wk) {
  const Geometry& g = P.g;
  const int lane = wk.lane;
  const uint8_t* x = static_cast<const uint8_t*>(P.x);
  if (g.wire_is_fp8() && P.x_kind == ElemKind::kF8E4M3) {  // pre-quantised: copy the bytes, then the scales
    const int64_t segs = (int64_t(g.H) + kStageSeg - 1) / kStageSeg + 1;  // last: the scales
    for (int64_t w = wk.warp0; w < nm * segs; w += wk.nw) {
      const int t = token(w / segs);
      const int64_t seg = w % segs;
      uint8_t* row = row_of(t);
      if (seg < segs - 1) {
        warp_copy_segment(row, x + int64_t(t) * g.H, g.H, seg, lane);
      } else {
        uint8_t* sc = row + g.payload;  // S f32 scales, 4-byte aligned only when H % 4 == 0
        for (int b = lane; b < g.S; b += 32) store_f32(sc + 4 * b, P.x_scale[int64_t(t) * g.S + b]);
      }
    }
    return;
  }
  if (g.wire_is_fp8()) {  // quantise: one f32 scale per scale_block values (S blocks, the last may be partial)
    const int lpb = g.scale_block / 8;  // lanes per scale block, 8 values each
    // H % 8: every lane's 8 values are in the row and 16-byte aligned (scale_block % 8 no longer implies it)
    const bool vec = is_float(P.x_kind) && g.scale_block % 8 == 0 && g.H % 8 == 0 && lpb <= 32 && aligned16(P.x);
    if (vec) {
      const int bpw = 32 / lpb;  // scale blocks per warp
      const int64_t items = (g.S + bpw - 1) / bpw;
      const bool active_lane = lane < bpw * lpb;
      for (int64_t w = wk.warp0; w < nm * items; w += wk.nw) {
        const int t = token(w / items);
        const int b = static_cast<int>(w % items) * bpw + lane / lpb;
        const int64_t h = int64_t(b) * g.scale_block + (lane % lpb) * 8;  // first of this lane's 8 values
        const bool on = active_lane && b < g.S && h < g.H;  // h < H: lanes past a partial last block idle
        // (the block's first lane, lane % lpb == 0, always has h < H: it writes the scale)
        float v[8];
        float amax = 0.f;
        if (on) {
          load_vec8(P.x, int64_t(t) * g.H + h, P.x_kind, v);
#pragma unroll
          for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fp8_amax_term(v[i]));  // NaN, Inf: 0
        }
        amax = group_max(amax, lpb, lane);
        if (!on) continue;
        const float sc = fp8_block_scale(amax, g.pow2 != 0);
        const float inv = __frcp_rn(sc);
        uint8_t* row = row_of(t);
        if (lane % lpb == 0) store_f32(row + g.payload + 4 * b, sc);
        uint32_t packed[2] = {0u, 0u};
#pragma unroll
        for (int i = 0; i < 8; ++i)
          packed[i / 4] |= uint32_t(fp8_quantize_value(v[i], inv)) << (8 * (i % 4));
        *reinterpret_cast<uint2*>(row + h) = make_uint2(packed[0], packed[1]);  // h % 8 == 0, row 16-aligned
      }
      return;
    }
    for (int64_t w = wk.warp0; w < nm * g.S; w += wk.nw) {  // warp per (token, scale block)
      const int t = token(w / g.S);
      const int b = static_cast<int>(w % g.S);
      const int64_t base = int64_t(t) * g.H + int64_t(b) * g.scale_block;
      uint8_t* q = row_of(t) + int64_t(b) * g.scale_block;
      const int len = static_cast<int>(fp8_block_len(g.H, g.scale_block, b));  // the last block may be partial
      float amax = 0.f;
      for (int i = lane; i < len; i += 32) amax = fmaxf(amax, fp8_amax_term(load_elem(P.x, base + i, P.x_kind)));
      amax = warp_max(amax);
      const float sc = fp8_block_scale(amax, g.pow2 != 0);
      const float inv = __frcp_rn(sc);
      if (lane == 0) store_f32(row_of(t) + g.payload + 4 * b, sc);
      for (int i = lane; i < len; i += 32)
        q[i] = fp8_quantize_value(load_elem(P.x, base + i, P.x_kind), inv);
    }
    return;
  }
  if (P.x_kind == g.wire_kind) {  // same dtype: copy
    const int64_t segs = (g.payload + kStageSeg - 1) / kStageSeg;
    for (int64_t w = wk.warp0; w < nm * segs; w += wk.nw) {
      const int t = token(w / segs);
      warp_copy_segment(row_of(t), x + int64_t(t) * g.payload, g.payload, w % segs, lane);
    }
    return;
  }
  if (is_float(P.x_kind) && g.H % 8 == 0 && aligned16(P.x)) {  // convert 8 values per lane
    const int64_t segs = (int64_t(g.H) + 255) / 256;
    for (int64_t w = wk.warp0; w < nm * segs; w += wk.nw) {
      const int t = token(w / segs);
      const int64_t h = (w % segs) * 256 + 8 * int64_t(lane);
      if (h >= g.H) continue;
      float v[8];
      load_vec8(P.x, int64_t(t) * g.H + h, P.x_kind, v);
      store_vec8(row_of(t), h, g.wire_kind, v);
    }
    return;
  }
  for (int64_t i = wk.tid0; i < nm * g.H; i += wk.nthreads) {  // element by element
    const int t = token(i / g.H);
    const int64_t h = i % g.H;
    store_elem(row_of(t), h, g.wire_kind, load_elem(P.x, int64_t(t) * g.H + h, P.x_kind));
  }
}

// Phase 1, grid-wide: our member's tokens (t < n, t % tp == member) into their staging rows.
__device__ inline void stage_tokens(const DispatchSendParams& P, int n, int member, const GridIdx& ix) {
  const Geometry& g = P.g;
  const int64_t nm = n > member ? (n - member + g.tp - 1) / g.tp : 0;  // our member's tokens
  stage_rows(
      P, nm, [&](int64_t i) { return static_cast<int>(member + i * g.tp); },
      [&](int t) { return P.p.priv + g.off_staging + int64_t(t) * g.row; },
      StageWorkers{ix.lane, ix.gwarp, ix.nwarps, ix.gtid, ix.gstride});
}

}  // namespace a2a::gpu
