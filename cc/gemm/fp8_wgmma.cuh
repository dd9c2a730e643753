// Our own fp8 block-scaled grouped GEMM for Hopper (sm_90a): y = x @ w[l]^T per group, x e4m3 rows
// with 1x128 scales, w e4m3 [L, N, K] with 128x128 block scales, f32 accumulation, bf16 or f32 out.
//
// Why not CUTLASS's blockwise kernel (cutlass_grouped.cuh) here: its mainloop waits for each
// k-block's WGMMAs to finish before promoting them into the f32 accumulator with the k-block's
// scales (FFMA), so the tensor cores idle during every promotion; at decode (L = 8 experts,
// ~128 rows each) the GEMMs ran at ~40 % tensor and ~50 % DRAM throughput (notes/open_items.md
// 13). This kernel keeps two temporary accumulators per math warpgroup: k-block kb+1's WGMMAs are
// issued before kb's are waited for, so the promotion of kb overlaps the tensor work of kb+1.
//
// Structure (one persistent CTA per SM, 384 threads):
//   warpgroup 0   producer: one thread issues the TMA loads of each k-block (x tile [128, 128] and
//                 w tile [128, 128], 128-byte swizzled) into a ring of kStages shared-memory stages
//                 (full / empty mbarriers); its registers are given to the math warpgroups.
//   warpgroups 1-2  math: each owns 64 rows of the 128-row tile (m64n128k32 WGMMAs, 4 per k-block),
//                 promotes kb's product with x_scale[row, kb] * w_scale[l, n-block, kb], then
//                 stores its rows (bf16x2 or float2) straight from registers, rows past the group
//                 masked. A warpgroup whose 64 rows are all past the group skips its WGMMAs.
// Tiles: (group l, m-tile, n-tile) numbered group by group, n-tile major and m-tile minor (the
// m-tiles of one weight tile are neighbours: they run together and share it through L2); CTA b
// takes tiles b, b + grid, ... . The group table (row starts, rows, tile prefix) is computed from
// group_sizes on the device by every CTA, so nothing syncs with the host (command-buffer safe).
//
// Shapes: x [rows, K] e4m3 (ragged: rows = R, groups back to back from row 0; expert_major: rows =
// L*C, group l from row l*C), x_scale f32 [rows, K/128], w [L, N, K] e4m3, w_scale f32
// [L, N/128, K/128], group_sizes int32 [L], y [rows, N]. N and K multiples of 128, L <=
// kMaxGroups. Rows of y no group covers get zeros (zero_rows_outside_groups: the producer warpgroup's
// idle warps, while the GEMM runs).
#pragma once

#include <cstdint>
#include <type_traits>
#include <utility>

#include <cuda.h>  // CUtensorMap and its enums (types only: the encoder is fetched at run time)
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include "cute/arch/copy_sm90_desc.hpp"
#include "cute/arch/copy_sm90_tma.hpp"
#include "cute/arch/mma_sm90_gmma.hpp"
#include "cutlass/arch/barrier.h"
#include "cutlass/arch/reg_reconfig.h"

#include "core/fp8.h"
#include "gpu/fp8_code.cuh"
#include "gpu/pdl.cuh"
#include "gemm/fp8_wgmma.h"  // kMaxGroups
#include "gemm/silu.cuh"

