// Our own fp8 block-scaled grouped GEMM with the operands swapped ("swap-AB"), for decode: the same
// product as fp8_wgmma.cuh (y = x @ w[l]^T per group, x e4m3 rows with 1x128 scales, w e4m3 with
// 128x128 block scales, f32 accumulation, bf16 or f32 out), computed as y^T = w[l] @ x^T: a
// weight tile's 128 rows are the WGMMA's M (two math warpgroups x 64) and up to kTok of the
// group's rows (tokens) its N.
//
// Why: at decode (L = 8 experts, ~128-150 rows each) the row-major kernel's 128-row tiles split
// about half the groups into a full tile and a tile of <= 25 rows, and each tile streams the whole
// weight tile and a full 128-row x box through L2 again: ~380 tiles where 256 would do, every
// k-block ~1,160 cycles whether a tile holds 128 rows or 8 (ncu, notes/open_items.md 13). With the
// tokens as N (any multiple of 8 up to 256) one tile takes all of a group's rows: every weight
// tile is read once, and the x box is as tall as the tile's token count, not 128.
//
// Structure (one persistent CTA per SM, 384 threads), as fp8_wgmma.cuh except:
//   warp 0 (lane 0)  TMA: the weight tile [128, 128] into a, the x tile [kTok, 128] into b, per
//                    k-block, into a ring of kStages stages;
//   warp 1           the stage's scales: the x scales of its tokens at its k-block into sx[kTok]
//                    (x_scale [rows, K/128], one float per token: strided, from L2) and the
//                    weight tile's scale into sw, by cp.async. Each lane's arrival on the stage's
//                    `full` barrier is made when its copies land (cp.async.mbarrier.arrive.noinc),
//                    so a math warp that sees the stage full sees its scales, and the warp moves
//                    on to the next stage at once. Loading and waiting a stage at a time (one L2
//                    round trip per k-block) cost ~3 us per GEMM at L = 8, and the weight scale's
//                    global load in the promotion stalled the math warps (ncu; notes/benchmarks.md,
//                    2026-12-05);
//   warps 2-3        the output rows no group covers, zeroed (zero_rows_outside_groups, fp8_wgmma.cuh);
//   warpgroups 1-2   math: each owns 64 weight rows (m64 nN k32 WGMMAs, 4 per k-block, N the
//                    tile's tokens rounded up to 8 (Fp8Args::trim; kTok with the SwiGLU epilogue),
//                    chosen once per tile: with_mma_n); a
//                    thread's accumulators are weight rows r, r + 8 x tokens 8j + c0 (+1), so the
//                    promotion's x scale varies along the registers (sx from shared memory, two
//                    floats a load) and the weight scale is one per k-block (sw). The stage is
//                    released after its promotion (its scales live in it).
//   epilogue         y[token, n] written element by element from the registers (y^T's layout),
//                    tokens past the tile masked.
// Prologue: with a.prefetch_kblocks, warp 0 prefetches its CTA's first weight k-blocks into L2
// before waiting for the stream's previous kernel (programmatic launch).
// Tiles: (group l, token tile, n-tile), numbered as fp8_wgmma.cuh's with kTok-row token tiles.
// Epi::kSwigluFp8 (the gate+up GEMM with its SwiGLU, single CTAs): a tile is 128 columns of h for
// the tile's tokens, two passes over k (the gate block of w, then the up block; x read twice, as
// the unfused GEMM reads it once per n-tile of gu), the gate held in bf16 registers meanwhile. The
// epilogue (swap_swiglu_fp8_store) quantises h with one scale per token and 128 columns: exactly
// the 128 weight rows of the tile, so a token's amax is reduced over the two math warpgroups
// through shared memory. The values are the unfused pair's (bf16 gu, then the SwiGLU kernel),
// bit for bit: gate and up rounded to bf16, the same arithmetic and quantiser.
// The promotion is serial (each k-block's WGMMAs waited for, then promoted): measured no slower
// than issuing kb + 1 first at every token tile (2026-12-05, benchmarks/gemm_probe.cu), and it
// leaves room for 160-token tiles (2 x 80 accumulator registers).
//
// kCluster = 2: CTA pairs (thread-block clusters) take n-tiles 2j and 2j + 1 of one (group, token
// tile) together, and each loads half of the x tile with a TMA multicast into both: x crosses L2
// once per two weight tiles (at L = 8 its reads were more bytes than the weights'). A stage is
// then free only when both CTAs' math warps released it (16 arrivals, 8 of them remote), and
// both CTAs meet at a cluster barrier before either exits. Needs N / 128 even.
#pragma once

#include <cstdint>
#include <type_traits>
#include <utility>

#include "cute/arch/cluster_sm90.hpp"
#include "cute/arch/copy_sm80.hpp"
#include "cute/arch/mma_sm90_gmma.hpp"  // before its _ext (which does not include it)
#include "cute/arch/mma_sm90_gmma_ext.hpp"
#include "gemm/fp8_wgmma.cuh"

