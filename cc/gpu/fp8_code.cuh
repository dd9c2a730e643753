// One quantised value on the device: the twin of core/fp8.h's fp8_quantize_value (the rule there:
// a finite v becomes e4m3fn(v * inv), rounded to nearest even and saturated at +-448, by the
// hardware conversion; a NaN or +-Inf becomes kFp8E4M3NaN, 0x7F). The conversion alone would
// not do: it saturates an Inf to +-448 and keeps a NaN's sign.
#pragma once

#include <cuda_fp8.h>

#include <cstdint>

#include "core/fp8.h"

namespace a2a::gpu {

__device__ __forceinline__ uint8_t fp8_quantize_value(float v, float inv) {
  return fp8_finite(v) ? static_cast<uint8_t>(__nv_cvt_float_to_fp8(__fmul_rn(v, inv), __NV_SATFINITE, __NV_E4M3))
                       : kFp8E4M3NaN;
}

}  // namespace a2a::gpu