namespace a2a::gemm::wgmma {

constexpr int kBM = 128;          // rows per tile (two math warpgroups x 64)
constexpr int kBN = 128;          // columns per tile (one weight-scale block)
constexpr int kBK = 128;          // k per stage (one scale block)
constexpr int kThreads = 384;     // producer warpgroup + two math warpgroups
constexpr int kStages = 6;
constexpr uint32_t kStageBytes = (kBM + kBN) * kBK;  // e4m3: one byte per element

// What the kernel reads besides the two TMA descriptors (x and w).
struct Fp8Args {
  const float* x_scale = nullptr;        // [rows, K/128]
  const float* w_scale = nullptr;        // [L, N/128, K/128]
  const int32_t* group_sizes = nullptr;  // [L], on the device
  void* y = nullptr;                     // [rows, N], bf16 or f32 (the kernel's OutT)
  int64_t rows = 0;                      // R (ragged) or L*C (expert_major)
  int32_t num_groups = 0;                // L, 1..kMaxGroups
  int32_t n = 0, k = 0;                  // multiples of 128
  int32_t per_group_rows = 0;            // expert_major: C; ragged: 0
  bool expert_major = false;
  // The swap-AB kernel: spread the tiles over the fewest clusters that take them in as many rounds
  // as all would (swap_takers); the rest only zero rows. Off: every cluster takes tiles.
  bool balance = true;
  // The swap-AB kernel: each tile's WGMMAs and promotion span its tokens rounded up to 8, not the
  // whole token tile (a group of 130 rows in a 160-row tile: N = 136). Off: always the token tile.
  bool trim = true;
  // The swap-AB kernel: before waiting for the stream's previous kernel (programmatic launch), each
  // CTA prefetches this many k-blocks of its first weight tile into L2; 0: none.
  int32_t prefetch_kblocks = 0;
  // Epi::kSwigluFp8 only (y unused): n = 2F (w rows 0..F-1 gate, F..2F-1 up), h e4m3 [rows, F],
  // h_scale f32 [rows, F/128].
  uint8_t* h = nullptr;
  float* h_scale = nullptr;
#ifdef A2A_GEMM_ABLATIONS
  // Measurements (benchmarks/gemm_probe.cu): the swap-AB kernel's math thread 128 writes each of its
  // CTA's tiles' global-timer start and end, trace[(blockIdx.x * trace_per_cta + i) * 2 + {0, 1}]
  // for its i-th tile (i < trace_per_cta).
  unsigned long long* trace = nullptr;
  int trace_per_cta = 0;
#endif
};

// What a tile's epilogue writes.
//   kStore      y [rows, N] (bf16 or f32) = the accumulators
//   kSwigluFp8  h = silu(gate) * up, quantised to e4m3 with one f32 scale per row and 128 columns
//               by the library's rule (core/fp8.h), gate and up rounded to bf16 first: the same
//               values as the gate+up GEMM writing bf16 gu followed by the SwiGLU kernel
//               (grouped_gemm.h, launch_swiglu). A tile covers 128 columns of h: its gate block
//               (w rows F/128-block j) in a first pass over k, then its up block (F + ...) in a
//               second, the gate held as bf16 meanwhile (x's tile is read twice).
enum class Epi : int { kStore = 0, kSwigluFp8 = 1 };

struct alignas(1024) SharedStorage {
  uint8_t a[kStages][kBM * kBK];  // 1024-byte aligned: the 128-byte swizzle repeats every 8 rows
  uint8_t b[kStages][kBN * kBK];
  uint64_t full[kStages];   // the stage's bytes landed (TMA transaction count)
  uint64_t empty[kStages];  // the stage's WGMMAs are done (one arrival per math warp)
  int64_t row_start[kMaxGroups];
  int32_t m_rows[kMaxGroups];
  int32_t tile_end[kMaxGroups];  // inclusive prefix of the groups' tile counts
};
constexpr size_t kSmemBytes = sizeof(SharedStorage) + 1024;  // + the base's alignment slack

// The kernel's shared storage at the first 1024-byte boundary of its dynamic shared memory (the
// 128-byte swizzle's atoms repeat every 1024 bytes; the launch asks for sizeof(Storage) + 1024).
// Aligned by pointer arithmetic on the shared array, not through an integer, so the compiler keeps
// knowing these are shared-memory addresses (LDS / STS, not generic loads: the swap-AB kernel's
// promotion read its scales with generic loads until 2026-12-05).
template <class Storage>
__device__ __forceinline__ Storage& aligned_storage(uint8_t* smem) {
  const uint32_t misalign = static_cast<uint32_t>(reinterpret_cast<uintptr_t>(smem)) & 1023u;
  return *reinterpret_cast<Storage*>(smem + ((1024u - misalign) & 1023u));
}

// A K-major WGMMA operand in shared memory with the 128-byte swizzle (8 rows x 128 bytes per core
// group: stride byte offset 1024, the leading offset unused and 1).
__device__ __forceinline__ uint64_t smem_desc(const void* p) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (1ull << 16) | (64ull << 32) | (1ull << 62);
}

using Mma = cute::SM90::GMMA::MMA_64x128x32_F32E4M3E4M3_SS_TN<>;

