// nvshmem dispatch send: route and stage (the cuda backend's helpers), then put every routed
// pair's row into its private slot at the destination (put-with-signal, +1 on d_rows[me] there),
// then one meta block per destination (counts per local expert, our combine offset for it, token
// and weight per row) whose signal d_meta[me] = epoch + 1 tells the receiver how many rows to wait
// for. The dest_counts output [N] tells our combine_recv how many rows each expert rank owes us
// (the tp group's routed pairs per destination); it travels with dest and pair_slot in the
// placement, so a combine on another slot reads it too. Elastic EP: masked ranks get no meta
// block and no row (the communicator already stopped every pair to them, so they count 0) and
// their FREE is not awaited; a live rank's is awaited for the last dispatch it took part in
// (FreeDue, gpu/mask.cuh, as the cuda backend's).
#include "gpu/arrange.cuh"
#include "gpu/failure.cuh"
#include "gpu/grid.cuh"
#include "gpu/kernel.cuh"
#include "gpu/route.cuh"
#include "gpu/warp.cuh"
#include "nvshmem/device.cuh"
#include "nvshmem/kernels.h"

namespace a2a::nvshmem {
namespace {

__global__ void __launch_bounds__(gpu::kThreads) dispatch_send_kernel(gpu::DispatchSendParams P, NvSlot nv) {
  A2A_KERNEL_START(P);
  gpu::cg::grid_group grid = gpu::cg::this_grid();
  const int member = me % g.tp;
  const int n = max(0, min(*P.num_tokens, g.T));
  const gpu::SendScratch s = gpu::send_scratch(g, P.p.priv);
  int32_t* stage_meta = reinterpret_cast<int32_t*>(P.p.priv + nv.lay.off_meta_stage);  // [N dest][meta_stride / 4]
  const int64_t words = nv.lay.meta_stride / 4;
  const int32_t* cnt = s.cnt + int64_t(member) * g.E;  // [E] rows of our member per expert
  const uint64_t out = masked_ranks(g, P.p);  // elastic EP: ranks we neither wait for nor write to
  if (gpu::slot_failed(g, P.p)) {  // an earlier op of this slot failed: the host raises it
    gpu::abandon_dispatch_send(P, ix);
    return;
  }

  // Phase 1 (grid): route pairs, per (member, expert) order and counts, stage our member's tokens;
  // block 0 waits until every receiver has read our previous rows and meta (phase 2 overwrites them).
  gpu::route_pairs(P, s, n, ix, &ep->dropped);
  gpu::scan_experts(P, s, n, ix);
  gpu::stage_tokens(P, n, member, ix);
  // (due(r): the epoch without a mask; owe_free rewrites it in the last block, after the grid sync below)
  const gpu::FreeDue due = gpu::free_due(g, P.p, Half::kDispatchSend, epoch);
  if (blockIdx.x == 0)
    wait_signals(P.p, g, Half::kDispatchSend, [&](int r) { return &signals_at(P.p, me)->d_free[r]; },
                 [&](int r) { return left_out(out, r) ? 0 : due(r); });
  grid.sync();
  if (gpu::slot_failed(g, P.p)) {
    gpu::abandon_dispatch_send(P, ix);
    return;
  }
  // Phase 2 (grid): drop count, slots, meta staging, every routed pair's row.
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    *P.dropped = ep->dropped;
    ep->dropped = 0;
  }
  gpu::write_pair_slots(P, s, ix);
  // The rows each expert rank d owes our combine_recv (the dest_counts output): the whole tp
  // group's routed pairs to d (every member gets every row back), the sum of cnt over the group's
  // members and d's local experts, which is the number of pairs with dest == d (route_pairs and
  // scan_experts apply the same validity, dedup and t < n). A warp per destination, dealt from the
  // grid's last warps (the puts below fill every block's first warps). Null only under the EP = 1
  // dispatch's fallback to the exchange kernels, whose combine (gpu/local) reads no counts.
  if (P.dest_counts) {
    for (int64_t d = ix.nwarps - 1 - gpu::warp_across_blocks(); d < g.N; d += ix.nwarps) {
      int rows = 0;
      for (int i = ix.lane; i < g.tp * g.L; i += 32) rows += s.cnt[int64_t(i / g.L) * g.E + d * g.L + i % g.L];
      rows = gpu::warp_sum(rows);
      if (ix.lane == 0) P.dest_counts[d] = rows;
    }
  }
  for (int64_t i = ix.gtid; i < int64_t(g.N) * g.L; i += ix.gstride)
    stage_meta[(i / g.L) * words + i % g.L] = cnt[i];
  for (int d = ix.gtid; d < g.N; d += ix.gstride) stage_meta[d * words + g.L] = s.c_off[int64_t(member) * g.N + d];
  const int64_t body = g.payload + 4 * int64_t(g.S);  // payload then fp8 scales
  // Warp per pair of our member, dealt across blocks first (gpu::warp_across_blocks): at decode
  // (1,024 pairs, 132 x 16 warps) every SM puts about 8 rows instead of 64 SMs putting 16 each
  // while the other 68 idle; each put is a warp copy plus a system fence and a signal.
  for (int64_t q = gpu::warp_across_blocks(); q < int64_t(g.T) * g.K; q += ix.nwarps) {
    const int e = s.pair_expert[q];
    const int t = q / g.K;
    if (e < 0 || t % g.tp != member) continue;
    const int d = e / g.L;
    if (left_out(out, d)) continue;  // never routed (its id was rewritten to E); no put into a dead process
    const int64_t j = gpu::pair_slot(g, s, q, t, e);  // pair_slot out is written by other warps now
    if (ix.lane == 0) {
      int32_t* m = stage_meta + d * words + meta_head_words(g) + 2 * j;
      m[0] = t;
      m[1] = __float_as_int(P.weights[q]);
    }
    const uint8_t* staged = P.p.priv + g.off_staging + int64_t(t) * g.row;  // staged before the grid sync
    prefetch_source_l1(staged, body, ix.lane);
    put_row_signal(P.p.peer_shared[d] + nv.lay.off_rows + (int64_t(me) * g.P + j) * g.row, staged, body,
                   &signals_at(P.p, d)->d_rows[me], nv.pe[d]);
  }
  // The last block to finish: one meta block per destination (warp per destination), epoch, handle.
  if (!gpu::last_block_done(ep->done_of(Half::kDispatchSend))) return;
  const int warp = threadIdx.x >> 5;
  for (int d = warp; d < g.N; d += blockDim.x >> 5) {
    if (left_out(out, d)) continue;  // elastic EP: it does not wait for our meta (every d when we are masked)
    int rows = 0;
    for (int l = ix.lane; l < g.L; l += 32) rows += cnt[int64_t(d) * g.L + l];
    rows = gpu::warp_sum(rows);
    const int64_t meta_bytes = 4 * (meta_head_words(g) + 2 * int64_t(rows));
    prefetch_source_l1(stage_meta + d * words, meta_bytes, ix.lane);  // written by every block before last_block_done
    nvshmemx_putmem_signal_nbi_warp(meta_at(P.p, nv.lay, d, me), stage_meta + d * words, static_cast<size_t>(meta_bytes),
                                    &signals_at(P.p, d)->d_meta[me], epoch + 1, NVSHMEM_SIGNAL_SET, nv.pe[d]);
  }
  gpu::owe_free(g, P.p, Half::kDispatchSend, due, out);  // every live rank frees this epoch for us
  if (threadIdx.x == 0) {
    ep->d_send = epoch + 1;
    P.handle[0] = static_cast<int32_t>(epoch);
    P.handle[1] = P.p.slot;
  }
}

}  // namespace

cudaError_t launch_dispatch_send(const gpu::DispatchSendParams& p, const NvSlot& nv, int blocks, cudaStream_t stream) {
  return gpu::launch_cooperative(dispatch_send_kernel, blocks, 0, stream, p, nv);
}

}  // namespace a2a::nvshmem
