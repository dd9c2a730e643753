// ChunkKind: how a dispatch launch holds a token's row in registers (gpu/token_chunks.cuh), chosen
// on the host and passed to the launchers and through the FFI handlers. Plain C++.
#pragma once

#include "core/dtype.h"

namespace a2a::gpu {

// How a launch holds a token's row in registers: quantised (QuantChunks of x's float kind),
// copied (CopyChunks: x already in the wire dtype), or neither fits (no register path). Plain
// data, chosen on the host (regs_chunk_kind) and passed to the launchers.
struct ChunkKind {
  enum class How : int { kNone, kQuantize, kCopy };
  How how = How::kNone;
  ElemKind x_kind = ElemKind::kF32;  // kQuantize: the float kind of x
  bool grid_routed = false;          // the EP = 1 local dispatch only: its grid-routed kernel (gpu/local/local.h)
  A2A_HD bool ok() const { return how != How::kNone; }
};

}  // namespace a2a::gpu