namespace a2a::gemm::wgmma {

template <int kTok>
struct SwapConfig {
  static_assert(kTok % 8 == 0 && kTok >= 8 && kTok <= 256, "WGMMA N: a multiple of 8 up to 256");
  static constexpr uint32_t kStageBytes = (kBN + kTok) * kBK;  // w tile + x tile, one byte each
  // Per stage besides the tiles: sx[kTok] and sw (floats), the full and empty barriers.
  static constexpr size_t kStageExtra = (kTok + 1) * sizeof(float) + 2 * sizeof(uint64_t);
  static constexpr size_t kTableBytes = kMaxGroups * (sizeof(int64_t) + 2 * sizeof(int32_t));
  static constexpr size_t kAmaxBytes = 8 * kTok * sizeof(float);  // SwapStorage::amax
  // As many stages as fit 227 KB of shared memory (the table, amax and 2 KB of alignment slack aside), at most 8.
  static constexpr int kStages = [] {
    const size_t per = kStageBytes + kStageExtra;
    const size_t n = (227 * 1024 - kTableBytes - kAmaxBytes - 2048) / per;
    return static_cast<int>(n > 8 ? 8 : n);
  }();
  static_assert(kStages >= 3, "too few stages");
};

template <int kTok>
struct alignas(1024) SwapStorage {
  static_assert(kTok % 16 == 0, "a multicast half of the x tile: whole 8-row swizzle atoms");
  static constexpr int kStages = SwapConfig<kTok>::kStages;
  uint8_t a[kStages][kBN * kBK];   // weight tile: 128 rows of w[l] x 128 k (1024-byte aligned)
  uint8_t b[kStages][kTok * kBK];  // x tile: kTok rows x 128 k (kTok % 8 == 0 keeps 1024-byte alignment)
  float sx[kStages][kTok];         // x_scale of the tile's tokens at the stage's k-block (0 past the tile)
  float amax[8][kTok];             // Epi::kSwigluFp8: each math warp's amax of h per token (16 of the 128 columns)
  float sw[kStages];               // w_scale of the tile's 128 weight rows at the stage's k-block
  uint64_t full[kStages];          // TMA bytes + warp 1's 32 arrivals
  uint64_t empty[kStages];         // one arrival per math warp, after the promotion
  int64_t row_start[kMaxGroups];
  int32_t m_rows[kMaxGroups];
  int32_t tile_end[kMaxGroups];
};
template <int kTok>
constexpr size_t swap_smem_bytes() {
  return sizeof(SwapStorage<kTok>) + 1024;
}

// How many of `clusters` take the kernel's `tiles` (the rest only zero rows): the fewest that still
// need no more rounds than all of them would, ceil(tiles / ceil(tiles / clusters)). Each then
// takes the same number of tiles (the last maybe fewer), so no cluster starts a round while most
// SMs idle: a CTA of this kernel streams its tile at about its share of HBM bandwidth whether the
// others run or not (bound by its serial promotion), so a last round of 52 tiles on 132 SMs took a
// full round's time (the down GEMM at L = 8: 448 tiles, 11.8 us for the fourth round); 112
// clusters of 4 rounds each leave no such round: 59.8 against 63.5 us (H100, 2026-12-06,
// gemm_probe balance; L = 32 down 172.4 against 173.5, gate+up level).
__host__ __device__ inline int swap_takers(int tiles, int clusters) {
  if (tiles <= 0 || clusters <= 0) return clusters;
  const int rounds = (tiles + clusters - 1) / clusters;
  return (tiles + rounds - 1) / rounds;
}

// M's accumulators are the first sizeof...(I) of d (a WGMMA with N below the tile's kTok writes
// the registers of its first N tokens: registers 4j.. of tokens 8j.., the same for every N).
template <class M, int kAcc, int... I>
__device__ __forceinline__ void mma_call(uint64_t da, uint64_t db, float (&d)[kAcc], cute::SM90::GMMA::ScaleOut sc,
                                         std::integer_sequence<int, I...>) {
  static_assert(sizeof...(I) <= kAcc, "more accumulators than the tile holds");
  M::fma(da, db, d[I]..., sc);
}

// m64 nN k32, e4m3 x e4m3 -> f32, both operands from shared memory (K-major), for every N the
// WGMMA takes (multiples of 8 up to 256).
template <int kN> struct SwapMma;
#define A2A_SWAP_MMA(N) \
  template <> struct SwapMma<N> { using type = cute::SM90::GMMA::MMA_64x##N##x32_F32E4M3E4M3_SS_TN<>; };
A2A_SWAP_MMA(8) A2A_SWAP_MMA(16) A2A_SWAP_MMA(24) A2A_SWAP_MMA(32) A2A_SWAP_MMA(40) A2A_SWAP_MMA(48)
A2A_SWAP_MMA(56) A2A_SWAP_MMA(64) A2A_SWAP_MMA(72) A2A_SWAP_MMA(80) A2A_SWAP_MMA(88) A2A_SWAP_MMA(96)
A2A_SWAP_MMA(104) A2A_SWAP_MMA(112) A2A_SWAP_MMA(120) A2A_SWAP_MMA(128) A2A_SWAP_MMA(136) A2A_SWAP_MMA(144)
A2A_SWAP_MMA(152) A2A_SWAP_MMA(160) A2A_SWAP_MMA(168) A2A_SWAP_MMA(176) A2A_SWAP_MMA(184) A2A_SWAP_MMA(192)
A2A_SWAP_MMA(200) A2A_SWAP_MMA(208) A2A_SWAP_MMA(216) A2A_SWAP_MMA(224) A2A_SWAP_MMA(232) A2A_SWAP_MMA(240)
A2A_SWAP_MMA(248) A2A_SWAP_MMA(256)
#undef A2A_SWAP_MMA

// A k-block's four WGMMAs (k32 each) over the tile's first kN tokens: d = (w x^T over the k-block)
// + (accumulate ? d : 0) in d's first kN / 2 registers; the rest untouched.
template <int kN, int kAcc>
__device__ __forceinline__ void kblock_mma(uint64_t da, uint64_t db, float (&d)[kAcc], bool accumulate) {
  using M = typename SwapMma<kN>::type;
#pragma unroll
  for (int j = 0; j < kBK / 32; ++j)
    mma_call<M>(da + 2 * j, db + 2 * j, d, j == 0 && !accumulate ? cute::SM90::GMMA::ScaleOut::Zero : cute::SM90::GMMA::ScaleOut::One,
                std::make_integer_sequence<int, kN / 2>{});
}

// The first kUsed registers of d (all by default) as the WGMMAs' operands: not moved across them.
template <int kUsed = -1, int kN>
__device__ __forceinline__ void fence_regs(float (&d)[kN]) {
  constexpr int kCount = kUsed < 0 ? kN : kUsed;
  static_assert(kCount <= kN, "more registers than d holds");
#pragma unroll
  for (int i = 0; i < kCount; ++i) cute::warpgroup_fence_operand(d[i]);
}

// kblock_mma as one WGMMA batch: fenced, issued, committed (not waited for).
// Only d's first kN / 2 registers are fenced (the WGMMAs' operands): fencing registers no WGMMA
// writes made ptxas serialise the WGMMAs (C7511).
template <int kN, int kAcc>
__device__ __forceinline__ void issue_kblock(uint64_t da, uint64_t db, float (&d)[kAcc], bool accumulate) {
  fence_regs<kN / 2>(d);
  cute::warpgroup_arrive();
  kblock_mma<kN>(da, db, d, accumulate);
  cute::warpgroup_commit_batch();
  fence_regs<kN / 2>(d);
}

// f(std::integral_constant<int, N>{}) with N = n, a multiple of 8 in [kLo, kHi], found by halving
// the range (at most 5 warp-uniform branches for kTok = 160). Chosen once per tile, around a whole
// k loop: WGMMAs behind a branch inside the loop are serialised by ptxas (C7511).
template <int kLo, int kHi, class F>
__device__ __forceinline__ void with_mma_n(int n, F&& f) {
  if constexpr (kLo == kHi) {
    f(std::integral_constant<int, kLo>{});
  } else {
    constexpr int kMid = (kLo + kHi) / 16 * 8;
    if (n <= kMid)
      with_mma_n<kLo, kMid>(n, f);
    else
      with_mma_n<kMid + 8, kHi>(n, f);
  }
}

// The WGMMA's N for a tile of `rows` tokens (Fp8Args::trim): rows rounded up to 8, in [8, kTok];
// kTok when trimming is off.
template <int kTok>
__device__ __forceinline__ int swap_mma_n(int rows, bool trim) {
  return trim ? min(kTok, max(8, (rows + 7) & ~7)) : kTok;
}

// acc += d * w_scale * x_scale[token]: registers 4j + {0, 2} are token 8j + c0, 4j + {1, 3} token
// 8j + c0 + 1 (weight rows r and r + 8).
// d holds the first kD / 2 tokens' registers (the WGMMA's N = kD, swap_mma_n); acc's others stay.
template <int kD, int kN>
__device__ __forceinline__ void promote_swap(float (&acc)[kN], const float (&d)[kD], float sw, const float* sx, int c0) {
  static_assert(kD % 4 == 0 && kD <= kN, "d: whole 8-token groups within the tile");
#pragma unroll
  for (int j = 0; j < kD / 4; ++j) {
    const float2 s2 = *reinterpret_cast<const float2*>(sx + 8 * j + c0);
    const float s0 = s2.x * sw, s1 = s2.y * sw;
    acc[4 * j + 0] = fmaf(d[4 * j + 0], s0, acc[4 * j + 0]);
    acc[4 * j + 1] = fmaf(d[4 * j + 1], s1, acc[4 * j + 1]);
    acc[4 * j + 2] = fmaf(d[4 * j + 2], s0, acc[4 * j + 2]);
    acc[4 * j + 3] = fmaf(d[4 * j + 3], s1, acc[4 * j + 3]);
  }
}

template <class OutT>
__device__ __forceinline__ void store_one(OutT* p, float v);
template <>
__device__ __forceinline__ void store_one<__nv_bfloat16>(__nv_bfloat16* p, float v) {
  *p = __float2bfloat16_rn(v);
}
template <>
__device__ __forceinline__ void store_one<float>(float* p, float v) {
  *p = v;
}

// The two math warpgroups (256 threads) meet (named barrier 1; 0 is __syncthreads).
__device__ __forceinline__ void math_warpgroups_sync() { asm volatile("bar.sync 1, 256;" ::: "memory"); }

// Epi::kSwigluFp8's epilogue: up in acc (f32), the gate in bf16 pairs (gate[q / 2] holds registers
// q & ~1, q | 1); h = silu(gate) * up, quantised with one scale per token over the tile's 128 h
// columns (h-block nt), by the SwiGLU kernel's arithmetic (grouped_gemm.cu) and the library's
// quantiser. The thread's values: weight rows (h columns) r and r + 8 (registers 4j + {0, 1} and
// 4j + {2, 3}) of tokens 8j + c0 and 8j + c0 + 1 (4j + {0, 2} and 4j + {1, 3}); mw (0..7) is its
// warp among the math warps, amax [8][kTok] in shared memory.
template <int kAcc, int kTok>
__device__ __forceinline__ void swap_swiglu_fp8_store(float (&acc)[kAcc], const uint32_t (&gate)[kAcc / 2], float (&amax)[8][kTok],
                                                      const Fp8Args& a, int64_t row_base, int tile_rows, int nt, int col, int c0,
                                                      int mw) {
  const int lane = threadIdx.x & 31;
  const int f = a.n / 2;
  const int nb = f / kBN;  // h_scale's columns
#pragma unroll
  for (int q = 0; q < kAcc; ++q) {
    const __nv_bfloat162 g2 = *reinterpret_cast<const __nv_bfloat162*>(&gate[q / 2]);
    const float g = (q & 1) == 0 ? __low2float(g2) : __high2float(g2);
    const float u = __bfloat162float(__float2bfloat16_rn(acc[q]));
    acc[q] = silu(g) * u;
  }
  // a token's amax: the thread's two rows, the 8 lanes sharing its tokens (lane >> 2: xor 4, 8, 16),
  // then the 8 math warps through amax (written by lanes 0-3, which hold every token once)
#pragma unroll
  for (int j = 0; j < kAcc / 4; ++j) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      float m = fmaxf(fp8_amax_term(acc[4 * j + e]), fp8_amax_term(acc[4 * j + 2 + e]));
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 4));
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 8));
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 16));
      if (lane < 4) amax[mw][8 * j + c0 + e] = m;
    }
  }
  math_warpgroups_sync();
  uint8_t* hcol = a.h + row_base * f + static_cast<int64_t>(nt) * kBN + col;
