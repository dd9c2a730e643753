// The receive arrangement, computed by every block in its own shared memory, shared by the GPU
// backends' dispatch_recv and combine_send kernels (cuda, nvshmem).
//
// A receiver's rows are laid out canonically: by local expert, then source rank, then the
// source's token order (each source sends its rows for one destination sorted by local expert),
// with the capacity rule (ragged: canonical position >= capacity is dropped; expert_major: index
// within the expert >= capacity). All of it follows from counts [N src][L] int32 (rows per source
// and local expert: E values), so each block derives it in a few microseconds from a kilobyte or
// two in shared memory and no block waits for another (the profile of the serial version on one
// H200: 73-78% of the warp samples of dispatch_recv and combine_send sat at the grid barrier
// while one thread built this table).
#pragma once

#include "gpu/params.h"

namespace a2a::gpu {

// Views of the shared-memory tables (int32) of one block's arrangement.
struct BlockArrangement {
  const int32_t* counts;      // [N*L] rows per (source, local expert)
  const int32_t* src_start;   // [N*L] first row slot of local expert l among source s's rows
  const int32_t* before;      // [N*L] rows of local expert l from sources < s
  const int32_t* expert_off;  // [L] canonical position of expert l's first row (ragged)
  const int32_t* kept;        // [L] rows of expert l kept by the capacity rule (its group size)
  const int32_t* row_base;    // [N + 1] compact index of source s's first row; [N]: rows in all
  int32_t overflow;           // rows dropped by the capacity rule
};

// Shared-memory bytes of one block's arrangement for N ranks and L local experts.
__host__ __device__ inline int64_t arrangement_smem_bytes(int N, int L) {
  return 4 * (3 * int64_t(N) * L + 3 * int64_t(L) + int64_t(N) + 1 + 1);
}

// In-place exclusive prefix sum of a[0 .. n) by the calling warp (each lane scans a contiguous
// chunk, then the chunk totals are scanned with shuffles); returns the total to every lane.
__device__ inline int32_t warp_exclusive_scan(int32_t* a, int n, int lane) {
  const int per = (n + 31) / 32;
  const int lo = min(n, lane * per), hi = min(n, lo + per);
  int32_t sum = 0;
  for (int i = lo; i < hi; ++i) sum += a[i];
  int32_t inc = sum;
  for (int off = 1; off < 32; off <<= 1) {
    const int32_t v = __shfl_up_sync(0xffffffffu, inc, off);
    if (lane >= off) inc += v;
  }
  const int32_t total = __shfl_sync(0xffffffffu, inc, 31);
  int32_t run = inc - sum;
  for (int i = lo; i < hi; ++i) {
    const int32_t c = a[i];
    a[i] = run;
    run += c;
  }
  return total;
}

// Every thread of the block: builds the arrangement in `smem` (arrangement_smem_bytes(N, L)
// bytes, 4-byte aligned) from count(s, l) = rows source s sends us for local expert l, and
// returns its views. Four block barriers; nothing outside the block is touched.
template <typename CountFn>
__device__ BlockArrangement block_arrange(const Geometry& g, CountFn count, int32_t* smem) {
  const int N = g.N, L = g.L;
  const int nl = N * L;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  int32_t* cnt = smem;             // [N*L]
  int32_t* src_start = cnt + nl;   // [N*L]
  int32_t* before = src_start + nl;  // [N*L]
  int32_t* eoff = before + nl;     // [L] expert totals, then their exclusive prefix
  int32_t* kept = eoff + L;        // [L]
  int32_t* tot = kept + L;         // [L]
  int32_t* row_base = tot + L;     // [N + 1]
  int32_t* over = row_base + N + 1;  // [1]
  for (int i = threadIdx.x; i < nl; i += blockDim.x) {
    const int32_t c = count(i / L, i % L);
    cnt[i] = c;
    src_start[i] = c;
  }
  if (threadIdx.x == 0) *over = 0;
  __syncthreads();
  for (int s = warp; s < N; s += nwarps) {  // per source: first slot of each local expert
    const int32_t rows = warp_exclusive_scan(src_start + int64_t(s) * L, L, lane);
    if (lane == 0) row_base[s] = rows;
  }
  for (int l = threadIdx.x; l < L; l += blockDim.x) {  // per expert: rows from lower sources
    int32_t run = 0;
    for (int s = 0; s < N; ++s) {
      before[s * L + l] = run;
      run += cnt[s * L + l];
    }
    tot[l] = run;
    eoff[l] = run;
  }
  __syncthreads();
  if (warp == 0) warp_exclusive_scan(eoff, L, lane);
  if (warp == (nwarps > 1 ? 1 : 0)) {
    const int32_t total = warp_exclusive_scan(row_base, N, lane);
    if (lane == 0) row_base[N] = total;
  }
  __syncthreads();
  for (int l = threadIdx.x; l < L; l += blockDim.x) {
    int32_t k;
    if (g.ragged()) {
      const int32_t lo = min(eoff[l], g.capacity), hi = min(eoff[l] + tot[l], g.capacity);
      k = hi - lo;
    } else {
      k = min(tot[l], g.capacity);
    }
    kept[l] = k;
    if (tot[l] > k) atomicAdd(over, tot[l] - k);  // an integer sum: the same in any order
  }
  __syncthreads();
  BlockArrangement a;
  a.counts = cnt;
  a.src_start = src_start;
  a.before = before;
  a.expert_off = eoff;
  a.kept = kept;
  a.row_base = row_base;
  a.overflow = *over;
  return a;
}

// Where the w-th received row (compact index over sources in order, w < row_base[N]) comes from
// and goes: source s, its slot j there, local expert l, output position pos (-1: dropped by the
// capacity rule). Binary searches over shared memory only.
struct RowLoc {
  int s, l;
  int32_t j;
  int64_t pos;
};

__device__ __forceinline__ RowLoc locate_row(const Geometry& g, const BlockArrangement& a, int32_t w) {
  RowLoc r;
  int lo = 0, hi = g.N - 1;
  while (lo < hi) {  // last source whose first row is <= w (empty sources share their base)
    const int mid = (lo + hi + 1) / 2;
    if (a.row_base[mid] <= w) lo = mid; else hi = mid - 1;
  }
  r.s = lo;
  r.j = w - a.row_base[lo];
  const int32_t* st = a.src_start + int64_t(r.s) * g.L;
  lo = 0;
  hi = g.L - 1;
  while (lo < hi) {  // last local expert whose first slot is <= j
    const int mid = (lo + hi + 1) / 2;
    if (st[mid] <= r.j) lo = mid; else hi = mid - 1;
  }
  r.l = lo;
  const int64_t within = a.before[int64_t(r.s) * g.L + lo] + (r.j - st[lo]);
  if (g.ragged()) {
    const int64_t pos = a.expert_off[lo] + within;
    r.pos = pos < g.capacity ? pos : -1;
  } else {
    r.pos = within < g.capacity ? int64_t(lo) * g.capacity + within : -1;
  }
  return r;
}

// Is output row `pos` written by some received row (else it keeps weight 0, src -1)?
__device__ __forceinline__ bool output_row_used(const Geometry& g, const BlockArrangement& a, int64_t pos) {
  if (g.ragged()) return pos < min(int64_t(a.row_base[g.N]), int64_t(g.capacity));
  return pos % g.capacity < a.kept[pos / g.capacity];
}

// Rows split into segments so that a decode batch spreads over the grid's warps: segments of at
// least 512 bytes (16-byte multiples), as many per row as make rows * segments about the number
// of warps. Returns the segment size in bytes (>= bytes when the row stays whole).
__device__ __forceinline__ int64_t row_segment_bytes(int64_t bytes, int64_t rows, int nwarps) {
  if (rows <= 0) return bytes;
  int64_t segs = nwarps / rows;
  const int64_t max_segs = (bytes + 511) / 512;
  segs = segs < 1 ? 1 : (segs > max_segs ? max_segs : segs);
  return ((bytes + segs - 1) / segs + 15) / 16 * 16;
}

}  // namespace a2a::gpu