template <int... I>
__device__ __forceinline__ void mma_64x128x32(uint64_t da, uint64_t db, float (&d)[64], cute::SM90::GMMA::ScaleOut sc,
                                              std::integer_sequence<int, I...>) {
  Mma::fma(da, db, d[I]..., sc);
}

__device__ __forceinline__ void fence_acc(float (&d)[64]) {
#pragma unroll
  for (int i = 0; i < 64; ++i) cute::warpgroup_fence_operand(d[i]);
}

// The group table from group_sizes (warp 0 of the CTA; __syncthreads after): group l covers rows
// [row_start[l], row_start[l] + m_rows[l]); ragged: row_start = min(sum of the earlier groups'
// sizes clamped at 0, R), m = clamp(size, 0, R - row_start); expert_major: l*C, min(max(size, 0), C).
// tile_end[l]: the tiles of groups 0..l (ceil(m / kRows) x tiles_n each). Storage: any struct with
// row_start / m_rows / tile_end arrays of kMaxGroups (SharedStorage, the swap-AB kernel's).
template <int kRows = kBM, class Storage = SharedStorage>
__device__ __forceinline__ void build_group_table(const Fp8Args& a, int tiles_n, Storage& s) {
  const int lane = threadIdx.x & 31;
  int64_t carry_rows = 0;
  int32_t carry_tiles = 0;
  for (int base = 0; base < a.num_groups; base += 32) {
    const int l = base + lane;
    int64_t size = l < a.num_groups ? a.group_sizes[l] : 0;
    size = size < 0 ? 0 : size;
    if (a.expert_major && size > a.per_group_rows) size = a.per_group_rows;
    int64_t incl = size;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
      const int64_t v = __shfl_up_sync(0xffffffffu, incl, off);
      if (lane >= off) incl += v;
    }
    int64_t row0, m;
    if (a.expert_major) {
      row0 = static_cast<int64_t>(l) * a.per_group_rows;
      m = size;
    } else {
      const int64_t excl = carry_rows + incl - size;
      row0 = excl < a.rows ? excl : a.rows;
      m = carry_rows + incl < a.rows ? size : a.rows - row0;
    }
    carry_rows += __shfl_sync(0xffffffffu, incl, 31);
    int32_t tiles = static_cast<int32_t>((m + kRows - 1) / kRows) * tiles_n;
    int32_t tincl = tiles;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
      const int32_t v = __shfl_up_sync(0xffffffffu, tincl, off);
      if (lane >= off) tincl += v;
    }
    if (l < a.num_groups) {
      s.row_start[l] = row0;
      s.m_rows[l] = static_cast<int32_t>(m);
      s.tile_end[l] = carry_tiles + tincl;
    }
    carry_tiles += __shfl_sync(0xffffffffu, tincl, 31);
  }
}

struct Tile {
  int l, mt, nt;
};

// Tile t (< the last tile_end) -> its group (the first l with tile_end[l] > t), m-tile (kRows rows)
// and n-tile.
template <int kRows = kBM, class Storage = SharedStorage>
__device__ __forceinline__ Tile decode_tile(const Storage& s, int num_groups, int tiles_n, int t) {
  int lo = 0, hi = num_groups - 1;
  while (lo < hi) {
    const int mid = (lo + hi) >> 1;
    if (s.tile_end[mid] > t) hi = mid; else lo = mid + 1;
  }
  const int before = lo > 0 ? s.tile_end[lo - 1] : 0;
  const int local = t - before;
  const int mtiles = (s.m_rows[lo] + kRows - 1) / kRows;
  return Tile{lo, local % mtiles, local / mtiles};
}

__device__ __forceinline__ void promote(float (&acc)[64], const float (&d)[64], float s_lo, float s_hi) {
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    acc[4 * j + 0] = fmaf(d[4 * j + 0], s_lo, acc[4 * j + 0]);
    acc[4 * j + 1] = fmaf(d[4 * j + 1], s_lo, acc[4 * j + 1]);
    acc[4 * j + 2] = fmaf(d[4 * j + 2], s_hi, acc[4 * j + 2]);
    acc[4 * j + 3] = fmaf(d[4 * j + 3], s_hi, acc[4 * j + 3]);
  }
}

