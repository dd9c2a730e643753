// Zeroing the output rows no group writes, for CUTLASS's grouped GEMMs (the setup kernel's blocks
// 1..). Our own fp8 kernels zero theirs from inside (fp8_wgmma.cuh, zero_rows_outside_groups).
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "gemm/grouped_gemm.h"
#include "gemm/kernels.h"  // output_rows
#include "gpu/warp.cuh"

namespace a2a::gemm::detail {

// Ragged: how many rows the groups cover, min(sum of the sizes clamped at 0, R), the sum over the
// groups in parallel (one thread's serial loop over them cost ~20 us at prefill). Block-collective
// (every thread calls it, every thread gets it); 0 for expert_major.
__device__ inline int64_t ragged_covered_rows(const GroupedGemmParams& p) {
  if (p.layout != Layout::kRagged) return 0;
  __shared__ unsigned long long sum;
  if (threadIdx.x == 0) sum = 0;
  __syncthreads();
  unsigned long long t = 0;
  for (int64_t l = threadIdx.x; l < p.num_groups; l += blockDim.x)
    t += p.group_sizes[l] > 0 ? static_cast<unsigned long long>(p.group_sizes[l]) : 0ull;
  t = gpu::warp_sum(t);
  if ((threadIdx.x & 31) == 0 && t != 0) atomicAdd(&sum, t);
  __syncthreads();
  return sum < static_cast<unsigned long long>(p.rows) ? static_cast<int64_t>(sum) : p.rows;
}

// Whether forward output row `row` belongs to a group: ragged, row < covered (ragged_covered_rows);
// expert_major, row (l, c) with c < counts[l] (a count past C covers all C rows).
__device__ inline bool row_covered(const GroupedGemmParams& p, int64_t row, int64_t covered) {
  if (p.layout == Layout::kRagged) return row < covered;
  return row % p.rows < static_cast<int64_t>(p.group_sizes[row / p.rows]);
}

// Blocks of a zeroing grid over `rows` output rows: two per SM at most (most have nothing to do).
inline unsigned zeroing_blocks(int64_t rows, int sm_count) {
  const int64_t most = 2 * static_cast<int64_t>(sm_count > 0 ? sm_count : 132);
  return static_cast<unsigned>(rows < most ? rows : most);
}

// Output rows no group writes get zeros (blocks 1.. of the prepare grid, 16-byte stores: n *
// sizeof(ElemD) is a multiple of 16, checked by unsupported_reason). Forward: ragged rows >=
// min(sum(group_sizes), R); expert_major rows (l, c) with c >= min(counts[l], C). Wgrad: all of
// dW[l] [n, k] for the groups with no rows (the GEMM gets no tiles there).
template <class ElemD>
__device__ void zero_uncovered_rows(const GroupedGemmParams& p, int64_t first_block, int64_t blocks) {
  if (p.mode == Mode::kWgrad) {
    // Group l has no rows (prepare_groups' m_l == 0) iff group_sizes[l] <= 0 or l >= first_full:
    // ragged, the first group whose earlier groups' sizes (clamped at 0) already reach R (their sum
    // only grows with l, so later groups start at R too); expert_major, L, or 0 when C == 0.
    __shared__ int64_t first_full;
    if (threadIdx.x == 0) {
      int64_t l = 0;
      if (p.layout == Layout::kRagged) {
        for (int64_t before = 0; l < p.num_groups && before < p.rows; ++l)
          before += p.group_sizes[l] > 0 ? p.group_sizes[l] : 0;
      } else {
        l = p.rows > 0 ? p.num_groups : 0;
      }
      first_full = l;
    }
    __syncthreads();
    const int64_t vec_per_row = p.k * static_cast<int64_t>(sizeof(ElemD)) / 16;
    for (int64_t row = first_block; row < p.num_groups * p.n; row += blocks) {
      const int64_t l = row / p.n;
      const bool empty = p.group_sizes[l] <= 0 || l >= first_full;
      if (!empty) continue;
      uint4* dst = reinterpret_cast<uint4*>(static_cast<char*>(p.y) + row * p.k * sizeof(ElemD));
      for (int64_t i = threadIdx.x; i < vec_per_row; i += blockDim.x) dst[i] = make_uint4(0, 0, 0, 0);
    }
    return;
  }
  // Ragged: the rows below the covered count are the GEMM's; only the rows past it are visited.
  const int64_t covered = ragged_covered_rows(p);
  const int64_t first_row = (p.layout == Layout::kRagged ? covered : 0) + first_block;
  const int64_t vec_per_row = p.n * static_cast<int64_t>(sizeof(ElemD)) / 16;
  for (int64_t row = first_row; row < output_rows(p); row += blocks) {
    if (row_covered(p, row, covered)) continue;  // expert_major's rows below a group's count
    uint4* dst = reinterpret_cast<uint4*>(static_cast<char*>(p.y) + row * p.n * sizeof(ElemD));
    for (int64_t i = threadIdx.x; i < vec_per_row; i += blockDim.x) dst[i] = make_uint4(0, 0, 0, 0);
  }
}

}  // namespace a2a::gemm::detail
