// The nanobind extension jax_moe_a2a._C: hands the FFI handlers to Python as capsules.
#include <nanobind/nanobind.h>

#include "ffi/handlers.h"
#include "python/config.h"

namespace nb = nanobind;

#if defined(JAX_MOE_A2A_WITH_LIBFABRIC)
namespace a2a::python {
void bind_transfer(nb::module_& m);  // cc/python/bind_transfer.cc
void bind_host(nb::module_& m);      // cc/python/bind_host.cc
}
#endif
#if defined(JAX_MOE_A2A_WITH_CUDA)
namespace a2a::python {
void bind_cuda(nb::module_& m);  // cc/python/bind_cuda.cc
}
#endif
#if defined(JAX_MOE_A2A_WITH_NVSHMEM)
namespace a2a::python {
void bind_nvshmem(nb::module_& m);  // cc/python/bind_nvshmem.cc
}
#endif
namespace a2a::python {
void bind_gemm(nb::module_& m);  // cc/python/bind_gemm.cc
}

namespace {

template <typename Fn>
nb::capsule capsule(Fn* fn) {
  static_assert(std::is_invocable_r_v<XLA_FFI_Error*, Fn, XLA_FFI_CallFrame*>,
                "an FFI handler must be an XLA_FFI_Handler");
  return nb::capsule(reinterpret_cast<void*>(fn));
}

}  // namespace

NB_MODULE(_C, m) {
  m.doc() = "jax_moe_a2a native extension: XLA FFI handlers (CPU and, when compiled, CUDA).";

  m.def("cpu_targets", []() {
    nb::dict d;
    d["jax_moe_a2a_quantize_fp8"] = capsule(A2aQuantizeFp8Cpu);
#if defined(JAX_MOE_A2A_WITH_LIBFABRIC)
    d["jax_moe_a2a_host_dispatch_send"] = capsule(A2aHostDispatchSend);
    d["jax_moe_a2a_host_dispatch_recv"] = capsule(A2aHostDispatchRecv);
    d["jax_moe_a2a_host_combine_send"] = capsule(A2aHostCombineSend);
    d["jax_moe_a2a_host_combine_recv"] = capsule(A2aHostCombineRecv);
#endif
    return d;
  }, "FFI handlers for the 'cpu' platform: {target name: capsule}.");

  m.def("cuda_targets", []() {
    nb::dict d;
#if defined(JAX_MOE_A2A_WITH_CUDA)
    d["jax_moe_a2a_quantize_fp8"] = capsule(A2aQuantizeFp8Cuda);
    d["jax_moe_a2a_cuda_dispatch_send"] = capsule(A2aCudaDispatchSend);
    d["jax_moe_a2a_cuda_dispatch_recv"] = capsule(A2aCudaDispatchRecv);
    d["jax_moe_a2a_cuda_combine_send"] = capsule(A2aCudaCombineSend);
    d["jax_moe_a2a_cuda_combine_recv"] = capsule(A2aCudaCombineRecv);
    d["jax_moe_a2a_cuda_local_dispatch"] = capsule(A2aCudaLocalDispatch);
    d["jax_moe_a2a_cuda_local_combine"] = capsule(A2aCudaLocalCombine);
#endif
#if defined(JAX_MOE_A2A_WITH_GEMM)
    d["jax_moe_a2a_grouped_gemm"] = capsule(A2aGroupedGemmCuda);
    d["jax_moe_a2a_swiglu"] = capsule(A2aSwigluCuda);
    d["jax_moe_a2a_grouped_gemm_swiglu"] = capsule(A2aGroupedGemmSwigluCuda);
#endif
#if defined(JAX_MOE_A2A_WITH_NVSHMEM)
    d["jax_moe_a2a_nvshmem_dispatch_send"] = capsule(A2aNvshmemDispatchSend);
    d["jax_moe_a2a_nvshmem_dispatch_recv"] = capsule(A2aNvshmemDispatchRecv);
    d["jax_moe_a2a_nvshmem_combine_send"] = capsule(A2aNvshmemCombineSend);
    d["jax_moe_a2a_nvshmem_combine_recv"] = capsule(A2aNvshmemCombineRecv);
    d["jax_moe_a2a_nvshmem_local_dispatch"] = capsule(A2aNvshmemLocalDispatch);
    d["jax_moe_a2a_nvshmem_local_combine"] = capsule(A2aNvshmemLocalCombine);
#endif
    return d;
  }, "FFI handlers for the 'CUDA' platform: {target name: capsule}; empty without nvcc at build time.");

  a2a::python::bind_config(m);
#if defined(JAX_MOE_A2A_WITH_LIBFABRIC)
  a2a::python::bind_transfer(m);
  a2a::python::bind_host(m);
#endif
#if defined(JAX_MOE_A2A_WITH_CUDA)
  a2a::python::bind_cuda(m);
#endif
#if defined(JAX_MOE_A2A_WITH_NVSHMEM)
  a2a::python::bind_nvshmem(m);
#endif
  a2a::python::bind_gemm(m);
  m.def("built_with_libfabric", []() {
#if defined(JAX_MOE_A2A_WITH_LIBFABRIC)
    return true;
#else
    return false;
#endif
  });

  m.def("built_with_cuda", []() {
#if defined(JAX_MOE_A2A_WITH_CUDA)
    return true;
#else
    return false;
#endif
  });

  m.def("built_with_nvshmem", []() {
#if defined(JAX_MOE_A2A_WITH_NVSHMEM)
    return true;
#else
    return false;
#endif
  });
}
