// Every XLA FFI handler symbol the extension exports. The Python side registers them by name
// (jax_moe_a2a/_ffi.py); cc/python/module.cc wraps them into capsules.
#pragma once

#include "xla/ffi/api/api.h"

// fp8 block quantiser: x [rows, hidden] f32/bf16/f16 -> q [rows, hidden] f8e4m3fn, scale [rows, hidden/block] f32.
XLA_FFI_DECLARE_HANDLER_SYMBOL(A2aQuantizeFp8Cpu);
#if defined(JAX_MOE_A2A_WITH_LIBFABRIC)
// host backend (cc/host): the four halves on CPU devices, over the TransferEngine.
XLA_FFI_DECLARE_HANDLER_SYMBOL(A2aHostDispatchSend);
XLA_FFI_DECLARE_HANDLER_SYMBOL(A2aHostDispatchRecv);
XLA_FFI_DECLARE_HANDLER_SYMBOL(A2aHostCombineSend);
XLA_FFI_DECLARE_HANDLER_SYMBOL(A2aHostCombineRecv);
#endif
#if defined(JAX_MOE_A2A_WITH_CUDA)
XLA_FFI_DECLARE_HANDLER_SYMBOL(A2aQuantizeFp8Cuda);
// cuda backend (cc/cuda): the four halves on NVIDIA GPUs, peers over NVLink / peer mappings.
XLA_FFI_DECLARE_HANDLER_SYMBOL(A2aCudaDispatchSend);
XLA_FFI_DECLARE_HANDLER_SYMBOL(A2aCudaDispatchRecv);
XLA_FFI_DECLARE_HANDLER_SYMBOL(A2aCudaCombineSend);
XLA_FFI_DECLARE_HANDLER_SYMBOL(A2aCudaCombineRecv);
// ... and its EP = 1 path (cc/gpu/local): dispatch and combine each one kernel, no communication.
XLA_FFI_DECLARE_HANDLER_SYMBOL(A2aCudaLocalDispatch);
XLA_FFI_DECLARE_HANDLER_SYMBOL(A2aCudaLocalCombine);
#endif
#if defined(JAX_MOE_A2A_WITH_GEMM)
// grouped expert GEMMs (cc/gemm): y = x @ w^T per local expert; the SwiGLU epilogue.
XLA_FFI_DECLARE_HANDLER_SYMBOL(A2aGroupedGemmCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(A2aSwigluCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(A2aGroupedGemmSwigluCuda);
#endif
#if defined(JAX_MOE_A2A_WITH_NVSHMEM)
// nvshmem backend (cc/nvshmem): the four halves on NVIDIA GPUs, peers over NVSHMEM puts and signals.
XLA_FFI_DECLARE_HANDLER_SYMBOL(A2aNvshmemDispatchSend);
XLA_FFI_DECLARE_HANDLER_SYMBOL(A2aNvshmemDispatchRecv);
XLA_FFI_DECLARE_HANDLER_SYMBOL(A2aNvshmemCombineSend);
XLA_FFI_DECLARE_HANDLER_SYMBOL(A2aNvshmemCombineRecv);
XLA_FFI_DECLARE_HANDLER_SYMBOL(A2aNvshmemLocalDispatch);
XLA_FFI_DECLARE_HANDLER_SYMBOL(A2aNvshmemLocalCombine);
#endif
