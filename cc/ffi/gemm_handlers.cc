// FFI handlers of the grouped expert GEMMs (cc/gemm): decode, validate, forward. Each only
// launches device work on XLA's stream (group sizes are read on the device): safe inside XLA
// command buffers.
#include <cuda_runtime_api.h>

#include <string>

#include "ffi/common.h"
#include "ffi/handlers.h"
#include "gemm/grouped_gemm.h"

namespace ffi = xla::ffi;
namespace g = a2a::gemm;
using a2a::ffi_util::invalid;

namespace {

ffi::Error launch_failed(const char* what, cudaError_t rc) {
  return ffi::Error(ffi::ErrorCode::kInternal,
                    std::string("jax_moe_a2a: ") + what + " launch failed: " + cudaGetErrorString(rc));
}

// The wgrad form (kWgrad): x = X [R, K] or [L, C, K], dy = dY [R, N] or [L, C, N] (the same rows),
// y = dW [L, N, K] f32 with dW[l] = dY_l^T X_l over group l's rows; L = group_sizes' length.
ffi::Error DecodeWgrad(const ffi::AnyBuffer& x, const ffi::AnyBuffer& dy, const ffi::Buffer<ffi::S32>& group_sizes,
                       ffi::Result<ffi::AnyBuffer>& y, g::GroupedGemmParams& p) {
  auto xd = x.dimensions();
  auto dd = dy.dimensions();
  p.mode = g::Mode::kWgrad;
  p.num_groups = static_cast<int64_t>(group_sizes.element_count());
  if (xd.size() != dd.size() || (xd.size() != 2 && xd.size() != 3))
    return invalid("grouped_gemm wgrad: x and dy must both be [R, .] or both [L, C, .]");
  for (size_t i = 0; i + 1 < xd.size(); ++i)
    if (xd[i] != dd[i]) return invalid("grouped_gemm wgrad: x and dy must have the same rows");
  p.layout = xd.size() == 2 ? g::Layout::kRagged : g::Layout::kExpertMajor;
  if (p.layout == g::Layout::kExpertMajor && xd[0] != p.num_groups)
    return invalid("grouped_gemm wgrad: expert_major x must be [L, C, K] with L = len(group_sizes)");
  p.rows = xd.size() == 2 ? xd[0] : xd[1];
  p.k = xd[xd.size() - 1];
  p.n = dd[dd.size() - 1];
  if (x.element_type() != ffi::DataType::BF16 || dy.element_type() != ffi::DataType::BF16)
    return invalid("grouped_gemm wgrad: x and dy must be bf16");
  if (y->element_type() != ffi::DataType::F32) return invalid("grouped_gemm wgrad: dw must be f32");
  p.in = g::InType::kBF16;
  p.out = g::OutType::kF32;
  if (y->element_count() != static_cast<size_t>(p.num_groups * p.n * p.k))
    return invalid("grouped_gemm wgrad: dw must be [L, N, K]");
  return ffi::Error::Success();
}

// The forward form (kForward, or kTransposeW): x [R, K] (ragged) or [L, C, K] (expert_major)
// bf16 / f8e4m3fn; w [L, N, K] (or [L, K, N] in kTransposeW); x_scale f32 [rows, K/128] and
// w_scale f32 [L, N/128, K/128] (fp8; empty for bf16); y [rows, N] / [L, C, N] bf16 or f32.
// The inputs of the forward form (DecodeForward's part without y).
ffi::Error DecodeForwardInputs(const ffi::AnyBuffer& x, const ffi::AnyBuffer& w, const ffi::Buffer<ffi::S32>& group_sizes,
                               ffi::Buffer<ffi::F32>& x_scale, ffi::Buffer<ffi::F32>& w_scale, g::Mode mode,
                               g::GroupedGemmParams& p) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  if (wd.size() != 3) return invalid("grouped_gemm: w must be 3-D");
  p.num_groups = wd[0];
  p.mode = mode;
  const bool transpose_w = mode == g::Mode::kTransposeW;
  p.n = transpose_w ? wd[2] : wd[1];
  p.k = transpose_w ? wd[1] : wd[2];
  if (xd.size() == 2) {
    p.layout = g::Layout::kRagged;
    p.rows = xd[0];
  } else if (xd.size() == 3) {
    p.layout = g::Layout::kExpertMajor;
    if (xd[0] != p.num_groups) return invalid("grouped_gemm: expert_major x must be [L, C, K] with L = w.shape[0]");
    p.rows = xd[1];
  } else {
    return invalid("grouped_gemm: x must be [R, K] or [L, C, K]");
  }
  if (xd[xd.size() - 1] != p.k) return invalid("grouped_gemm: x's last dimension must be K");
  if (group_sizes.element_count() != static_cast<size_t>(p.num_groups))
    return invalid("grouped_gemm: group_sizes must be [L]");
  if (x.element_type() != w.element_type()) return invalid("grouped_gemm: x and w must have one dtype");
  const int64_t rows_total = p.layout == g::Layout::kRagged ? p.rows : p.rows * p.num_groups;
  if (x.element_type() == ffi::DataType::BF16) {
    p.in = g::InType::kBF16;
  } else if (x.element_type() == ffi::DataType::F8E4M3FN) {
    p.in = g::InType::kFp8;
    if (p.k % 128 != 0 || p.n % 128 != 0) return invalid("grouped_gemm: fp8 needs K % 128 == 0 and N % 128 == 0");
    if (x_scale.element_count() != static_cast<size_t>(rows_total * (p.k / 128)))
      return invalid("grouped_gemm: x_scale must be [rows, K/128]");
    if (w_scale.element_count() != static_cast<size_t>(p.num_groups * (p.n / 128) * (p.k / 128)))
      return invalid("grouped_gemm: w_scale must be [L, N/128, K/128]");
    p.x_scale = x_scale.typed_data();
    p.w_scale = w_scale.typed_data();
  } else {
    return invalid("grouped_gemm: x and w must be bf16 or float8_e4m3fn");
  }
  return ffi::Error::Success();
}

