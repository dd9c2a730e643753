// Forwards to gpu/ptx.cuh for cc/cuda/signal_bench.cu only, which another change moves out of _C
// (issue 14, item 4); delete this file with that move. New code includes "gpu/ptx.cuh".
#pragma once

#include "gpu/ptx.cuh"