#pragma unroll
  for (int j = 0; j < kAcc / 4; ++j) {
    float2 m = *reinterpret_cast<const float2*>(&amax[0][8 * j + c0]);
#pragma unroll
    for (int w = 1; w < 8; ++w) {
      const float2 o = *reinterpret_cast<const float2*>(&amax[w][8 * j + c0]);
      m.x = fmaxf(m.x, o.x);
      m.y = fmaxf(m.y, o.y);
    }
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int tok = 8 * j + c0 + e;
      const float sc = fp8_block_scale(e == 0 ? m.x : m.y, false);
      const float inv = __frcp_rn(sc);
      if (tok >= tile_rows) continue;
      uint8_t* p = hcol + static_cast<int64_t>(tok) * f;
      p[0] = gpu::fp8_quantize_value(acc[4 * j + e], inv);
      p[8] = gpu::fp8_quantize_value(acc[4 * j + 2 + e], inv);
      if (mw == 0 && lane < 4) a.h_scale[(row_base + tok) * nb + nt] = sc;
    }
  }
  math_warpgroups_sync();  // amax is the next tile's
}

// Ablations, for measurements only (benchmarks/gemm_probe.cu compiles them with
// A2A_GEMM_ABLATIONS; the library instantiates kFull alone). Each removes one part of the work to
// show which part bounds the kernel; their outputs are wrong by design.
enum class Ablate : int {
  kFull = 0,       // the kernel
  kNoMath = 1,     // the math warps release each stage as soon as it is full: the loads alone
  kNoX = 2,        // the x tile is not loaded (the WGMMAs read the stage's stale bytes): weights alone
  kNoPromote = 3,  // the WGMMAs accumulate straight into acc, one k-block in flight: no promotion
};

