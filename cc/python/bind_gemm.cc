// jax_moe_a2a._C.gemm: whether the grouped-GEMM kernels (cc/gemm) were built, and the device
// workspace a call needs (the Python wrapper allocates it as an output of the FFI call).
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>

#include <stdexcept>
#include <string>

#if defined(JAX_MOE_A2A_WITH_GEMM)
#include "gemm/grouped_gemm.h"
#include "gemm/kernels.h"
#endif

namespace nb = nanobind;
using namespace nb::literals;

#ifndef JAX_MOE_A2A_GEMM_REASON
#define JAX_MOE_A2A_GEMM_REASON "the grouped-GEMM kernels were not built"
#endif

namespace a2a::python {

#if defined(JAX_MOE_A2A_WITH_GEMM)
namespace {
// A call's shapes as the handlers see them (its tuning and mode left at their defaults).
gemm::GroupedGemmParams params_of(bool fp8, bool out_f32, int64_t num_groups, int64_t rows, int64_t n, int64_t k,
                                  bool expert_major) {
  gemm::GroupedGemmParams p;
  p.in = fp8 ? gemm::InType::kFp8 : gemm::InType::kBF16;
  p.out = out_f32 ? gemm::OutType::kF32 : gemm::OutType::kBF16;
  p.layout = expert_major ? gemm::Layout::kExpertMajor : gemm::Layout::kRagged;
  p.num_groups = num_groups;
  p.rows = rows;
  p.n = n;
  p.k = k;
  return p;
}

// params_of with the call's kernel configuration (the custom call's attributes); a configuration
// outside gemm::TuningRequest's set throws ValueError.
gemm::GroupedGemmParams tuned_params_of(bool fp8, bool out_f32, int64_t num_groups, int64_t rows, int64_t n, int64_t k,
                                        bool expert_major, int tile_m, int raster, int swizzle, int kernel) {
  gemm::GroupedGemmParams p = params_of(fp8, out_f32, num_groups, rows, n, k, expert_major);
  if (!gemm::tuning_from_ints(tile_m, raster, swizzle, kernel, p.tuning)) throw std::invalid_argument(gemm::kTuningValues);
  return p;
}
}  // namespace
#endif

void bind_gemm(nb::module_& m) {
  nb::module_ g = m.def_submodule("gemm", "grouped expert GEMMs (cc/gemm)");
  g.def("built", []() {
#if defined(JAX_MOE_A2A_WITH_GEMM)
    return true;
#else
    return false;
#endif
  }, "True when the CUTLASS grouped-GEMM kernels were compiled into this extension.");
  g.def("reason", []() -> std::string {
#if defined(JAX_MOE_A2A_WITH_GEMM)
    return "";
#else
    return JAX_MOE_A2A_GEMM_REASON;
#endif
  }, "Why the kernels were not built ('' when they were).");
  g.def(
      "workspace_bytes",
      [](bool fp8, bool out_f32, int mode, int64_t num_groups, int64_t rows, int64_t n, int64_t k,
         bool expert_major, int tile_m, int raster, int swizzle, int kernel) -> int64_t {
        // mode: gemm::Mode's value, as the custom call's `mode` attribute: 0 forward, 1 transpose_w
        // (the bf16 dgrad), 2 wgrad (bf16 in, f32 out; n = dY's columns, k = X's).
#if defined(JAX_MOE_A2A_WITH_GEMM)
        gemm::GroupedGemmParams p =
            tuned_params_of(fp8, out_f32, num_groups, rows, n, k, expert_major, tile_m, raster, swizzle, kernel);
        if (!gemm::mode_from_int(mode, p.mode))
          throw std::invalid_argument("mode must be 0 (forward), 1 (transpose_w) or 2 (wgrad)");
        if (const char* why = gemm::unsupported_reason(p)) throw std::invalid_argument(why);
        return static_cast<int64_t>(gemm::workspace_bytes(p, 0));
#else
        (void)fp8, (void)out_f32, (void)mode, (void)num_groups, (void)rows, (void)n, (void)k, (void)expert_major, (void)tile_m, (void)raster, (void)swizzle, (void)kernel;
        throw std::runtime_error(JAX_MOE_A2A_GEMM_REASON);
#endif
      },
      "fp8"_a, "out_f32"_a, "mode"_a, "num_groups"_a, "rows"_a, "n"_a, "k"_a, "expert_major"_a, "tile_m"_a = 0,
      "raster"_a = 0, "swizzle"_a = 1, "kernel"_a = 0,
      "Device workspace bytes of one grouped_gemm call in `mode` (0 forward, 1 transpose_w, 2 wgrad) with the "
      "kernel configuration tile_m (0 auto, 64, 128), raster (0 along M, 1 along N, 2 heuristic), swizzle (1, 2, 4, "
      "8), kernel (0 auto, 1 cutlass, 2 wgmma, 3 swap): the custom call's attributes. On the current CUDA device: exactly what the handler checks.");
  g.def(
      "swiglu_reason",
      [](int64_t num_groups, int64_t rows, int64_t n, int64_t k, bool expert_major, int tile_m, int raster,
         int swizzle, int kernel) -> std::string {
        // The fused SwiGLU custom call's own rule (gemm::swiglu_gemm_unsupported_reason, which its
        // handler applies), so the Python wrapper never restates the kernel's limits.
#if defined(JAX_MOE_A2A_WITH_GEMM)
        gemm::GroupedGemmParams p = params_of(true, false, num_groups, rows, n, k, expert_major);
        if (!gemm::tuning_from_ints(tile_m, raster, swizzle, kernel, p.tuning)) return gemm::kTuningValues;
        const char* why = gemm::swiglu_gemm_unsupported_reason(p);
        return why ? why : "";
#else
        (void)num_groups, (void)rows, (void)n, (void)k, (void)expert_major, (void)tile_m, (void)raster, (void)swizzle, (void)kernel;
        return JAX_MOE_A2A_GEMM_REASON;
#endif
      },
      "num_groups"_a, "rows"_a, "n"_a, "k"_a, "expert_major"_a, "tile_m"_a = 0, "raster"_a = 0, "swizzle"_a = 1,
      "kernel"_a = 0,
      "Why the fused SwiGLU GEMM (jax_moe_a2a_grouped_gemm_swiglu) cannot take an fp8 call with L = num_groups, "
      "rows (R, or C when expert_major), n = 2F and k, in the kernel configuration given ('' when it can): the "
      "rule its handler applies.");
  g.def(
      "swiglu_by_default",
      [](int64_t num_groups, int64_t rows, int64_t n, int64_t k, bool expert_major, int tile_m, int raster,
         int swizzle, int kernel) -> bool {
        // Where a call that does not say runs the fused SwiGLU GEMM (gemm::swiglu_gemm_fused_by_default).
#if defined(JAX_MOE_A2A_WITH_GEMM)
        gemm::GroupedGemmParams p =
            tuned_params_of(true, false, num_groups, rows, n, k, expert_major, tile_m, raster, swizzle, kernel);
        return gemm::swiglu_gemm_fused_by_default(p);
#else
        (void)num_groups, (void)rows, (void)n, (void)k, (void)expert_major, (void)tile_m, (void)raster, (void)swizzle, (void)kernel;
        throw std::runtime_error(JAX_MOE_A2A_GEMM_REASON);
#endif
      },
      "num_groups"_a, "rows"_a, "n"_a, "k"_a, "expert_major"_a, "tile_m"_a = 0, "raster"_a = 0, "swizzle"_a = 1,
      "kernel"_a = 0,
      "Whether an fp8 gate+up call with L = num_groups, rows (R, or C when expert_major), n = 2F and k, in the "
      "kernel configuration given, runs as the fused SwiGLU GEMM when the call does not say (neither `fused` nor "
      "`unfused` in JAX_MOE_A2A_GEMM_TILE_M): it can, and the swap-AB kernel's token tile is one where the fused "
      "epilogue measured faster than the GEMM and the SwiGLU kernel.");
  g.def(
      "choice",
      [](int64_t num_groups, int64_t rows, int64_t n, int64_t k, bool expert_major, int tile_m, int raster,
         int swizzle, int kernel) -> std::tuple<std::string, int, int> {
        // The kernel an fp8 forward call runs (gemm::detail::choose, from static shapes only), so
        // tests and benchmarks read the rule instead of restating it.
#if defined(JAX_MOE_A2A_WITH_GEMM)
        gemm::GroupedGemmParams p =
            tuned_params_of(true, false, num_groups, rows, n, k, expert_major, tile_m, raster, swizzle, kernel);
        if (const char* why = gemm::unsupported_reason(p)) throw std::invalid_argument(why);
        const gemm::detail::Tuning t = gemm::detail::choose(p);
        return {t.wgmma ? "wgmma" : "cutlass", t.tile == gemm::detail::Tile::kTile64 ? 64 : 128, t.swap_tokens};
#else
        (void)num_groups, (void)rows, (void)n, (void)k, (void)expert_major, (void)tile_m, (void)raster, (void)swizzle, (void)kernel;
        throw std::runtime_error(JAX_MOE_A2A_GEMM_REASON);
#endif
      },
      "num_groups"_a, "rows"_a, "n"_a, "k"_a, "expert_major"_a, "tile_m"_a = 0, "raster"_a = 0, "swizzle"_a = 1,
      "kernel"_a = 0,
      "The kernel an fp8 forward call with L = num_groups, rows (R, or C when expert_major), n and k runs in the "
      "configuration given: (kernel 'cutlass' or 'wgmma', CUTLASS's tile rows 64 or 128, the swap-AB token tile "
      "(0: row-major)). Static shapes only, as the handler chooses.");
}

}  // namespace a2a::python
