// The decode expert MLP in one persistent kernel: the swap-AB kernel's gate+up tiles with the
// SwiGLU epilogue (h e4m3 and its 1x128 scales) and its down tiles over h, in one launch.
//
// Why (notes/open_items.md 13): at L = 8 experts the MLP ran as two kernels (gate+up with SwiGLU,
// then down) of one or a few rounds each, and each paid its own fixed costs: a first round 4-5 us
// longer than the others (the pipeline filled from HBM by every CTA at once), CTAs ending over 5-7 us
// with equal work, ~3-4 us of launch and prologue. One kernel pays them once, and a CTA that ends
// its gate+up tiles early goes on to down tiles instead of idling until the slowest CTA ends.
//
// Phases and order: tile t of T_A + T_B, t < T_A a gate+up tile (group l, token tile, 128 columns of
// h: fp8_wgmma_swap.cuh's Epi::kSwigluFp8 tile), else down tile t - T_A (group l, token tile, 128
// columns of y). CTA b takes tiles b, b + grid, ... (its gate+up tiles first: those never wait).
// A down tile of group l reads h rows of l written by other CTAs: it waits until all of l's
// gate+up tiles have signalled (ready[l] = token tiles of l x F / 128). The TMA thread issues the
// down tile's first weight loads before it waits (the weights are constant), warp 1 waits before
// the h scales. A gate+up tile signals after its h and scales are stored: every math thread fences
// (generic and async proxies, gpu scope), the math warps meet, one thread adds 1 with release.
// The waiter acquires, then fences the async proxy before its TMA reads h.
//
// Every CTA must be resident at once (a down tile may wait for a gate+up tile of any CTA): the grid
// is at most one CTA per SM, as the swap-AB kernel's. A wait that never ends traps after ~17 s
// (the launch fails; never a hang).
//
// sync: int32 [1 + L] in global memory, zero before the first launch: [0] counts the CTAs that
// finished, [1 + l] is ready[l]. The last CTA to finish sets them back to zero, so the next launch
// (stream-ordered: programmatic launch waits for this grid before its first global access) finds
// them zero. Two launches sharing one sync buffer must not run at the same time.
//
// Shapes (ragged or expert_major as fp8_wgmma.cuh): x [rows, H] e4m3, x_scale f32 [rows, H/128], w1
// [L, 2F, H] e4m3 (gate rows 0..F-1, up F..2F-1), w1_scale f32 [L, 2F/128, H/128], h [rows, F] e4m3
// and h_scale f32 [rows, F/128] (scratch, written and read here), w2 [L, H, F] e4m3, w2_scale f32
// [L, H/128, F/128], y [rows, H] bf16. Rows of y no group covers get zeros; rows of h outside the
// groups are not written.
#pragma once

#include <cstdint>

#include "gemm/fp8_wgmma_swap.cuh"

namespace a2a::gemm::wgmma {

// Waits until the int at `flag` reaches `target` (ld.acquire at gpu scope); traps after ~2^35 cycles.
__device__ __forceinline__ void wait_count_or_trap(const int* flag, int target) {
  long long start = 0;
  for (uint32_t polls = 0;; ++polls) {
    int v;
    asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(flag) : "memory");
    if (v >= target) return;
#ifdef A2A_MLP_POLL_SLEEP_NS
    __nanosleep(A2A_MLP_POLL_SLEEP_NS);
#endif
    if (polls == 0) {
      start = clock64();
    } else if ((polls & 255u) == 0 && clock64() - start > (1ll << 35)) {
      __trap();
    }
  }
}

// Generic-proxy writes ordered with later async-proxy (TMA) accesses, at gpu scope.
__device__ __forceinline__ void fence_proxy_async_global() { asm volatile("fence.proxy.async.global;" ::: "memory"); }

__device__ __forceinline__ void add_release(int* flag, int v) {
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;" ::"l"(flag), "r"(v) : "memory");
}

