// fp8 rows dequantised on receive (Spec.recv_dtype; docs/api.md, "Dequantise on receive"): where
// the receive side would write fp8 rows and their scales, it writes
//   out[h] = float(q[h]) * scale[h / scale_block]
// rounded to the output's float kind (f32, bf16, f16): one f32 product, then round to nearest
// even, which is dequantize_fp8(q, scale).astype(recv_dtype) bit for bit. Shared by
// dispatch_recv's row copy (gpu/recv_rows.cuh) and the EP = 1 dispatch (gpu/local/outputs.cuh).
#pragma once

#include <cuda_fp8.h>

#include <cstdint>

#include "gpu/copy.cuh"
#include "gpu/elems.cuh"
#include "gpu/params.h"
#include "gpu/ptx.cuh"

namespace a2a::gpu {

// 16 fp8 e4m3 values (one 16-byte vector, value j in byte j) as f32, each times `scale`.
__device__ __forceinline__ void dequant16(int4 raw, float scale, float v[16]) {
  const uint32_t w[4] = {uint32_t(raw.x), uint32_t(raw.y), uint32_t(raw.z), uint32_t(raw.w)};
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    __nv_fp8_e4m3 f;
    f.__x = static_cast<__nv_fp8_storage_t>((w[j / 4] >> (8 * (j % 4))) & 0xffu);
    v[j] = __fmul_rn(float(f), scale);
  }
}

// The calling warp writes output elements [lo, lo + len) of one received row: `row` is the wire
// row (H fp8 payload bytes, then the S f32 scales at row + g.payload, unaligned when H % 4 != 0),
// `out` the output row (H elements of out_kind). 16 values per lane and step (one volatile
// 16-byte load, as warp_copy's, and two 8-element stores) when H and scale_block are multiples
// of 16 and both rows 16-byte aligned (lo is: row segments are); one element per lane otherwise.
__device__ inline void warp_dequant(void* out, ElemKind out_kind, const uint8_t* row, const Geometry& g, int64_t lo,
                                    int64_t len, int lane) {
  const uint8_t* scales = row + g.payload;
  if (g.H % 16 == 0 && g.scale_block % 16 == 0 && lo % 16 == 0 && aligned16(row) && aligned16(out)) {
    for (int64_t c = lo + 16 * int64_t(lane); c < lo + len; c += 16 * 32) {
      const int4 raw = ptx::ld_volatile_v4(reinterpret_cast<const int4*>(row + c));
      float v[16];
      dequant16(raw, load_f32(scales + 4 * (c / g.scale_block)), v);
      store_vec8(out, c, out_kind, v);
      store_vec8(out, c + 8, out_kind, v + 8);
    }
    return;
  }
  const volatile uint8_t* q = row;
  for (int64_t h = lo + lane; h < lo + len; h += 32) {
    __nv_fp8_e4m3 f;
    f.__x = static_cast<__nv_fp8_storage_t>(q[h]);
    store_elem(out, h, out_kind, __fmul_rn(float(f), load_f32(scales + 4 * (h / g.scale_block))));
  }
}

}  // namespace a2a::gpu
