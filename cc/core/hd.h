// A2A_HD: host and device inline for the plain-C++ headers the GPU kernels share (core/dtype.h,
// core/fp8.h, core/shape.h): __host__ __device__ under nvcc, plain inline elsewhere.
#pragma once

#if defined(__CUDACC__)
#define A2A_HD __host__ __device__ __forceinline__
#else
#define A2A_HD inline
#endif
