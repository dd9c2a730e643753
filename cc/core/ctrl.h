// The flag block between a rank's packer/unpacker (GPU kernels, or the host backend's C++ in its
// proxied mode) and its proxy thread (cc/proxy/proxy.h). In core, the one layer both sides stand
// on: the GPU library (cc/gpu) needs nothing else of the proxy. It lives in memory both sides address:
// cudaHostAlloc(mapped) pinned memory on GPUs, plain memory on CPUs. Plain data, no CUDA types, so
// it is included by .cu and .cc files alike. Under GDRCopy (proxy/gdrcopy.h) a second Ctrl in GPU
// memory receives the proxy-written fields too (FlagPath in proxy/proxy.h), and the kernels read
// those there; the kernel-written fields always live here.
//
// Every flag holds epoch + 1 of the last event and only grows. The side that writes data first
// and then a flag stores the flag with release semantics (GPU: __threadfence_system + st.release.sys;
// CPU: __atomic_store_n RELEASE); the reader loads it with acquire (GPU: ld.acquire.sys; CPU:
// __atomic_load_n ACQUIRE) before reading the data.
//
// One dispatch on slot z, epoch e:
//   kernel: wait d_send_ok > e (proxy: FREE_D(e-1) from remote ranks arrived and our writes are
//           done); write our [N, L] count matrix at d_send offset 0, raise d_counts = e + 1; pack
//           rows for remote destinations into d_send [dest][P][row], raising d_packed_to[d] = e + 1
//           as each destination d's rows are complete (optional: the host backend's packer does,
//           the GPU kernels do not), then d_packed = e + 1 (every destination).
//   proxy:  COUNTS to every rank on d_counts; PRIV to d on d_packed_to[d] (under
//           JAX_MOE_A2A_PROXY_PIPELINE=peer) or on d_packed; OVER (and the snapshot of
//           the combine offsets) once every count matrix is in; over_base[], c_off[] and
//           d_landed = e + 1 once PRIV and OVER arrived from every remote rank. For a packer that
//           asks (proxy::ProxyOptions::source_flags, under peer) also d_placed once over_base and
//           c_off are valid and d_landed_from[src] as each source's rows are in, before d_landed.
//   kernel: wait d_landed > e (or d_placed, then d_landed_from[src] per source); read remote rows
//           from d_recv; raise d_consumed = e + 1.
//   proxy:  FREE_D(e) to remote ranks on d_consumed.
// One combine on slot z, epoch c: kernel waits c_send_ok > c, writes rows into c_send
// [src][P][stride], rows_from[], c_stride and c_from_slot, raises c_packed; the proxy writes them back (COMB,
// each source's run at its combine offset in the compact [tp][Q] region: protocol/exchange.h)
// and raises c_landed once every remote rank's rows arrived (with source_flags, c_landed_from[d]
// as each one's did); the kernel reduces and raises c_consumed; the proxy signals FREE_C(c).
// A kernel that waits on the proxy first raises waiting[op] = epoch + 1: the proxy's timeout for
// that step runs from then (a step is not late while nobody waits for it).
#pragma once

#include <cstdint>

namespace a2a::ctrl {

constexpr int kMaxRanks = 64;
constexpr int kMaxSlots = 8;

struct alignas(64) SlotCtrl {
  // ---- written by the kernel, read by the proxy ----
  uint64_t d_counts;    // e + 1: our count matrix [N][L] int32 is at d_send offset 0
  uint64_t d_packed;    // e + 1: rows for remote destinations are in d_send
  uint64_t d_consumed;  // e + 1: the remote rows of epoch e were read
  uint64_t c_packed;    // c + 1: combine rows in c_send, rows_from, c_stride and c_from_slot set
  uint64_t c_consumed;  // c + 1: the remote combine rows of epoch c were read
  uint64_t waiting[4];  // per op (protocol::Op): epoch + 1 the kernel waits on the proxy for
  int64_t c_stride;     // bytes per combine row (H * itemsize(y))
  int32_t rows_from[kMaxRanks];  // rows we received from each source in the matching dispatch
  int32_t c_from_slot;  // the slot of that dispatch (a combine may run on another slot than it)
  // e + 1: the rows for destination d are in d_send (optional, per peer as the packer goes: the
  // host backend's packer raises them; a packer that raises only d_packed, as the GPU kernels do,
  // gets its peers' writes after the whole pack). d_packed implies every one of them.
  uint64_t d_packed_to[kMaxRanks];
  // ---- written by the proxy, read by the kernel ----
  alignas(64) uint64_t d_send_ok;  // e + 1: epoch e may overwrite d_send (and remote regions)
  uint64_t d_landed;               // e + 1: every remote row of epoch e landed; over_base, c_off valid
  uint64_t c_send_ok;              // c + 1
  uint64_t c_landed;               // c + 1
  int64_t over_base[kMaxRanks];    // first row of each remote source's overflow in our region
  int32_t c_off[kMaxRanks];        // each source's combine offset for us (Exchange::combine_offsets,
                                   // the snapshot of this dispatch); valid with d_landed like over_base
  // Per source, for a receiver that unpacks what has landed while the rest is in flight (the host
  // backend's, which asks for them: proxy::ProxyOptions::source_flags; JAX_MOE_A2A_PROXY_PIPELINE=peer):
  // d_placed = e + 1 once over_base and c_off are valid (every count matrix in), then
  // d_landed_from[src] = e + 1 once src's PRIV and OVER rows landed (with row staging: once
  // copied). In the Ctrl block only, never in the GDRCopy mirror.
  uint64_t d_placed;
  uint64_t d_landed_from[kMaxRanks];
  // c + 1 once remote rank d's COMB rows (for every member of our tp group) landed, before c_landed.
  uint64_t c_landed_from[kMaxRanks];
};

// Written once by the proxy when it fails (then it stops): code 1 timeout (missing ranks set),
// 2 transport error. Kernels and the host read `code` while they wait.
struct ProxyError {
  int32_t code;
  int32_t op;      // protocol::Op
  int32_t slot;
  int32_t rank;
  uint64_t missing;  // bit r: rank r did not arrive (r < 64)
  char text[1000];   // the full message, NUL-terminated
};

struct Ctrl {
  SlotCtrl slot[kMaxSlots];
  ProxyError error;
};

// ---- host side of the flags (the proxy, and the host backend's proxied mode) -------------------
inline uint64_t load_acquire(const uint64_t* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
inline void store_release(uint64_t* p, uint64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
inline int32_t error_code(const Ctrl* c) { return __atomic_load_n(&c->error.code, __ATOMIC_ACQUIRE); }

}  // namespace a2a::ctrl
