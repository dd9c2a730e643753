// Row packing for the host backend. A wire row is [payload H x wire dtype][S f32 scales (fp8)]
// [token int32][router weight f32], padded to 16 bytes (MoeShape::row_bytes).
#pragma once

#include <cstdint>
#include <vector>

#include "core/floats.h"

namespace a2a::host {

struct HostOptions;

// Converts one rank's tokens to wire rows (quantising to fp8 once per token when needed).
class RowPacker {
 public:
  // x [T, H] in x_kind; x_scale [T, S] when x is already fp8 (x_kind == kF8E4M3), else null.
  // cache and filled are the caller's reusable buffers (sized here on first use), so that a
  // dispatch allocates nothing once warm.
  RowPacker(const HostOptions& o, const void* x, ElemKind x_kind, const float* x_scale,
            std::vector<uint8_t>& cache, std::vector<uint8_t>& filled);
  // Writes token t's row with router weight w to dst (row_bytes bytes).
  void pack(int t, float w, uint8_t* dst);

 private:
  const HostOptions& o_;
  const void* x_;
  ElemKind x_kind_;
  const float* x_scale_;
  int64_t payload_, scales_;
  std::vector<uint8_t>& cache_;   // [T][payload + scales], filled on first use
  std::vector<uint8_t>& filled_;  // [T]
  std::vector<float> scale_tmp_;  // [S] one token's fp8 scales
};

// Copies wire rows into Dispatched outputs: x [R, H] wire dtype, scale [R, S] (or null).
class RowUnpacker {
 public:
  RowUnpacker(const HostOptions& o, void* x, float* scale);
  // Copies `row` to output position pos; returns the router weight, sets *tok.
  float unpack(const uint8_t* row, int64_t pos, int32_t* tok);

 private:
  int64_t payload_, scales_;
  uint8_t* x_;
  float* scale_;
};

// acc[h] += w * row[h] for a row of H values in kind.
void accumulate_row(float* acc, const uint8_t* row, ElemKind kind, int H, float w);
// acc[h] += in[off + h] (in's element kind), h < H.
void add_row(float* acc, const void* in, int64_t off, ElemKind kind, int H);
// out[off + h] = acc[h] rounded to out's element kind, h < H.
void store_row(void* out, int64_t off, ElemKind kind, const float* acc, int H);

}  // namespace a2a::host