// Waits for phase `parity` of a CTA-local mbarrier, and traps (the launch fails, the caller sees an
// error) after ~2^35 cycles (~17 s at 2 GHz) without it: a stage that never fills is a bug, and the
// library's kernels never hang. The clock is read once per 1,024 polls.
__device__ __forceinline__ void wait_or_trap(uint64_t* bar, uint32_t parity) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(bar));
  long long start = 0;
  for (uint32_t polls = 0;; ++polls) {
    uint32_t done;
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(addr), "r"(parity)
        : "memory");
    if (done) return;
    if (polls == 0) {
      start = clock64();
    } else if ((polls & 1023u) == 0 && clock64() - start > (1ll << 35)) {
      __trap();
    }
  }
}

// One arrival on a CTA-local mbarrier by the threads with pred set, predicated rather than branched
// (a branch between a WGMMA's issue and its wait makes ptxas serialise the WGMMAs).
__device__ __forceinline__ void arrive_if(uint64_t* bar, bool pred) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(bar));
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %1, 0;\n @p mbarrier.arrive.shared::cta.b64 _, [%0];\n}\n" ::"r"(addr),
      "r"(static_cast<uint32_t>(pred))
      : "memory");
}

template <class OutT>
__device__ __forceinline__ void store_pair(OutT* p, float v0, float v1);
template <>
__device__ __forceinline__ void store_pair<__nv_bfloat16>(__nv_bfloat16* p, float v0, float v1) {
  *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(v0, v1);
}
template <>
__device__ __forceinline__ void store_pair<float>(float* p, float v0, float v1) {
  *reinterpret_cast<float2*>(p) = make_float2(v0, v1);
}

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// Epi::kSwigluFp8's epilogue: up in acc (f32), gate in bf16 pairs; rows r_lo and r_lo + 8 of the
// tile (those below tile_rows stored), columns 8j + c0 (+1) of h-block nt. A row's 128 columns
// are spread over the 4 lanes of a quad (lane >> 2 equal): its amax is a shuffle over them (every
// lane takes part, stored or not).
__device__ __forceinline__ void swiglu_fp8_store(const float (&up)[64], const uint32_t (&gate)[32], const Fp8Args& a,
                                                 int64_t row_base, int tile_rows, int nt, int r_lo, int c0, int f) {
  const int64_t nb = f / kBN;  // h_scale's columns
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float v[32];
    float amax = 0.f;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int q = 4 * j + 2 * h + e;
        const __nv_bfloat162 g2 = *reinterpret_cast<const __nv_bfloat162*>(&gate[q / 2]);
        const float g = e == 0 ? __low2float(g2) : __high2float(g2);
        const float u = __bfloat162float(__float2bfloat16_rn(up[q]));
        v[2 * j + e] = silu(g) * u;  // the SwiGLU kernel's arithmetic (gemm/silu.cuh)
        amax = fmaxf(amax, fp8_amax_term(v[2 * j + e]));
      }
    }
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
    const float sc = fp8_block_scale(amax, false);
    const float inv = __frcp_rn(sc);
    const int r = r_lo + 8 * h;
    if (r >= tile_rows) continue;
    const int64_t row = row_base + r;
    uint8_t* hrow = a.h + row * f + static_cast<int64_t>(nt) * kBN + c0;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const uint16_t two = static_cast<uint16_t>(gpu::fp8_quantize_value(v[2 * j], inv)) |
                           static_cast<uint16_t>(gpu::fp8_quantize_value(v[2 * j + 1], inv)) << 8;
      *reinterpret_cast<uint16_t*>(hrow + 8 * j) = two;
    }
    if (c0 == 0) a.h_scale[row * nb + nt] = sc;
  }
}