// Measurements (A2A_GEMM_ABLATIONS: Fp8Args::trace): the global timer at the start (which = 0) or end
// (1) of this CTA's i-th tile, by math thread 128. Nothing in the library's build.
__device__ __forceinline__ void trace_stamp([[maybe_unused]] const Fp8Args& a, [[maybe_unused]] int i, [[maybe_unused]] int which) {
#ifdef A2A_GEMM_ABLATIONS
  if (a.trace != nullptr && threadIdx.x == 128 && i < a.trace_per_cta) {
    unsigned long long ns;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns));
    a.trace[(static_cast<int64_t>(blockIdx.x) * a.trace_per_cta + i) * 2 + which] = ns;
  }
#endif
}

// The first tile of cluster `cluster_id` among `clusters` with `total` tiles in all (Fp8Args::balance:
// swap_takers' clusters take tiles, in steps of `takers`); total when it takes none.
struct SwapTiles {
  int first, step;
};
__device__ __forceinline__ SwapTiles swap_tiles_of(int total, int clusters, int cluster_id, bool balance) {
  const int takers = balance ? swap_takers(total, clusters) : clusters;
  return SwapTiles{cluster_id < takers ? cluster_id : total, takers};
}

// The row of w ([L * N, K] as TMA sees it) where a tile's weight block of pass `pass` starts: group
// l's rows, the up block's F rows further on for pass 1 (Epi::kSwigluFp8), n-tile nt.
__device__ __forceinline__ int32_t swap_weight_row(const Fp8Args& a, const Tile& tile, int pass, int n_out) {
  return tile.l * a.n + pass * n_out + tile.nt * kBN;
}