ffi::Error DecodeForward(const ffi::AnyBuffer& x, const ffi::AnyBuffer& w, const ffi::Buffer<ffi::S32>& group_sizes,
                         ffi::Buffer<ffi::F32>& x_scale, ffi::Buffer<ffi::F32>& w_scale,
                         ffi::Result<ffi::AnyBuffer>& y, g::Mode mode, g::GroupedGemmParams& p) {
  if (ffi::Error e = DecodeForwardInputs(x, w, group_sizes, x_scale, w_scale, mode, p); e.failure()) return e;
  const int64_t rows_total = p.layout == g::Layout::kRagged ? p.rows : p.rows * p.num_groups;
  if (y->element_type() == ffi::DataType::BF16) {
    p.out = g::OutType::kBF16;
  } else if (y->element_type() == ffi::DataType::F32) {
    p.out = g::OutType::kF32;
  } else {
    return invalid("grouped_gemm: y must be bf16 or f32");
  }
  if (y->element_count() != static_cast<size_t>(rows_total * p.n)) return invalid("grouped_gemm: y must be [rows, N]");
  return ffi::Error::Success();
}

// mode: g::Mode's value: 0 forward, 1 transpose_w (the bf16 dgrad), 2 wgrad (w is then dY). workspace u8,
// exactly _C.gemm.workspace_bytes(...) of the same mode and tuning (checked by the launch).
// tile_m, raster, swizzle, kernel: g::TuningRequest (0, 0, 1, 0 unless JAX_MOE_A2A_GEMM_TILE_M forces them).
ffi::Error GroupedGemmImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Buffer<ffi::S32> group_sizes,
                           ffi::Buffer<ffi::F32> x_scale, ffi::Buffer<ffi::F32> w_scale, ffi::Result<ffi::AnyBuffer> y,
                           ffi::Result<ffi::Buffer<ffi::U8>> workspace, int32_t mode, int32_t tile_m, int32_t raster,
                           int32_t swizzle, int32_t kernel) {
  g::GroupedGemmParams p;
  g::Mode m;
  if (!g::mode_from_int(mode, m)) return invalid("grouped_gemm: mode must be 0 (forward), 1 (transpose_w) or 2 (wgrad)");
  if (!g::tuning_from_ints(tile_m, raster, swizzle, kernel, p.tuning)) return invalid(std::string("grouped_gemm: ") + g::kTuningValues);
  ffi::Error decoded = m == g::Mode::kWgrad ? DecodeWgrad(x, w, group_sizes, y, p)
                                            : DecodeForward(x, w, group_sizes, x_scale, w_scale, y, m, p);
  if (decoded.failure()) return decoded;
  if (const char* why = g::unsupported_reason(p)) return invalid(std::string("grouped_gemm: ") + why);
  p.x = x.untyped_data();
  p.w = w.untyped_data();
  p.group_sizes = group_sizes.typed_data();
  p.y = y->untyped_data();
  p.workspace = workspace->untyped_data();
  p.workspace_size = workspace->element_count();
  const g::LaunchStatus st = g::launch_grouped_gemm(p, stream);
  if (st.workspace_short(p))
    return invalid("grouped_gemm: workspace too small: " + std::to_string(p.workspace_size) + " bytes, the kernel needs " +
                   std::to_string(st.workspace_needed));
  if (st.error != cudaSuccess) return launch_failed("grouped_gemm", st.error);
  return ffi::Error::Success();
}

