// A token's wire row held in registers by one block (kThreads threads), for the kernels that
// write a token to several places straight from registers: the cuda backend's decode
// dispatch_send (cuda/dispatch/send_regs.cu) and both EP = 1 dispatch kernels (gpu/local/).
//   - QuantChunks<XK, kC>: fp8 quantisation of x of float kind XK (f32, bf16, f16): a chunk is 16
//     values -> 16 fp8 bytes, the scale block's lanes (scale_block / 16 of them, a power of two)
//     share one f32 scale;
//   - CopyChunks<kC>: a copy when x is already in the wire dtype (pre-quantised fp8 brings its
//     scales).
// Chunk c of the payload is thread c % blockDim's, i = c / blockDim of its kC registers.
// Each has load(P, t) (issue the loads of token t), convert(P) and store(P, payload, scales).
// Which one applies to a launch: regs_chunk_kind and with_chunk_kind below.
#pragma once

#include <cuda_fp8.h>

#include <cstdint>

#include "core/fp8.h"
#include "gpu/chunk_kind.h"
#include "gpu/copy.cuh"
#include "gpu/dequant.cuh"
#include "gpu/elems.cuh"
#include "gpu/fp8_code.cuh"
#include "gpu/grid.cuh"
#include "gpu/params.h"
#include "gpu/route.cuh"

namespace a2a::gpu {

__device__ __forceinline__ int chunk_of(int i) { return threadIdx.x + i * blockDim.x; }

// fp8 quantisation of x of float kind XK (f32, bf16, f16) in registers. Chunk c holds values
// [16c, 16c + 16) of the token, scale block c / lpb (lpb = scale_block / 16 lanes, a power of two
// <= 32, so a scale block's lanes are aligned within a warp). The same arithmetic as stage_rows'
// vector path (gpu/route.cuh): amax over the block's finite values, fp8_block_scale, x * (1 / scale)
// rounded to e4m3 with saturation, NaN and Inf to 0x7F (gpu/fp8_code.cuh).
template <ElemKind XK, int kC = 2>
struct QuantChunks {
  static constexpr int kChunks = kC;  // payload <= kC * 16 * blockDim bytes
  static constexpr bool kQuantizes = true;  // holds each chunk's scale: can write dequantised rows
  int4 raw[kChunks][2][2];           // [chunk][half of 16 values][load_raw8's vectors]
  uint4 q[kChunks];
  float scale[kChunks];
  int32_t soff[kChunks];  // byte offset of chunk i's scale when its thread writes it (first lane of its block), else -1

  __device__ void load(const DispatchSendParams& P, int t) {
    const uint8_t* x = static_cast<const uint8_t*>(P.x) + int64_t(t) * P.g.H * elem_bytes(XK);
#pragma unroll
    for (int i = 0; i < kChunks; ++i) {
      const int64_t h = int64_t(chunk_of(i)) * 16;
      if (h < P.g.H) {
        load_raw8_ro<XK>(x, h, raw[i][0]);
        load_raw8_ro<XK>(x, h + 8, raw[i][1]);
      } else {
        raw[i][0][0] = raw[i][0][1] = raw[i][1][0] = raw[i][1][1] = make_int4(0, 0, 0, 0);
      }
    }
  }
  __device__ void convert(const DispatchSendParams& P) {
    const int lpb = P.g.scale_block / 16;
#pragma unroll
    for (int i = 0; i < kChunks; ++i) {  // every lane runs every step: the shuffles need the warp
      float v[16];
      raw8_to_f32<XK>(raw[i][0], v);
      raw8_to_f32<XK>(raw[i][1], v + 8);
      float amax = 0.f;  // chunks past the end hold zeros
#pragma unroll
      for (int j = 0; j < 16; ++j) amax = fmaxf(amax, fp8_amax_term(v[j]));  // NaN, Inf: 0
      amax = group_max(amax, lpb, threadIdx.x & 31);  // lpb a power of two: xor shuffles
      const float sc = fp8_block_scale(amax, P.g.pow2 != 0);
      const float inv = __frcp_rn(sc);
      uint32_t w[4] = {0u, 0u, 0u, 0u};
#pragma unroll
      for (int j = 0; j < 16; ++j)
        w[j / 4] |= uint32_t(fp8_quantize_value(v[j], inv)) << (8 * (j % 4));
      q[i] = make_uint4(w[0], w[1], w[2], w[3]);
      scale[i] = sc;
      // once per token, not once per stored row: the division by the run-time lpb (a power of
      // two) was a fifth of the EP = 1 dispatch's instructions (2026-12-03 profile)
      const int c = chunk_of(i), shift = __ffs(lpb) - 1;
      soff[i] = int64_t(c) * 16 < P.g.H && (c & (lpb - 1)) == 0 ? 4 * (c >> shift) : -1;
    }
  }
  // After convert: chunk i's 16 values dequantised (gpu/dequant.cuh) into out_kind (f32: four
  // 16-byte vectors; bf16/f16: the first two), converted once and stored at each of the
  // token's rows (gpu/local/outputs.cuh).
  __device__ void dequantize(int i, ElemKind out_kind, int4 out[4]) const {
    float v[16];
    dequant16(make_int4(int(q[i].x), int(q[i].y), int(q[i].z), int(q[i].w)), scale[i], v);
    store_vec8(&out[0], 0, out_kind, v);  // f32: out[0..2); 16-bit: out[0]
    store_vec8(&out[out_kind == ElemKind::kF32 ? 2 : 1], 0, out_kind, v + 8);
  }
  // The payload's chunks at `payload` (16-byte aligned), the scales (f32) at `scales`.
  __device__ void store(const DispatchSendParams& P, uint8_t* payload, uint8_t* scales) const {
#pragma unroll
    for (int i = 0; i < kChunks; ++i) {
      const int c = chunk_of(i);
      if (int64_t(c) * 16 >= P.g.H) continue;
      *reinterpret_cast<uint4*>(payload + int64_t(c) * 16) = q[i];
      if (soff[i] >= 0) store_f32(scales + soff[i], scale[i]);
    }
  }
};

// x already in the wire dtype: its payload bytes in 16-byte chunks, and (pre-quantised fp8) the
// S scales from x_scale, scale b in thread b.
template <int kC = 4>
struct CopyChunks {
  static constexpr int kChunks = kC;  // payload <= kC * 16 * blockDim bytes
  static constexpr bool kQuantizes = false;  // a chunk's scale is another thread's: no dequantised rows
  int4 v[kChunks];
  float scale;

