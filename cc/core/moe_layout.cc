#include "core/moe_layout.h"

#include <algorithm>

namespace a2a {

SendPlan plan_sends(const MoeShape& s, int rank, const int32_t* ids, int num_tokens) {
  const int N = s.N, L = s.L, K = s.K, T = s.T, tp = s.tp;
  const int my_member = rank % tp;
  SendPlan p;
  p.dest.assign(int64_t(T) * K, N);
  p.slot.assign(int64_t(T) * K, 0);
  p.comb_slot.assign(int64_t(T) * K, 0);
  p.counts.assign(int64_t(N) * L, 0);
  p.rows_to.assign(N, 0);
  p.order.assign(N, {});
  // Per member and destination, the pairs sorted by (local expert, token): bucket by expert.
  // next[(member * N + d) * L + l] counts pairs seen so far; slots are assigned after counting.
  std::vector<int32_t> cnt(int64_t(tp) * N * L, 0);
  const int n = std::max(0, std::min(num_tokens, T));
  for (int t = 0; t < n; ++t) {
    const int member = t % tp;
    for (int k = 0; k < K; ++k) {
      const int32_t id = ids[int64_t(t) * K + k];
      bool routed = id >= 0 && id < s.E;
      for (int j = 0; routed && j < k; ++j) routed = ids[int64_t(t) * K + j] != id;
      if (!routed) {
        if (id != -1 && member == my_member) ++p.dropped;
        continue;
      }
      const int d = id / L, l = id % L;
      p.dest[int64_t(t) * K + k] = d;
      ++cnt[(int64_t(member) * N + d) * L + l];
    }
  }
  // Exclusive prefix over local experts within (member, dest) gives each expert's first slot.
  std::vector<int32_t> next(cnt.size(), 0);
  for (int m = 0; m < tp; ++m)
    for (int d = 0; d < N; ++d) {
      int32_t run = 0;
      for (int l = 0; l < L; ++l) {
        const int64_t i = (int64_t(m) * N + d) * L + l;
        next[i] = run;
        run += cnt[i];
      }
      if (m == my_member) {
        p.rows_to[d] = run;
        p.order[d].resize(run);
        for (int l = 0; l < L; ++l) p.counts[int64_t(d) * L + l] = cnt[(int64_t(m) * N + d) * L + l];
      }
    }
  // Combine offsets of every member of the group: off[m * N + d] = rows m sends to ranks below d
  // (combine_offset over m's count matrix, which is cnt[m]).
  std::vector<int32_t> off(int64_t(tp) * N, 0);
  for (int m = 0; m < tp; ++m)
    for (int d = 0; d < N; ++d)
      off[int64_t(m) * N + d] = static_cast<int32_t>(combine_offset(&cnt[int64_t(m) * N * L], L, d));
  for (int t = 0; t < n; ++t) {  // tokens in order: slots within an expert follow token order
    const int member = t % tp;
    for (int k = 0; k < K; ++k) {
      const int64_t pk = int64_t(t) * K + k;
      const int d = p.dest[pk];
      if (d == N) continue;
      const int l = ids[pk] % L;
      const int32_t sl = next[(int64_t(member) * N + d) * L + l]++;
      p.slot[pk] = sl;
      p.comb_slot[pk] = off[int64_t(member) * N + d] + sl;
      if (member == my_member) p.order[d][sl] = {t, k};
    }
  }
  return p;
}

int64_t combine_offset(const int32_t* counts, int L, int dest) {
  int64_t n = 0;
  for (int64_t i = 0; i < int64_t(dest) * L; ++i) n += counts[i];
  return n;
}

RecvArrangement::RecvArrangement(const MoeShape& s, const int32_t* counts)
    : s_(s), L_(s.local_experts()) {
  const int N = s.N, L = L_;
  expert_offset_.assign(L, 0);
  before_src_.assign(int64_t(N) * L, 0);
  src_start_.assign(int64_t(N) * L, 0);
  rows_from_.assign(N, 0);
  group_sizes_.assign(L, 0);
  std::vector<int64_t> total(L, 0);
  for (int src = 0; src < N; ++src) {
    int32_t run = 0;
    for (int l = 0; l < L; ++l) {
      const int32_t c = counts[int64_t(src) * L + l];
      src_start_[int64_t(src) * L + l] = run;
      run += c;
      before_src_[int64_t(src) * L + l] = total[l];
      total[l] += c;
    }
    rows_from_[src] = run;
  }
  int64_t off = 0;
  for (int l = 0; l < L; ++l) {
    expert_offset_[l] = off;
    if (s.ragged()) {
      const int64_t lo = std::min<int64_t>(off, s.capacity), hi = std::min<int64_t>(off + total[l], s.capacity);
      group_sizes_[l] = static_cast<int32_t>(hi - lo);
    } else {
      group_sizes_[l] = static_cast<int32_t>(std::min<int64_t>(total[l], s.capacity));
    }
    overflow_ += total[l] - group_sizes_[l];
    off += total[l];
  }
}

int64_t RecvArrangement::position(int src, int l, int i) const {
  const int64_t j = before_src_[int64_t(src) * L_ + l] + i;  // index within expert l
  if (s_.ragged()) {
    const int64_t pos = expert_offset_[l] + j;
    return pos < s_.capacity ? pos : -1;
  }
  return j < s_.capacity ? int64_t(l) * s_.capacity + j : -1;
}

}  // namespace a2a