// L2 prefetch of a weight tile's first `count` k-blocks (cp.async.bulk.prefetch.tensor): no shared
// memory, no barrier. One thread.
__device__ __forceinline__ void prefetch_weight_kblocks(const CUtensorMap& tma_w, int32_t wrow, int count) {
  for (int kb = 0; kb < count; ++kb) cute::SM90_TMA_LOAD_2D::PREFETCH::copy(&tma_w, kb * kBK, wrow);
}

// The ring's barriers (thread 32): `full` expects the TMA thread and warp 1's 32 lanes, `empty` the 8
// math warps of each CTA of the cluster.
template <int kTok>
__device__ __forceinline__ void swap_init_barriers(SwapStorage<kTok>& s, int cluster) {
  for (int i = 0; i < SwapStorage<kTok>::kStages; ++i) {
    cutlass::arch::ClusterTransactionBarrier::init(&s.full[i], 1 + 32);  // TMA thread + warp 1's lanes
    cutlass::arch::ClusterBarrier::init(&s.empty[i], 8 * cluster);        // the 8 math warps of each CTA
  }
  cutlass::arch::fence_barrier_init();
}

// One tile's loads by the TMA thread (warp 0, lane 0): each of its passes' k-blocks, the weight
// block into a and the x block into b of the ring's next stage (`it`, advanced), once the math
// warps released it.
template <int kTok, int kCluster, Ablate kAblate = Ablate::kFull>
__device__ __forceinline__ void swap_load_tile(const CUtensorMap& tma_x, const CUtensorMap& tma_w, const Fp8Args& a,
                                               SwapStorage<kTok>& s, const Tile& tile, int passes, int n_out, int kblocks,
                                               uint32_t crank, uint32_t& it) {
  constexpr int kSt = SwapStorage<kTok>::kStages;
  constexpr int kHalf = kTok / kCluster;  // rows of x this CTA loads (for both CTAs of a pair)
  const int32_t xrow = static_cast<int32_t>(s.row_start[tile.l] + static_cast<int64_t>(tile.mt) * kTok) +
                       static_cast<int32_t>(crank) * kHalf;
  const int total = passes * kblocks;  // k-blocks of the tile's passes
  auto load_w = [&](int q) {
    const int pass = q / kblocks, kb = q - pass * kblocks;
    const uint32_t i = it + static_cast<uint32_t>(q);
    const int st = static_cast<int>(i % kSt);
    wait_or_trap(&s.empty[st], ((i / kSt) & 1) ^ 1);
    constexpr uint32_t kBytes = kAblate == Ablate::kNoX ? kBN * kBK : SwapConfig<kTok>::kStageBytes;
    cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(&s.full[st], kBytes);
    cute::SM90_TMA_LOAD_2D::copy(&tma_w, &s.full[st], static_cast<uint64_t>(cute::TMA::CacheHintSm90::EVICT_NORMAL), s.a[st],
                                 kb * kBK, swap_weight_row(a, tile, pass, n_out));
  };
  auto load_x = [&](int q) {
    const int kb = q % kblocks;
    const int st = static_cast<int>((it + static_cast<uint32_t>(q)) % kSt);
    if constexpr (kAblate == Ablate::kNoX) {
    } else if constexpr (kCluster > 1) {
      cute::SM90_TMA_LOAD_MULTICAST_2D::copy(&tma_x, &s.full[st], static_cast<uint16_t>((1u << kCluster) - 1),
                                             static_cast<uint64_t>(cute::TMA::CacheHintSm90::EVICT_LAST),
                                             s.b[st] + crank * kHalf * kBK, kb * kBK, xrow);
    } else {
      cute::SM90_TMA_LOAD_2D::copy(&tma_x, &s.full[st], static_cast<uint64_t>(cute::TMA::CacheHintSm90::EVICT_LAST), s.b[st],
                                   kb * kBK, xrow);
    }
  };
  for (int q = 0; q < total; ++q) {
    load_w(q);
    load_x(q);
  }
  it += static_cast<uint32_t>(total);
}