// gu f32 or bf16 [rows, 2F] -> h [rows, F] bf16, or f8e4m3fn with h_scale f32 [rows, F/block].
ffi::Error SwigluImpl(cudaStream_t stream, ffi::AnyBuffer gu, ffi::Result<ffi::AnyBuffer> h,
                      ffi::Result<ffi::Buffer<ffi::F32>> h_scale, int64_t block) {
  auto d = gu.dimensions();
  if (d.size() < 1 || d[d.size() - 1] % 2 != 0) return invalid("swiglu: gu must be [..., 2F]");
  g::SwigluParams p;
  p.f = d[d.size() - 1] / 2;
  p.rows = p.f == 0 ? 0 : static_cast<int64_t>(gu.element_count()) / (2 * p.f);
  p.block = block;
  if (block <= 0 || block > 256) return invalid("swiglu: block must be in 1..256");
  if (h->element_count() != static_cast<size_t>(p.rows * p.f)) return invalid("swiglu: h must be [..., F]");
  if (gu.element_type() != ffi::DataType::F32 && gu.element_type() != ffi::DataType::BF16)
    return invalid("swiglu: gu must be f32 or bf16");
  p.gu = gu.untyped_data();
  p.gu_bf16 = gu.element_type() == ffi::DataType::BF16;
  p.h = h->untyped_data();
  if (h->element_type() == ffi::DataType::F8E4M3FN) {
    const int64_t nb = (p.f + block - 1) / block;
    if (h_scale->element_count() != static_cast<size_t>(p.rows * nb)) return invalid("swiglu: h_scale must be [..., F/block]");
    p.h_scale = h_scale->typed_data();
  } else if (h->element_type() != ffi::DataType::BF16) {
    return invalid("swiglu: h must be bf16 or float8_e4m3fn");
  }
  if (cudaError_t rc = g::launch_swiglu(p, stream); rc != cudaSuccess) return launch_failed("swiglu", rc);
  return ffi::Error::Success();
}

// The fp8 gate+up GEMM with the SwiGLU epilogue (g::launch_grouped_gemm_swiglu, our own kernel):
// x and scales as the forward form, w [L, 2F, K]; h f8e4m3fn [rows, F] (or [L, C, F]), h_scale f32
// [rows, F/128]. tile_m, raster, swizzle, kernel: as grouped_gemm's (our kernel must take the call:
// g::swiglu_gemm_unsupported_reason).
ffi::Error GroupedGemmSwigluImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer w,
                                 ffi::Buffer<ffi::S32> group_sizes, ffi::Buffer<ffi::F32> x_scale,
                                 ffi::Buffer<ffi::F32> w_scale, ffi::Result<ffi::AnyBuffer> h,
                                 ffi::Result<ffi::Buffer<ffi::F32>> h_scale, int32_t tile_m, int32_t raster, int32_t swizzle,
                                 int32_t kernel) {
  g::GroupedGemmParams p;
  if (!g::tuning_from_ints(tile_m, raster, swizzle, kernel, p.tuning))
    return invalid(std::string("grouped_gemm_swiglu: ") + g::kTuningValues);
  if (ffi::Error e = DecodeForwardInputs(x, w, group_sizes, x_scale, w_scale, g::Mode::kForward, p); e.failure()) return e;
  p.out = g::OutType::kBF16;  // not written: h is
  if (const char* why = g::swiglu_gemm_unsupported_reason(p)) return invalid(std::string("grouped_gemm_swiglu: ") + why);
  const int64_t rows_total = p.layout == g::Layout::kRagged ? p.rows : p.rows * p.num_groups;
  const int64_t f = p.n / 2;
  if (h->element_type() != ffi::DataType::F8E4M3FN || h->element_count() != static_cast<size_t>(rows_total * f))
    return invalid("grouped_gemm_swiglu: h must be float8_e4m3fn [rows, F]");
  if (h_scale->element_count() != static_cast<size_t>(rows_total * (f / 128)))
    return invalid("grouped_gemm_swiglu: h_scale must be f32 [rows, F/128]");
  p.x = x.untyped_data();
  p.w = w.untyped_data();
  p.group_sizes = group_sizes.typed_data();
  if (cudaError_t rc = g::launch_grouped_gemm_swiglu(p, h->untyped_data(), h_scale->typed_data(), stream); rc != cudaSuccess)
    return launch_failed("grouped_gemm_swiglu", rc);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(A2aGroupedGemmSwigluCuda, GroupedGemmSwigluImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("tile_m")
                                  .Attr<int32_t>("raster")
                                  .Attr<int32_t>("swizzle")
                                  .Attr<int32_t>("kernel"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(A2aGroupedGemmCuda, GroupedGemmImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::U8>>()
                                  .Attr<int32_t>("mode")
                                  .Attr<int32_t>("tile_m")
                                  .Attr<int32_t>("raster")
                                  .Attr<int32_t>("swizzle")
                                  .Attr<int32_t>("kernel"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(A2aSwigluCuda, SwigluImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("block"),
                              {ffi::Traits::kCmdBufferCompatible});
