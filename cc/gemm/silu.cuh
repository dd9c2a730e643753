// silu(g) = g * sigmoid(g) = g / (1 + e^-g), as every SwiGLU of the grouped-GEMM layer computes
// it: the SwiGLU kernels (grouped_gemm.cu) and the fused epilogues of both fp8 kernels
// (fp8_wgmma.cuh, fp8_wgmma_swap.cuh) call this one function, so fused and unfused give the same
// bits. The hardware exponential and division (MUFU.EX2, MUFU.RCP): a few ulp of f32 (the
// exponential 2 + 1.2 |g| ulp), far below the bf16 / e4m3 rounding that follows. The IEEE division
// it replaces compiled to a range check and a called slow path per value: in the swap-AB kernel's
// fused epilogue, fully unrolled over 80 values a thread, that made ~4,800 instructions executed
// once per tile, instruction-fetch stalls their largest share (ncu, H100, 2026-12-06); with this
// silu the fused gate+up GEMM at L = 8 went from 117.7 to 101.4 us. g below about -87: the
// denominator passes 2^126 and silu is -0 (the true value is below 1e-36); NaN stays NaN.
#pragma once

namespace a2a::gemm {

__device__ __forceinline__ float silu(float g) { return __fdividef(g, 1.0f + __expf(-g)); }

}  // namespace a2a::gemm
