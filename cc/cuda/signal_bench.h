// Benchmark of the kernel <-> proxy signalling path (cc/cuda/signal_bench.cu).
#pragma once

#include <vector>

namespace a2a::cuda {

// `iters` GPU -> host -> GPU flag round trips through mapped pinned memory on `device`; returns
// each one's nanoseconds as the GPU's %globaltimer saw them.
std::vector<double> signal_roundtrip(int device, int iters);

}  // namespace a2a::cuda