// Tile t of a phase with tiles_n n-tiles per token tile, over a group table built with tiles_n = 1
// (tile_end[l]: the token tiles of groups 0..l): its group, token tile and n-tile.
template <int kTok, class Storage>
__device__ __forceinline__ Tile decode_phase_tile(const Storage& s, int num_groups, int tiles_n, int t) {
  int lo = 0, hi = num_groups - 1;
  while (lo < hi) {
    const int mid = (lo + hi) >> 1;
    if (s.tile_end[mid] * tiles_n > t) hi = mid; else lo = mid + 1;
  }
  const int local = t - (lo > 0 ? s.tile_end[lo - 1] * tiles_n : 0);
  const int mtiles = (s.m_rows[lo] + kTok - 1) / kTok;
  return Tile{lo, local % mtiles, local / mtiles};
}

// a1: the gate+up GEMM (x, w1, h, h_scale; n = 2F, k = H); a2: the down GEMM (x_scale = h_scale, w2,
// y; n = H, k = F). tma_x / tma_h: kTok-row boxes; tma_w1 / tma_w2: 128-row boxes.
// early: how many of a down tile's first weight k-blocks are loaded before it waits for h.
template <int kTok>
__global__ void __launch_bounds__(kThreads, 1)
    fp8_swap_mlp_kernel(const __grid_constant__ CUtensorMap tma_x, const __grid_constant__ CUtensorMap tma_w1,
                        const __grid_constant__ CUtensorMap tma_h, const __grid_constant__ CUtensorMap tma_w2, const Fp8Args a1,
                        const Fp8Args a2, int* sync) {
#if defined(__CUDA_ARCH__)
#if __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Storage = SwapStorage<kTok>;
  extern __shared__ uint8_t smem_raw[];
  Storage& s = aligned_storage<Storage>(smem_raw);
  const int warp = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x) / 32, 0);
  const int wg = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x) / 128, 0);
  const int lane = threadIdx.x & 31;
  const int f = a1.n / 2;
  const int tiles_na = f / kBN, tiles_nb = a2.n / kBN;
  const int kb1 = a1.k / kBK, kb2 = a2.k / kBK;
  int* const ready = sync + 1;

  if (threadIdx.x == 32) swap_init_barriers(s, 1);
  if (threadIdx.x == 64) {
    cute::prefetch_tma_descriptor(reinterpret_cast<const cute::TmaDescriptor*>(&tma_x));
    cute::prefetch_tma_descriptor(reinterpret_cast<const cute::TmaDescriptor*>(&tma_w1));
    cute::prefetch_tma_descriptor(reinterpret_cast<const cute::TmaDescriptor*>(&tma_h));
    cute::prefetch_tma_descriptor(reinterpret_cast<const cute::TmaDescriptor*>(&tma_w2));
  }
  // As the swap-AB kernel: this CTA's first gate weight k-blocks into L2 before the previous
  // kernel is done, through a provisional table (rebuilt after the wait).
  if (a1.prefetch_kblocks > 0 && warp == 0) {
    build_group_table<kTok>(a1, 1, s);
    __syncwarp();
    const int tiles_a = s.tile_end[a1.num_groups - 1] * tiles_na;
    if (lane == 0 && static_cast<int>(blockIdx.x) < tiles_a)
      prefetch_weight_kblocks(tma_w1, swap_weight_row(a1, decode_phase_tile<kTok>(s, a1.num_groups, tiles_na, blockIdx.x), 0, f),
                              min(kb1, a1.prefetch_kblocks));
    __syncwarp();
  }
  gpu::wait_for_previous_grid();  // nothing global but the prefetch above before this
  gpu::allow_next_grid();
  if (warp == 0) build_group_table<kTok>(a1, 1, s);
  __syncthreads();
  const int tiles_a = s.tile_end[a1.num_groups - 1] * tiles_na;
  const int tiles_all = tiles_a + s.tile_end[a1.num_groups - 1] * tiles_nb;
  auto tile_a = [&](int t) { return decode_phase_tile<kTok>(s, a1.num_groups, tiles_na, t); };
  auto tile_b = [&](int t) { return decode_phase_tile<kTok>(s, a1.num_groups, tiles_nb, t - tiles_a); };
  // ready[l] once every gate+up tile of group l has stored its h
  auto wait_h = [&](int l) {
    wait_count_or_trap(ready + l, (s.m_rows[l] + kTok - 1) / kTok * tiles_na);
    fence_proxy_async_global();
  };

  if (wg == 0) {  // producers
    cutlass::arch::warpgroup_reg_dealloc<40>();
    uint32_t it = 0;
    if (warp == 0 && lane == 0) {  // TMA
      constexpr int kEarly = SwapStorage<kTok>::kStages;
      for (int t = blockIdx.x; t < tiles_all; t += gridDim.x) {
        const int tn = t + static_cast<int>(gridDim.x);  // the next tile, prefetched into when of the same GEMM
        if (t < tiles_a) {
          const Tile next = tile_a(tn < tiles_a ? tn : t);
          swap_load_tile<kTok, 1>(tma_x, tma_w1, a1, s, tile_a(t), tn < tiles_a ? &next : nullptr, 2, f, kb1, 0, 0, it, [] {});
        } else {
          const Tile tile = tile_b(t), next = tile_b(tn < tiles_all ? tn : t);
          swap_load_tile<kTok, 1>(tma_h, tma_w2, a2, s, tile, tn < tiles_all ? &next : nullptr, 1, a2.n, kb2, 0, kEarly, it,
                                  [&] { wait_h(tile.l); });
        }
      }
    } else if (warp == 1) {  // scales (the down tiles': h_scale, once h is complete)
      for (int t = blockIdx.x; t < tiles_all; t += gridDim.x) {
        if (t < tiles_a) {
          swap_load_scales<kTok>(a1, s, tile_a(t), 2, f, kb1, it);
        } else {
          const Tile tile = tile_b(t);
          wait_h(tile.l);
          swap_load_scales<kTok>(a2, s, tile, 1, a2.n, kb2, it);
        }
      }
      asm volatile("cp.async.wait_all;" ::: "memory");
    } else if (warp >= 2) {
      zero_rows_outside_groups<__nv_bfloat16, Epi::kStore>(a2, s, blockIdx.x * 2 + (warp - 2), gridDim.x * 2);
    }
    __syncwarp();
  } else {  // math warpgroups
    cutlass::arch::warpgroup_reg_alloc<232>();
    uint32_t it = 0;
    for (int t = blockIdx.x, traced = 0; t < tiles_all; t += gridDim.x, ++traced) {
      trace_stamp(a1, traced, 0);
      if (t < tiles_a) {
        const Tile tile = tile_a(t);
        swap_math_tile<__nv_bfloat16, kTok, 1, Ablate::kFull, Epi::kSwigluFp8>(a1, s, tile, kb1, 0, wg - 1, it);
        // h and its scales of this tile visible (to TMA too) before ready[l] counts it
        fence_proxy_async_global();
        __threadfence();
        math_warpgroups_sync();
        if (threadIdx.x == 128) add_release(ready + tile.l, 1);
      } else {
        swap_math_tile<__nv_bfloat16, kTok, 1, Ablate::kFull, Epi::kStore>(a2, s, tile_b(t), kb2, 0, wg - 1, it);
      }
      trace_stamp(a1, traced, 1);
    }
  }
  // Every role of this CTA is done with `sync`; the last CTA sets it back to zero for the next launch.
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    if (atomicAdd(sync, 1) == static_cast<int>(gridDim.x) - 1) {
      for (int l = 0; l < a1.num_groups; ++l) ready[l] = 0;
      sync[0] = 0;
      __threadfence();
    }
  }
#else
  __trap();
#endif
#endif
}

}  // namespace a2a::gemm::wgmma