  __device__ void load(const DispatchSendParams& P, int t) {
    const int4* x = reinterpret_cast<const int4*>(static_cast<const uint8_t*>(P.x) + int64_t(t) * P.g.payload);
#pragma unroll
    for (int i = 0; i < kChunks; ++i)
      if (int64_t(chunk_of(i)) * 16 < P.g.payload) v[i] = __ldg(x + chunk_of(i));
    if (P.g.wire_is_fp8() && threadIdx.x < P.g.S) scale = __ldg(P.x_scale + int64_t(t) * P.g.S + threadIdx.x);
  }
  __device__ void convert(const DispatchSendParams&) {}
  __device__ void store(const DispatchSendParams& P, uint8_t* payload, uint8_t* scales) const {
#pragma unroll
    for (int i = 0; i < kChunks; ++i)
      if (int64_t(chunk_of(i)) * 16 < P.g.payload) reinterpret_cast<int4*>(payload)[chunk_of(i)] = v[i];
    if (P.g.wire_is_fp8() && threadIdx.x < P.g.S) store_f32(scales + 4 * int64_t(threadIdx.x), scale);
  }
};

// The chunk kind of a launch with these sizes and dtypes (alignment is the caller's to check).
inline ChunkKind regs_chunk_kind(const Geometry& g, ElemKind x_kind, bool has_x_scale) {
  const int64_t threads = kThreads;
  ChunkKind k;
  if (g.wire_is_fp8() && is_float(x_kind)) {  // quantise
    const int lpb = g.scale_block / 16;
    const bool pow2_lanes = lpb >= 1 && lpb <= 32 && (lpb & (lpb - 1)) == 0 && g.scale_block % 16 == 0;
    const bool fits = g.H % 16 == 0 && g.H <= QuantChunks<ElemKind::kBF16>::kChunks * 16 * threads;
    if (pow2_lanes && fits) k.how = ChunkKind::How::kQuantize, k.x_kind = x_kind;
    return k;
  }
  if (x_kind == g.wire_kind) {  // copy
    const bool scales_ok = !g.wire_is_fp8() || (has_x_scale && g.S <= threads);
    const bool fits = g.payload % 16 == 0 && g.payload <= CopyChunks<>::kChunks * 16 * threads;
    if (scales_ok && fits) k.how = ChunkKind::How::kCopy, k.x_kind = x_kind;
  }
  return k;
}

// Calls f(Chunks{}) with the chunk type of `kind` (QuantChunks of x's float kind, else
// CopyChunks; kind.ok()) and returns what f returns; the launchers instantiate their kernel for
// decltype of the argument. Small = true: one chunk per thread (payloads up to 16 * blockDim
// bytes, half the registers: room for a second token in flight).
template <bool Small = false, class F>
inline auto with_chunk_kind(ChunkKind kind, F&& f) {
  constexpr int q = Small ? 1 : 2, c = Small ? 1 : 4;
  if (kind.how == ChunkKind::How::kQuantize) {
    switch (kind.x_kind) {
      case ElemKind::kF32: return f(QuantChunks<ElemKind::kF32, q>{});
      case ElemKind::kBF16: return f(QuantChunks<ElemKind::kBF16, q>{});
      case ElemKind::kF16:
      case ElemKind::kF8E4M3: break;  // not a float kind: regs_chunk_kind never quantises it
    }
    return f(QuantChunks<ElemKind::kF16, q>{});
  }
  return f(CopyChunks<c>{});
}

// Whether a launch of `kind` fits the Small chunk types (one chunk per thread).
inline bool small_chunks_fit(const Geometry& g, ChunkKind kind) {
  return kind.how == ChunkKind::How::kQuantize ? int64_t(g.H) <= 16 * int64_t(kThreads)
                                               : g.payload <= 16 * int64_t(kThreads);
}

}  // namespace a2a::gpu