// One tile's scales by warp 1: per k-block of its passes, the x scales of its tokens into sx (zeros
// past the tile) and the weight block's scale into sw by cp.async, each lane's arrival on the
// stage's `full` barrier made when its copies land (.noinc). n_out: the output columns (F with
// two passes: the up block's scales are F / 128 block rows further on).
template <int kTok>
__device__ __forceinline__ void swap_load_scales(const Fp8Args& a, SwapStorage<kTok>& s, const Tile& tile, int passes, int n_out,
                                                 int kblocks, uint32_t& it) {
  constexpr int kSt = SwapStorage<kTok>::kStages;
  const int lane = threadIdx.x & 31;
  const int tiles_n = n_out / kBN, wblocks_n = a.n / kBN;
  const int64_t row0 = s.row_start[tile.l] + static_cast<int64_t>(tile.mt) * kTok;
  const int tile_rows = min(kTok, s.m_rows[tile.l] - tile.mt * kTok);
  for (int q = 0; q < passes * kblocks; ++q, ++it) {
    const int pass = q / kblocks, kb = q - pass * kblocks;
    const float* sw = a.w_scale + (static_cast<int64_t>(tile.l) * wblocks_n + pass * tiles_n + tile.nt) * kblocks;
    const int st = static_cast<int>(it % kSt);
    wait_or_trap(&s.empty[st], ((it / kSt) & 1) ^ 1);
#pragma unroll
    for (int i = lane; i < kTok; i += 32)
      cute::SM80_CP_ASYNC_CACHEALWAYS_ZFILL<float>::copy(  // without registers; zeros past the tile
          *(i < tile_rows ? a.x_scale + (row0 + i) * kblocks + kb : a.x_scale), s.sx[st][i], i < tile_rows);
    if (lane == 0) cute::SM80_CP_ASYNC_CACHEALWAYS_ZFILL<float>::copy(sw[kb], s.sw[st], true);
    // one of the barrier's expected arrivals (.noinc), made once this lane's copies have landed
    cutlass::arch::cpasync_barrier_arrive_noinc(&s.full[st]);
  }
}

