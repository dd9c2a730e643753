// silu(g) = g * sigmoid(g) = g / (1 + e^-g), as every SwiGLU of the grouped-GEMM layer computes
// it: the SwiGLU kernels (grouped_gemm.cu) and the fused epilogues of both fp8 kernels
// (fp8_wgmma.cuh, fp8_wgmma_swap.cuh) call this one function, so fused and unfused give the same
// bits. The hardware exponential and division (MUFU.EX2, MUFU.RCP): a few ulp of f32 (the
// exponential 2 + 1.2 |g| ulp), far below the bf16 / e4m3 rounding that follows. The IEEE division
// it replaces compiled to a range check and a called slow path per value: in the swap-AB kernel's
// fused epilogue, fully unrolled over 80 values a thread, that was ~5k instructions executed once
// per tile, most of the epilogue's time in instruction-fetch stalls (ncu, H100, 2026-12-06).
// g < -87: the denominator overflows and silu is -0 (the true value is below 1e-36); NaN stays NaN.
#pragma once

namespace a2a::gemm {

__device__ __forceinline__ float silu(float g) { return __fdividef(g, 1.0f + __expf(-g)); }

}  // namespace a2a::gemm
