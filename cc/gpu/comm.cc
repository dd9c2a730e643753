#include "gpu/comm.h"

#include <cuda_runtime_api.h>

#include "core/align.h"

namespace a2a::gpu {

Geometry make_geometry(const MoeShape& s) {
  Geometry g{};
  static_cast<MoeShape&>(g) = s;
  g.c_stride_max = g.c_row;  // combine rows in the combine dtype (y is cast to it when wider)
  g.off_counts = pad16(sizeof(SyncFlags));
  g.off_rows = g.off_counts + pad16(int64_t(g.N) * counts_stride(g) * 4);
  g.off_c_rows = g.off_rows + int64_t(g.N) * g.P * g.row;
  g.shared_slot_bytes = pad16(g.off_c_rows + int64_t(g.tp) * g.Q * g.c_stride_max);
  g.off_staging = 0;
  g.off_scratch = int64_t(g.T) * g.row;
  g.off_epochs = g.off_scratch + pad16(scratch_bytes(g));
  // Epochs, then owed [2][N] uint64: the FREE values ranks that sat out the slot's last dispatch /
  // combine owe us (elastic EP, gpu/mask.cuh owed_free)
  g.private_slot_bytes = pad16(g.off_epochs + sizeof(Epochs) + 2 * 8 * int64_t(g.N));
  return g;
}

GpuOptions gpu_options(const Config& c) {
  GpuOptions o;
  static_cast<TransportOptions&>(o) = transport_options(c);
  o.g = make_geometry(shape_of(c));
  return o;
}

int64_t scratch_bytes(const Geometry& g) {  // dispatch_send's routing tables (gpu/route.cuh)
  return 4 * (2 * int64_t(g.T) * g.K + 2 * int64_t(g.tp) * g.E + int64_t(g.tp) * g.N);
}

int grid_blocks(int device) {
  int sms = 0;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || sms <= 0) sms = 1;
  // One block of kThreads per SM is always co-resident (the kernels use little shared memory).
  return sms;
}

std::string describe_error(const ErrorRecord& e, double timeout_s, const char* backend) {
  if (e.code == 0) return "";
  std::string missing;
  for (int r = 0; r < 64; ++r)
    if (e.missing >> r & 1) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
  const std::string what = e.code == kErrorCounterAhead
                               ? "the row counters of ranks [" + missing + "] ran ahead of the rows we consumed from them "
                                 "(ranks passing different rank masks?)"
                           : missing.empty()
                               // only the proxy knows who is missing, and it raised nothing in time
                               ? "the inter-node proxy raised no flag within " + std::to_string(timeout_s * 1.5 + 2) +
                                     " s (its thread stalled, or remote ranks are missing)"
                               : "ranks [" + missing + "] did not arrive within " + std::to_string(timeout_s) + " s";
  return "jax_moe_a2a " + std::string(backend) + " " + half_name(e.op) + " (slot " + std::to_string(e.slot) +
         ", rank " + std::to_string(e.rank) + "): " + what +
         "; that step's outputs are NaN / empty and this communicator is unusable (create a new one)";
}

}  // namespace a2a::gpu