// One tile's math and epilogue by a math warp (warpgroup 1 + mwg, 0 or 1): kblocks k-blocks per pass
// (two passes with kSwigluFp8) from the ring (`it`, advanced), each k-block's WGMMAs waited for and
// promoted into acc, the stage released after its promotion; then y (kStore) or h and its scales
// (kSwigluFp8).
template <class OutT, int kTok, int kCluster, Ablate kAblate, Epi kEpi>
__device__ __forceinline__ void swap_math_tile(const Fp8Args& a, SwapStorage<kTok>& s, const Tile& tile, int kblocks,
                                               uint32_t crank, int mwg, uint32_t& it) {
  constexpr int kSt = SwapStorage<kTok>::kStages;
  constexpr int kAcc = kTok / 2;  // accumulator registers per thread (m64 x kTok over 128 threads)
  const int lane = threadIdx.x & 31;
  const int wl = (threadIdx.x / 32) & 3;
  const int r_lo = wl * 16 + (lane >> 2);  // this thread's weight rows in its 64: r_lo, r_lo + 8
  const int c0 = (lane & 3) * 2;           // and tokens c0 + 8j, +1
  const int tile_rows = min(kTok, s.m_rows[tile.l] - tile.mt * kTok);
  const int64_t row_base = s.row_start[tile.l] + static_cast<int64_t>(tile.mt) * kTok;
  // The WGMMAs' N: the tile's tokens, not kTok. Not for the SwiGLU epilogue: its 20 variants of
  // both passes' k loops cost it more registers and spills than trimming saved (gate+up at L = 8
  // was not faster trimmed, gemm_probe trim, 2026-12-06).
  constexpr int kMinN = kEpi == Epi::kSwigluFp8 ? kTok : 8;
  const int mma_n = kEpi == Epi::kSwigluFp8 ? kTok : swap_mma_n<kTok>(tile_rows, a.trim);

  float acc[kAcc];
  [[maybe_unused]] uint32_t gate[kEpi == Epi::kSwigluFp8 ? kAcc / 2 : 1];  // kSwigluFp8: the gate block in bf16

  // Waits for stage i to be full; its operands' descriptors (this warpgroup's 64 weight rows, x).
  auto stage_descs = [&](uint32_t i) {
    const int st = static_cast<int>(i % kSt);
    wait_or_trap(&s.full[st], (i / kSt) & 1);
    __syncwarp();
    return std::make_pair(smem_desc(s.a[st] + mwg * 64 * kBK), smem_desc(s.b[st]));
  };
  auto release = [&](uint32_t i) {  // this CTA's and (pairs) the peer's math warps are done with stage i
    const int st = static_cast<int>(i % kSt);
    arrive_if(&s.empty[st], lane == 0);
    if constexpr (kCluster > 1) cutlass::arch::ClusterBarrier::arrive(&s.empty[st], crank ^ 1u, lane == 0);
  };
  if constexpr (kAblate == Ablate::kNoMath) {
#pragma unroll
    for (int q = 0; q < kAcc; ++q) acc[q] = 0.f;
    for (int kb = 0; kb < kblocks; ++kb, ++it) {
      wait_or_trap(&s.full[it % kSt], (it / kSt) & 1);
      __syncwarp();
      release(it);
    }
  } else if constexpr (kAblate == Ablate::kNoPromote) {
    with_mma_n<kMinN, kTok>(mma_n, [&](auto kN) {
      for (int kb = 0; kb < kblocks; ++kb, ++it) {
        const auto [da, db] = stage_descs(it);
        issue_kblock<kN.value>(da, db, acc, kb > 0);
        if (kb > 0) {
          cute::warpgroup_wait<1>();
          release(it - 1);
        }
      }
    });
    cute::warpgroup_wait<0>();
    fence_regs(acc);
    if (kblocks > 0) release(it - 1);
  } else {
    // one pass over k into acc (zeroed first)
    auto run_k = [&]() {
#pragma unroll
      for (int q = 0; q < kAcc; ++q) acc[q] = 0.f;
      with_mma_n<kMinN, kTok>(mma_n, [&](auto kN) {
        float t0[kN.value / 2];  // the k-block's product over the tile's first kN tokens
        for (int kb = 0; kb < kblocks; ++kb, ++it) {
          const auto [da, db] = stage_descs(it);
          issue_kblock<kN.value>(da, db, t0, false);
          const int st = static_cast<int>(it % kSt);
          const float wsc = s.sw[st];
          cute::warpgroup_wait<0>();
          fence_regs(t0);
          promote_swap(acc, t0, wsc, s.sx[st], c0);
          release(it);  // sx lives in the stage: released after the promotion
        }
      });
    };
    run_k();
    if constexpr (kEpi == Epi::kSwigluFp8) {
#pragma unroll
      for (int q = 0; q < kAcc / 2; ++q) gate[q] = pack_bf16x2(acc[2 * q], acc[2 * q + 1]);  // as gu's bf16
      run_k();  // the up block
    }
  }

  if constexpr (kEpi == Epi::kSwigluFp8) {
    swap_swiglu_fp8_store<kAcc, kTok>(acc, gate, s.amax, a, row_base, tile_rows, tile.nt, mwg * 64 + r_lo, c0, mwg * 4 + wl);
  } else {
    // y[row_base + token, n0 + r] for tokens 8j + c0 (+1) below tile_rows, weight rows r_lo (+8).
    OutT* ycol = static_cast<OutT*>(a.y) + row_base * a.n + static_cast<int64_t>(tile.nt) * kBN + mwg * 64 + r_lo;
#pragma unroll
    for (int j = 0; j < kAcc / 4; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int tok = 8 * j + c0 + e;
        if (tok >= tile_rows) continue;
        OutT* p = ycol + static_cast<int64_t>(tok) * a.n;
        store_one<OutT>(p, acc[4 * j + e]);
        store_one<OutT>(p + 8, acc[4 * j + 2 + e]);
      }
    }
  }
}