// The output rows no group covers get zeros (kSwigluFp8: h = 0 and the all-zero block's scale,
// fp8_block_scale(0)), written by the producer warpgroup's idle warps 2 and 3 of every CTA while the
// math runs: no zeroing kernel ahead of the GEMM (at decode it had nothing to zero and still cost a
// launch). worker / workers: this warp's index among all such warps of the grid. Ragged: rows
// [covered, R) with covered the group table's end (min(sum of the sizes, R)); expert_major: rows
// l*C + c with c >= m_rows[l]. A warp takes whole rows, 16-byte stores (a row is N * sizeof(OutT),
// or F, bytes: multiples of 128). After build_group_table (reads s).
template <class OutT, Epi kEpi, class Storage>
__device__ __forceinline__ void zero_rows_outside_groups(const Fp8Args& a, const Storage& s, int worker, int workers) {
  const int lane = threadIdx.x & 31;
  const int last = a.num_groups - 1;
  const int64_t first = a.expert_major ? 0 : s.row_start[last] + s.m_rows[last];
  constexpr bool kH = kEpi == Epi::kSwigluFp8;
  const int64_t row_vecs = (kH ? a.n / 2 : static_cast<int64_t>(a.n) * static_cast<int64_t>(sizeof(OutT))) / 16;
  uint4* base = static_cast<uint4*>(kH ? static_cast<void*>(a.h) : a.y);
  for (int64_t row = first + worker; row < a.rows; row += workers) {
    if (a.expert_major) {
      const int64_t l = row / a.per_group_rows;
      if (row - l * a.per_group_rows < s.m_rows[l]) continue;
    }
    uint4* dst = base + row * row_vecs;
    for (int64_t i = lane; i < row_vecs; i += 32) dst[i] = make_uint4(0u, 0u, 0u, 0u);
    if constexpr (kH) {
      const int nb = a.n / (2 * kBN);
      for (int i = lane; i < nb; i += 32) a.h_scale[row * nb + i] = fp8_block_scale(0.0f, false);
    }
  }
}

