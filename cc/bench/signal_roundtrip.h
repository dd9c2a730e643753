// Benchmark of the kernel <-> proxy signalling path (cc/bench/signal_roundtrip.cu), for
// benchmarks/proxy.py through jax_moe_a2a_bench. Not part of the library.
#pragma once

#include <vector>

namespace a2a::bench {

// `iters` GPU -> host -> GPU flag round trips through mapped pinned memory on `device`; returns
// each one's nanoseconds as the GPU's %globaltimer saw them.
std::vector<double> signal_roundtrip(int device, int iters);

}  // namespace a2a::bench