// tma_x: boxes of kTok / kCluster rows (each CTA of a pair loads its half for both).
template <class OutT, int kTok, int kCluster, Ablate kAblate = Ablate::kFull, Epi kEpi = Epi::kStore>
__global__ void __launch_bounds__(kThreads, 1)
    fp8_swap_kernel(const __grid_constant__ CUtensorMap tma_x, const __grid_constant__ CUtensorMap tma_w, const Fp8Args a) {
#if defined(__CUDA_ARCH__)
#if __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  static_assert(kCluster == 1 || kCluster == 2, "pairs at most");
  static_assert(kEpi == Epi::kStore || (kCluster == 1 && kAblate == Ablate::kFull), "the SwiGLU epilogue: single CTAs, whole");
  using Storage = SwapStorage<kTok>;
  extern __shared__ uint8_t smem_raw[];
  Storage& s = aligned_storage<Storage>(smem_raw);  // LDS in the promotion (fp8_wgmma.cuh)
  const int warp = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x) / 32, 0);
  const int wg = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x) / 128, 0);
  const int lane = threadIdx.x & 31;
  constexpr int kPasses = kEpi == Epi::kSwigluFp8 ? 2 : 1;  // w blocks per tile (gate, up)
  const int n_out = kEpi == Epi::kSwigluFp8 ? a.n / 2 : a.n;  // output columns (F, or N)
  const int tiles_n = n_out / kBN, kblocks = a.k / kBK;
  const int tiles_nc = tiles_n / kCluster;  // n-tile groups a cluster takes (pairs: N / 256)
  const uint32_t crank = kCluster > 1 ? cute::block_rank_in_cluster() : 0;
  const int cluster_id = blockIdx.x / kCluster, clusters = gridDim.x / kCluster;
  // Tile t of this cluster -> group, token tile and this CTA's n-tile.
  auto tile_of = [&](int t) {
    Tile tile = decode_tile<kTok>(s, a.num_groups, tiles_nc, t);
    tile.nt = tile.nt * kCluster + static_cast<int>(crank);
    return tile;
  };

  if (threadIdx.x == 32) swap_init_barriers(s, kCluster);
  if (threadIdx.x == 64) {
    cute::prefetch_tma_descriptor(reinterpret_cast<const cute::TmaDescriptor*>(&tma_x));
    cute::prefetch_tma_descriptor(reinterpret_cast<const cute::TmaDescriptor*>(&tma_w));
  }
  // Before the stream's previous kernel is done (programmatic launch, gpu/pdl.cuh): warm L2 with the
  // first a.prefetch_kblocks k-blocks of this CTA's first weight tile, so that its first round does
  // not start from an empty pipeline. Only the weights are read (no kernel of the stream writes
  // them), found through a provisional group table: group_sizes may still be being written by the
  // previous kernel, and a stale table only prefetches other bytes. The table is built again
  // after the wait, and nothing else global is touched before it.
  if (a.prefetch_kblocks > 0 && warp == 0) {
    build_group_table<kTok>(a, tiles_nc, s);
    __syncwarp();
    const int total = s.tile_end[a.num_groups - 1];
    const SwapTiles mine = swap_tiles_of(total, clusters, cluster_id, a.balance);
    if (lane == 0 && mine.first < total)
      prefetch_weight_kblocks(tma_w, swap_weight_row(a, tile_of(mine.first), 0, n_out), min(kblocks, a.prefetch_kblocks));
    __syncwarp();
  }
  gpu::wait_for_previous_grid();  // nothing global but the prefetch above before this
  gpu::allow_next_grid();
  if (warp == 0) build_group_table<kTok>(a, tiles_nc, s);
  __syncthreads();
  if constexpr (kCluster > 1) {  // the peer's barriers are initialised before anything of ours reaches them
    cute::cluster_arrive_relaxed();
    cute::cluster_wait();
  }
  const int total_tiles = s.tile_end[a.num_groups - 1];  // tiles of a cluster (pairs when kCluster = 2)
  const SwapTiles mine = swap_tiles_of(total_tiles, clusters, cluster_id, a.balance);

  if (wg == 0) {  // producers
    cutlass::arch::warpgroup_reg_dealloc<40>();
    uint32_t it = 0;
    if (warp == 0 && lane == 0) {  // TMA
      for (int t = mine.first; t < total_tiles; t += mine.step)
        swap_load_tile<kTok, kCluster, kAblate>(tma_x, tma_w, a, s, tile_of(t), kPasses, n_out, kblocks, crank, it);
    } else if (warp == 1) {  // x scales
      for (int t = mine.first; t < total_tiles; t += mine.step) swap_load_scales<kTok>(a, s, tile_of(t), kPasses, n_out, kblocks, it);
      asm volatile("cp.async.wait_all;" ::: "memory");
    } else if (warp >= 2) {
      zero_rows_outside_groups<OutT, kEpi>(a, s, blockIdx.x * 2 + (warp - 2), gridDim.x * 2);
    }
    __syncwarp();
    if constexpr (kCluster > 1) {  // neither CTA exits while the other may still arrive on its barriers
      cute::cluster_arrive();
      cute::cluster_wait();
    }
    return;
  }

  // math warpgroups
  cutlass::arch::warpgroup_reg_alloc<232>();
  uint32_t it = 0;
  for (int t = mine.first, traced = 0; t < total_tiles; t += mine.step, ++traced) {
    trace_stamp(a, traced, 0);
    swap_math_tile<OutT, kTok, kCluster, kAblate, kEpi>(a, s, tile_of(t), kblocks, crank, wg - 1, it);
    trace_stamp(a, traced, 1);
  }
  if constexpr (kCluster > 1) {
    cute::cluster_arrive();
    cute::cluster_wait();
  }
#else
  __trap();
#endif
#endif
}

}  // namespace a2a::gemm::wgmma