// kOverlap: the two-accumulator loop above; false: one temporary accumulator, each k-block's WGMMAs
// waited for before their promotion (CUTLASS's and DeepGEMM's order), kept to measure what the
// overlap buys in the same run (benchmarks/gemm_probe.cu).
template <class OutT, bool kOverlap = true, Epi kEpi = Epi::kStore>
__global__ void __launch_bounds__(kThreads, 1)
    fp8_grouped_kernel(const __grid_constant__ CUtensorMap tma_x, const __grid_constant__ CUtensorMap tma_w,
                       const Fp8Args a) {
#if defined(__CUDA_ARCH__)
#if __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ uint8_t smem_raw[];
  SharedStorage& s = aligned_storage<SharedStorage>(smem_raw);
  // Broadcast from lane 0 so the compiler knows them warp-uniform (a role branch it thinks divergent
  // makes ptxas serialise the WGMMAs).
  const int warp = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x) / 32, 0);
  const int wg = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x) / 128, 0);
  const int lane = threadIdx.x & 31;
  constexpr int kPasses = kEpi == Epi::kSwigluFp8 ? 2 : 1;  // B blocks per tile (gate, up)
  const int n_out = kEpi == Epi::kSwigluFp8 ? a.n / 2 : a.n;  // output columns (F, or N)
  const int tiles_n = n_out / kBN, kblocks = a.k / kBK;

  if (threadIdx.x == 32) {
    for (int i = 0; i < kStages; ++i) {
      cutlass::arch::ClusterTransactionBarrier::init(&s.full[i], 1);
      cutlass::arch::ClusterBarrier::init(&s.empty[i], 8);  // the 8 math warps
    }
    cutlass::arch::fence_barrier_init();
  }
  if (threadIdx.x == 64) {
    cute::prefetch_tma_descriptor(reinterpret_cast<const cute::TmaDescriptor*>(&tma_x));
    cute::prefetch_tma_descriptor(reinterpret_cast<const cute::TmaDescriptor*>(&tma_w));
  }
  // programmatic dependent launch (gpu/pdl.cuh): nothing global before this (group_sizes, x, y may
  // be the previous kernel's); one CTA per SM, so the next kernel's CTAs start only as ours leave
  gpu::wait_for_previous_grid();
  gpu::allow_next_grid();
  if (warp == 0) build_group_table(a, tiles_n, s);
  __syncthreads();
  const int total_tiles = s.tile_end[a.num_groups - 1];

  if (wg == 0) {  // producer
    cutlass::arch::warpgroup_reg_dealloc<40>();
    if (threadIdx.x == 0) {
      uint32_t it = 0;
      for (int t = blockIdx.x; t < total_tiles; t += gridDim.x) {
        const Tile tile = decode_tile(s, a.num_groups, tiles_n, t);
        const int32_t xrow = static_cast<int32_t>(s.row_start[tile.l] + static_cast<int64_t>(tile.mt) * kBM);
        for (int pass = 0; pass < kPasses; ++pass) {
          const int32_t wrow = tile.l * a.n + pass * n_out + tile.nt * kBN;  // pass 1: the up block
          for (int kb = 0; kb < kblocks; ++kb, ++it) {
            const int st = static_cast<int>(it % kStages);
            const uint32_t ph = (it / kStages) & 1;
            wait_or_trap(&s.empty[st], ph ^ 1);
            cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(&s.full[st], kStageBytes);
            cute::SM90_TMA_LOAD_2D::copy(&tma_x, &s.full[st],
                                         static_cast<uint64_t>(cute::TMA::CacheHintSm90::EVICT_LAST), s.a[st], kb * kBK, xrow);
            cute::SM90_TMA_LOAD_2D::copy(&tma_w, &s.full[st],
                                         static_cast<uint64_t>(cute::TMA::CacheHintSm90::EVICT_NORMAL), s.b[st], kb * kBK, wrow);
          }
        }
      }
    } else if (warp >= 2) {
      zero_rows_outside_groups<OutT, kEpi>(a, s, blockIdx.x * 2 + (warp - 2), gridDim.x * 2);
    }
    return;
  }

  // math warpgroups
  cutlass::arch::warpgroup_reg_alloc<232>();
  const int mwg = wg - 1;          // which 64 rows of the tile
  const int wl = warp & 3;         // warp within the warpgroup
  const int r_lo = mwg * 64 + wl * 16 + (lane >> 2);  // this thread's rows in the tile: r_lo, r_lo + 8
  const int c0 = (lane & 3) * 2;   // and columns c0 + 8j, +1
  auto* y = static_cast<OutT*>(a.y);
  constexpr auto kSeq = std::make_integer_sequence<int, 64>{};
  uint32_t it = 0;

  for (int t = blockIdx.x; t < total_tiles; t += gridDim.x) {
    const Tile tile = decode_tile(s, a.num_groups, tiles_n, t);
    const int tile_rows = min(kBM, s.m_rows[tile.l] - tile.mt * kBM);
    const int64_t row_base = s.row_start[tile.l] + static_cast<int64_t>(tile.mt) * kBM;

    if (tile_rows <= mwg * 64) {  // all of this warpgroup's rows are past the group: keep the ring going
      for (int kb = 0; kb < kPasses * kblocks; ++kb, ++it) {
        const int st = static_cast<int>(it % kStages);
        wait_or_trap(&s.full[st], (it / kStages) & 1);
        if (lane == 0) cutlass::arch::ClusterBarrier::arrive(&s.empty[st]);
      }
      continue;
    }

    // Scale rows (clamped into the tensor: rows past the group are computed but never stored).
    const int64_t last = a.rows - 1;
    const int64_t ra = row_base + r_lo < last ? row_base + r_lo : last;
    const int64_t rb = row_base + r_lo + 8 < last ? row_base + r_lo + 8 : last;
    const float* sxa = a.x_scale + ra * kblocks;
    const float* sxb = a.x_scale + rb * kblocks;
    // pass p's weight scales: block row (l, p * F/128 + nt) of w_scale [L, N/128, K/128]
    const float* sw0 = a.w_scale + (static_cast<int64_t>(tile.l) * (a.n / kBN) + tile.nt) * kblocks;

    float acc[64];

    auto issue = [&](float (&d)[64], uint32_t i) {
      const int st = static_cast<int>(i % kStages);
      wait_or_trap(&s.full[st], (i / kStages) & 1);
      // The lanes may leave the polling loop on different polls: reconverge before the
      // .sync.aligned WGMMA instructions (the producer's single thread never gets here).
      __syncwarp();
      const uint64_t da = smem_desc(s.a[st] + mwg * 64 * kBK), db = smem_desc(s.b[st]);
      fence_acc(d);
      cute::warpgroup_arrive();
#pragma unroll
      for (int j = 0; j < kBK / 32; ++j)  // 32 bytes of k per WGMMA: +2 in the descriptor's address field
        mma_64x128x32(da + 2 * j, db + 2 * j, d, j == 0 ? cute::SM90::GMMA::ScaleOut::Zero : cute::SM90::GMMA::ScaleOut::One, kSeq);
      cute::warpgroup_commit_batch();
      fence_acc(d);
    };
    auto release = [&](uint32_t i) { arrive_if(&s.empty[i % kStages], lane == 0); };

    // One pass over k into acc with the weight scales at sw (zeroed first); overlap: the
    // two-accumulator order (std::true_type) or the serial one (std::false_type).
    auto run_k = [&](auto overlap, const float* sw) {
      // The temporaries live in one pass only: declared outside, the WGMMAs' read-write operands
      // would keep them live across the tile loop (a held gate then spilled).
      float t0[64], t1[64];
#pragma unroll
      for (int q = 0; q < 64; ++q) acc[q] = 0.f;
      if constexpr (!decltype(overlap)::value) {
        for (int kb = 0; kb < kblocks; ++kb, ++it) {
          issue(t0, it);
          const float sc = __ldg(sw + kb);
          const float sa = __ldg(sxa + kb) * sc, sb = __ldg(sxb + kb) * sc;
          cute::warpgroup_wait<0>();
          fence_acc(t0);
          release(it);
          promote(acc, t0, sa, sb);
        }
      } else {
        // Scales (w, x row a, x row b) of the k-block each temporary holds, loaded when its WGMMAs
        // are issued (used one k-block later).
        float s0[3] = {__ldg(sw), __ldg(sxa), __ldg(sxb)}, s1[3] = {0.f, 0.f, 0.f};
        // One k-block kb (in cur, scales sc): issue kb + 1 into nxt (scales sn) unless kb is the
        // last, wait for kb, promote it. False after the last k-block, with nothing in flight.
        auto step = [&](float (&cur)[64], float (&nxt)[64], const float (&sc)[3], float (&sn)[3], int kb) {
          if (kb + 1 < kblocks) {
            issue(nxt, it + 1);
            sn[0] = __ldg(sw + kb + 1), sn[1] = __ldg(sxa + kb + 1), sn[2] = __ldg(sxb + kb + 1);
            cute::warpgroup_wait<1>();
          } else {
            cute::warpgroup_wait<0>();
          }
          fence_acc(cur);
          release(it);
          promote(acc, cur, sc[1] * sc[0], sc[2] * sc[0]);
          ++it;
          if (kb + 1 >= kblocks) {
            cute::warpgroup_wait<0>();  // a no-op (this path waited above); tells ptxas nothing is in flight
            return false;
          }
          return true;
        };
        issue(t0, it);
        // Unrolled by two so each temporary stays a fixed register array; explicit exits only.
        for (int kb = 0; step(t0, t1, s0, s1, kb) && step(t1, t0, s1, s0, kb + 1); kb += 2) {
        }
      }
    };

    run_k(std::bool_constant<kOverlap>{}, sw0);
    if constexpr (kEpi == Epi::kSwigluFp8) {
      uint32_t gate[32];  // the gate block, rounded to bf16 as the unfused path's gu is: pairs (4j + 2h, +1)
#pragma unroll
      for (int q = 0; q < 32; ++q) gate[q] = pack_bf16x2(acc[2 * q], acc[2 * q + 1]);
      // The up pass in the serial order: with the held gate, a second temporary accumulator spilled
      // inside the k loop. As it is, ptxas still spills ~110 bytes, at the hand-over between the
      // passes and in the epilogue (the division's slow-path call), none inside a k loop (SASS
      // read with cuobjdump: no LDL/STL between the QGMMAs).
      run_k(std::false_type{}, sw0 + static_cast<int64_t>(n_out / kBN) * kblocks);
      swiglu_fp8_store(acc, gate, a, row_base, tile_rows, tile.nt, r_lo, c0, n_out);
      continue;
    }

    // Epilogue: rows r_lo and r_lo + 8 of the tile, columns n0 + 8j + c0 (+1).
    const int n0 = tile.nt * kBN;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = r_lo + 8 * h;
      if (r >= tile_rows) continue;
      OutT* yrow = y + (row_base + r) * a.n + n0 + c0;
#pragma unroll
      for (int j = 0; j < 16; ++j) store_pair<OutT>(yrow + 8 * j, acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
    }
  }
#else
  __trap();  // compiled for a GPU without sm_90a's WGMMA and setmaxnreg: never return nothing silently
#endif
#endif
}

}  // namespace a2a::gemm::wgmma
