// dispatch send, grid-routed (tp > 1, or K / E past the block-routed kernels' limits): route,
// quantise/convert, push rows and counts into every peer's buffer, raise each peer's arrival flag.
// Two plain kernels, one per phase of gpu/route.cuh, each spread over the whole grid: the kernel
// boundary is the grid-wide barrier between them. It was one cooperative kernel with a grid.sync,
// which has no timeout and needs every block co-resident: under MPS another client's resident
// kernels can leave part of the grid unscheduled (open item 5), and a block that read the failure
// mark differently from the others would have left the rest waiting forever. The last block of
// the second kernel raises the flags.
#include <cstdlib>
#include <string>

#include "cuda/device.cuh"
#include "cuda/kernels.h"
#include "cuda/remote.cuh"
#include "gpu/arrange.cuh"
#include "gpu/block_route.cuh"
#include "gpu/copy.cuh"
#include "gpu/failure.cuh"
#include "gpu/grid.cuh"
#include "gpu/kernel.cuh"
#include "gpu/route.cuh"
#include "core/env.h"

namespace a2a::cuda {
using namespace ::a2a::gpu;  // the shared device library (cc/gpu)
namespace {

// Phase 1: validity and dedup of every pair, per (member, expert) order, counts and first slots,
// our member's tokens into staging. Block 0 also waits until peers finished reading our previous
// rows (phase 2 overwrites them) and, with remote peers, until d_send is ours again (a timeout
// there marks the slot failed, which phase 2 reads). Nothing here touches peers' memory or d_send.
__global__ void __launch_bounds__(kThreads) dispatch_route_kernel(DispatchSendParams P) {
  A2A_KERNEL_START(P);
  const int member = me % g.tp;
  const int n = max(0, min(*P.num_tokens, g.T));
  SendScratch s = send_scratch(g, P.p.priv);
  const uint64_t out = masked_ranks(g, P.p);  // elastic EP: ranks we neither wait for nor write to
  const FreeDue due = free_due(g, P.p, Half::kDispatchSend, epoch);  // ... and the FREE flag the others owe us
  if (slot_failed(g, P.p)) return;  // an earlier op of this slot failed: phase 2 abandons the call
  route_pairs(P, s, n, ix, &ep->dropped);
  scan_experts(P, s, n, ix);
  stage_tokens(P, n, member, ix);
  if (blockIdx.x == 0)
    remote::wait_peers_due(P.p, g, Half::kDispatchSend, [&](int r) { return &flags_of(P.p, me)->d_free[r]; }, due,
                           &P.p.remote.ctrl->d_send_ok, epoch + 1, true, out);
}

// Phase 2 (after phase 1's kernel, on the same stream): drop count and count matrix out, slots
// out, rows and counts into every peer; the last block raises the flags.
__global__ void __launch_bounds__(kThreads) dispatch_pack_kernel(DispatchSendParams P) {
  A2A_KERNEL_START(P);
  const int lane = ix.lane, member = me % g.tp;
  const int n = max(0, min(*P.num_tokens, g.T));
  SendScratch s = send_scratch(g, P.p.priv);
  const uint64_t out = masked_ranks(g, P.p);
  const FreeDue due = free_due(g, P.p, Half::kDispatchSend, epoch);
  if (slot_failed(g, P.p)) {  // an earlier op of this slot failed, or phase 1's wait timed out
    if (blockIdx.x == 0 && threadIdx.x == 0) ep->dropped = 0;  // phase 1 may have counted drops
    abandon_dispatch_send(P, ix);
    return;
  }
  if (blockIdx.x == 0) {
    if (threadIdx.x == 0) {
      *P.dropped = ep->dropped;
      ep->dropped = 0;
    }
    if (remote::any(P.p)) remote::publish_counts(P.p, g, s.cnt + int64_t(member) * g.E, epoch);
  }
  write_pair_slots(P, s, ix);
  // Every routed pair of our member: (pair, segment) items of 16-byte copies; segment 0 also
  // writes the token and weight after the body.
  const int64_t body = g.payload + 4 * int64_t(g.S);  // payload then fp8 scales
  const int64_t body16 = body / 16 * 16;
  const int64_t pairs = int64_t(g.T) * g.K;
  const int64_t seg = row_segment_bytes(body16, int64_t(n) * g.K / g.tp, ix.nwarps);
  const int64_t nseg = body16 > 0 ? (body16 + seg - 1) / seg : 1;
  for (int64_t w = ix.gwarp; w < pairs * nseg; w += ix.nwarps) {
    const int64_t q = w / nseg;
    const int e = s.pair_expert[q];
    const int t = static_cast<int>(q / g.K);
    if (e < 0 || t % g.tp != member) continue;
    const int d = e / g.L;
    const int64_t j = pair_slot(g, s, q, t, e);
    uint8_t* dst = remote::is_remote(P.p, d) ? remote::send_row(P.p, g, d, j)
                                             : P.p.peer_shared[d] + g.off_rows + (int64_t(me) * g.P + j) * g.row;
    const uint8_t* src = P.p.priv + g.off_staging + int64_t(t) * g.row;
    const int64_t lo = (w % nseg) * seg;
    if (lo < body16) warp_copy(dst + lo, src + lo, min(seg, body16 - lo), lane);
    if (lo != 0) continue;
    write_row_tail(dst, src, body, body16, t, P.weights[q], lane);
  }
  // Our counts record into every node-local peer: counts[me][l] = rows we send it for local expert
  // l, counts[me][L] = rows we send ranks below it (where its rows start in our combine region).
  const int cs = counts_stride(g);
  for (int64_t i = ix.gtid; i < int64_t(g.N) * cs; i += ix.gstride) {
    const int d = i / cs, l = i % cs;
    if (remote::is_remote(P.p, d) || left_out(out, d)) continue;  // remote: the proxy sends our count matrix
    int32_t* c = reinterpret_cast<int32_t*>(P.p.peer_shared[d] + g.off_counts) + int64_t(me) * cs + l;
    *c = l < g.L ? s.cnt[int64_t(member) * g.E + d * g.L + l] : s.c_off[int64_t(member) * g.N + d];
  }
  if (remote::any(P.p)) __threadfence_system();  // our rows in d_send, before the proxy's flag
  if (last_block_done(ep->done_of(Half::kDispatchSend))) {
    owe_free(g, P.p, Half::kDispatchSend, due, out);
    remote::close_send(P.p, g, &P.p.remote.ctrl->d_packed, [&](int r) { return &flags_of(P.p, r)->d_arrived[me]; },
                       &ep->d_send, epoch, P.handle, out);
  }
}

}  // namespace

static const std::string& dispatch_send_mode() {
  static const std::string mode = [] {
    const char* v = env::get("JAX_MOE_A2A_DISPATCH_SEND");
    return std::string(v ? v : "auto");
  }();
  return mode;
}

bool use_block_routing(const Geometry& g, const SlotPtrs& p) {
  return dispatch_send_mode() != "grid" && g.tp == 1 && g.K <= kBlockRouteMaxK &&
         block_routing_smem_bytes(g) <= kBlockRoutingSmem;
}

cudaError_t launch_dispatch_send(const DispatchSendParams& p, int blocks, cudaStream_t stream) {
  if (use_block_routing(p.g, p.p)) {
    const ChunkKind kind = dispatch_send_mode() == "block" ? ChunkKind{} : regs_staging_kind(p);
    if (kind.ok()) return launch_dispatch_send_regs(p, kind, blocks, stream);
    return launch_dispatch_send_block(p, blocks, stream);
  }
  const cudaError_t e = launch_plain(dispatch_route_kernel, blocks, 0, stream, p);
  return e != cudaSuccess ? e : launch_plain(dispatch_pack_kernel, blocks, 0, stream, p);
}

void dispatch_send_kernels(const Geometry& g, std::vector<KernelRef>* out) {
  out->push_back({"dispatch_send (grid-routed: route)", reinterpret_cast<const void*>(&dispatch_route_kernel), 0,
                  kThreads, false});
  out->push_back({"dispatch_send (grid-routed: pack)", reinterpret_cast<const void*>(&dispatch_pack_kernel), 0,
                  kThreads, false});
  dispatch_send_block_kernels(g, out);
  dispatch_send_regs_kernels(g, out);
}

}  // namespace a2a::cuda
