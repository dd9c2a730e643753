// The GPU backends' communicator options from the flat arguments Python passes (cuda, nvshmem).
#pragma once

#include "cuda/comm.h"

namespace a2a::python {

inline cuda::CudaOptions gpu_options(int N, int E, int K, int H, int T, int tp, int S, int scale_block, int wire_kind,
                                     int layout, int capacity, bool pow2, int slots, double timeout_s) {
  cuda::CudaOptions o;
  o.g.N = N;
  o.g.E = E;
  o.g.K = K;
  o.g.H = H;
  o.g.T = T;
  o.g.tp = tp;
  o.g.S = S;
  o.g.scale_block = scale_block;
  o.g.wire_kind = wire_kind;
  o.g.layout = layout;
  o.g.capacity = capacity;
  o.g.pow2 = pow2;
  o.slots = slots;
  o.timeout_s = timeout_s;
  return o;
}

}  // namespace a2a::python
