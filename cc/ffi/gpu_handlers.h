// The FFI handlers of both GPU backends (cuda, nvshmem), as one template over the backend: the
// four halves' signatures (XLA infers each binding from them, so every operand, result and
// attribute is named once, here), the decoding of their operands into the kernels' parameter
// structs (cc/gpu/params.h), and the one run() every half goes through. A backend adds only how
// it finds this call's rank and launches a kernel (the contract above Handlers); its .cc file then defines
// the four symbols with A2A_GPU_HANDLERS. They only launch device work with pointers that stay
// fixed (library buffers; XLA buffers passed per call), so they are command-buffer compatible.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <exception>
#include <memory>
#include <stdexcept>
#include <string>

#include "core/half.h"
#include "ffi/common.h"
#include "gpu/local/local.h"
#include "gpu/params.h"
#include "xla/ffi/api/ffi.h"

namespace a2a::ffi_gpu {

namespace ffi = xla::ffi;

using ffi_util::elem_kind_of;  // XLA dtype -> ElemKind (ffi/common.h)

// XLA's stream and device ordinal of the call (execution context, not operands).
struct Stream {
  cudaStream_t s;
  Stream(cudaStream_t v) : s(v) {}  // NOLINT: converted from the decoded context
};
struct Device {
  int32_t ordinal;
  Device(int32_t v) : ordinal(v) {}  // NOLINT
};

// The attributes of the halves (jax_moe_a2a/backends/ffi.py), each set decoded as one struct.
struct SendAttrs {  // dispatch_send, combine_send
  int64_t comm_id;
  int32_t slot;
  int64_t call_id;  // distinct per call site, so that XLA never merges two calls; unused here
};
struct CombineSendAttrs {  // combine_send
  int64_t comm_id;
  int32_t slot;
  int32_t from_slot;  // the slot of the dispatch whose rows these are (may differ from slot)
  int64_t call_id;
};
struct RecvAttrs {  // dispatch_recv
  int64_t comm_id;
  int32_t slot;
};
struct CombineRecvAttrs {  // combine_recv
  int64_t comm_id;
  int32_t slot;
  ElemKind y_kind;  // element kind of combine_send's y
};

}  // namespace a2a::ffi_gpu

namespace xla::ffi {
template <>
struct CtxBinding<a2a::ffi_gpu::Stream> {
  using Ctx = PlatformStream<cudaStream_t>;
};
template <>
struct CtxBinding<a2a::ffi_gpu::Device> {
  using Ctx = DeviceOrdinal;
};
}  // namespace xla::ffi

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(a2a::ffi_gpu::SendAttrs, StructMember<int64_t>("comm_id"),
                                      StructMember<int32_t>("slot"), StructMember<int64_t>("call_id"));
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(a2a::ffi_gpu::CombineSendAttrs, StructMember<int64_t>("comm_id"),
                                      StructMember<int32_t>("slot"), StructMember<int32_t>("from_slot"),
                                      StructMember<int64_t>("call_id"));
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(a2a::ffi_gpu::RecvAttrs, StructMember<int64_t>("comm_id"),
                                      StructMember<int32_t>("slot"));
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(a2a::ffi_gpu::CombineRecvAttrs, StructMember<int64_t>("comm_id"),
                                      StructMember<int32_t>("slot"), StructMember<a2a::ElemKind>("y_kind"));

namespace a2a::ffi_gpu {

// What a GPU backend gives Handlers<Backend>:
//   static constexpr const char* kName;        // "cuda", "nvshmem": in every error text
//   using Rank = ...;                          // its per-rank state: geometry(), slot(z), check_error()
//   static Rank* find(int64_t comm_id, int32_t dev, std::shared_ptr<void>* keep, std::string* why);
//       this call's rank (kept alive by *keep until the launch returns), or null with the error
//       text in *why; may throw
//   static cudaError_t launch(Rank&, Half op, cudaStream_t, const P&);  // for each parameter struct P
//       op: the half, which gpu::KernelTimer times; the EP = 1 kernels (gpu/local/local.h) are
//       timed as Half::kDispatchSend (dispatch) and Half::kCombineRecv (combine)
//   static cudaError_t launch(Rank&, Half op, cudaStream_t, const LocalDispatchParams&, gpu::ChunkKind kind);
template <typename Backend>
struct Handlers {
  using Any = ffi::AnyBuffer;
  using F32 = ffi::Buffer<ffi::F32>;
  using S32 = ffi::Buffer<ffi::S32>;
  template <typename T>
  using Out = ffi::Result<T>;

  // x [T, H] f32/bf16/f16 (or fp8 with x_scale [T, S] f32; else x_scale is empty), ids [T, K],
  // weights [T, K], num_tokens [] -> handle [2], dest [T, K], pair_slot [T, K], dropped [],
  // dest_counts [N] (nvshmem) or empty (cuda: not written). `after` operands only order a call
  // after earlier work (jax_moe_a2a/backends/ffi.py). Every half's last operand `alive` is the
  // elastic EP rank mask, [N] (nonzero = alive), or empty: no mask.
  static ffi::Error dispatch_send(Stream stream, Device dev, Any x, F32 x_scale, S32 ids, F32 weights, S32 num_tokens,
                                  Any /*after*/, S32 alive, Out<S32> handle, Out<S32> dest, Out<S32> pair_slot,
                                  Out<S32> dropped, Out<S32> dest_counts, SendAttrs a) {
    return run<gpu::DispatchSendParams>("dispatch_send", Half::kDispatchSend, stream, dev, a.comm_id, a.slot, [&](auto* p) {
      p->dest_counts = per_rank_or_null(dest_counts->typed_data(), dest_counts->element_count(), p->g);
      return set_alive(&p->p, p->g, alive) &&
             fill_send(p, x, x_scale, ids, weights, num_tokens, handle, dest, pair_slot, dropped);
    });
  }

  // handle [2] -> x [R', H] wire dtype, scale [R', S] f32 (empty unless fp8), group_sizes [L],
  // weights [R'], src [R', 2], recv_slot [R'], recv_counts [N, L + 1], overflow [].
  static ffi::Error dispatch_recv(Stream stream, Device dev, S32 handle, S32 alive, Out<Any> x, Out<F32> scale,
                                  Out<S32> group_sizes, Out<F32> weights, Out<S32> src, Out<S32> recv_slot,
                                  Out<S32> recv_counts, Out<S32> overflow, RecvAttrs a) {
    return run<gpu::DispatchRecvParams>("dispatch_recv", Half::kDispatchRecv, stream, dev, a.comm_id, a.slot, [&](auto* p) {
      p->handle = handle.typed_data();
      return set_alive(&p->p, p->g, alive) && fill_recv(p, x, scale, group_sizes, weights, src, recv_slot, recv_counts, overflow);
    });
  }

  // y [R', H] f32/bf16/f16, recv_counts [N, L + 1] -> handle [2].
  static ffi::Error combine_send(Stream stream, Device dev, Any y, S32 recv_counts, Any /*after*/, S32 alive,
                                 Out<S32> handle, CombineSendAttrs a) {
    return run<gpu::CombineSendParams>("combine_send", Half::kCombineSend, stream, dev, a.comm_id, a.slot, [&](auto* p) {
      if (!set_alive(&p->p, p->g, alive)) return false;
      p->from_slot = a.from_slot;
      p->y = y.untyped_data();
      p->recv_counts = recv_counts.typed_data();
      p->handle = handle->typed_data();
      if (!elem_kind_of(y.element_type(), &p->y_kind) || !is_float(p->y_kind)) return false;
      // The combine region holds rows of the combine dtype (MoeShape::c_row); Python casts a wider y.
      if (int64_t(p->g.H) * elem_bytes(p->y_kind) > p->g.c_stride_max)
        throw std::invalid_argument("y's dtype is wider than Spec.combine_dtype, which the combine buffers are sized for");
      return true;
    });
  }

  // handle [2], dest_counts [N] or empty (dispatch_send's), dest/pair_slot [T, K], weights
  // [T, K], num_tokens [], out_in [T, H] or empty -> out [T, H] combine dtype, pairs [T, K, H]
  // f32 or empty.
  static ffi::Error combine_recv(Stream stream, Device dev, S32 handle, S32 dest_counts, S32 dest, S32 pair_slot,
                                 F32 weights, S32 num_tokens, Any out_in, S32 alive, Out<Any> out, Out<F32> pairs,
                                 CombineRecvAttrs a) {
    return run<gpu::CombineRecvParams>("combine_recv", Half::kCombineRecv, stream, dev, a.comm_id, a.slot, [&](auto* p) {
      p->handle = handle.typed_data();
      p->dest_counts = per_rank_or_null(dest_counts.typed_data(), dest_counts.element_count(), p->g);
      return set_alive(&p->p, p->g, alive) && fill_combine_recv(p, a.y_kind, dest, pair_slot, weights, num_tokens, out_in, out, pairs);
    });
  }

  // EP = 1, the local path (gpu/local/local.h): dispatch_send's operands -> dispatch_send's
  // results, then dispatch_recv's (as in those two handlers). One kernel where it applies
  // (local_dispatch_kind), else the two exchange kernels back to back on the slot's buffers.
  static ffi::Error local_dispatch(Stream stream, Device dev, Any x, F32 x_scale, S32 ids, F32 weights,
                                   S32 num_tokens, Any /*after*/, S32 /*alive: one rank, alive*/, Out<S32> handle, Out<S32> dest, Out<S32> pair_slot,
                                   Out<S32> dropped, Out<Any> rx, Out<F32> rscale, Out<S32> group_sizes,
                                   Out<F32> rweights, Out<S32> src, Out<S32> recv_slot, Out<S32> recv_counts,
                                   Out<S32> overflow, SendAttrs a) {
    return run<gpu::LocalDispatchParams>(
        "dispatch (EP = 1)", Half::kDispatchSend, stream, dev, a.comm_id, a.slot,
        [&](auto* p) {
          p->r.handle = handle->typed_data();
          return fill_send(&p->s, x, x_scale, ids, weights, num_tokens, handle, dest, pair_slot, dropped) &&
                 fill_recv(&p->r, rx, rscale, group_sizes, rweights, src, recv_slot, recv_counts, overflow);
        },
        [](typename Backend::Rank& rank, Half, cudaStream_t s, const gpu::LocalDispatchParams& p) {
          const gpu::ChunkKind kind = gpu::local_dispatch_kind(p);
          if (kind.ok()) return Backend::launch(rank, Half::kDispatchSend, s, p, kind);
          cudaError_t rc = Backend::launch(rank, Half::kDispatchSend, s, p.s);
          return rc == cudaSuccess ? Backend::launch(rank, Half::kDispatchRecv, s, p.r) : rc;
        });
  }

  // EP = 1: combine_send and combine_recv in one kernel that reads y where it is. y [R', H]
  // f32/bf16/f16, recv_counts [1, L + 1], dest/pair_slot [T, K], weights [T, K], num_tokens [],
  // out_in [T, H] or empty -> out [T, H] combine dtype, pairs [T, K, H] f32 or empty.
  static ffi::Error local_combine(Stream stream, Device dev, Any y, S32 recv_counts, S32 dest, S32 pair_slot,
                                  F32 weights, S32 num_tokens, Any out_in, S32 /*alive: one rank, alive*/,
                                  Out<Any> out, Out<F32> pairs, SendAttrs a) {
    return run<gpu::LocalCombineParams>("combine (EP = 1)", Half::kCombineRecv, stream, dev, a.comm_id, a.slot, [&](auto* p) {
      p->y = y.untyped_data();
      p->recv_counts = recv_counts.typed_data();
      ElemKind y_kind;
      return elem_kind_of(y.element_type(), &y_kind) && is_float(y_kind) &&
             fill_combine_recv(&p->c, y_kind, dest, pair_slot, weights, num_tokens, out_in, out, pairs);
    });
  }

 private:
  // The elastic EP mask (every half's last operand): [N] int32 on the device, or empty (no mask:
  // the kernels skip its loads). Refused with peers on other nodes (the proxy waits for every rank;
  // Python refuses first).
  static bool set_alive(gpu::SlotPtrs* p, const gpu::Geometry& g, S32 alive) {
    if (alive.element_count() == 0) return true;
    if (alive.element_count() != size_t(g.N))
      throw std::invalid_argument("rank mask of " + std::to_string(alive.element_count()) + " entries for " +
                                  std::to_string(g.N) + " ranks");
    if (p->remote.mask != 0) throw std::invalid_argument("a rank mask with peers on other nodes (node_size < N)");
    p->alive = alive.typed_data();
    return true;
  }

  // dispatch_send's dest_counts (its result, combine_recv's operand): [N], or empty (null: the
  // cuda backend's kernels neither write nor read it; the nvshmem backend's launches require it).
  static int32_t* per_rank_or_null(int32_t* data, size_t count, const gpu::Geometry& g) {
    if (count == 0) return nullptr;
    if (count != size_t(g.N))
      throw std::invalid_argument("dest_counts of " + std::to_string(count) + " entries for " + std::to_string(g.N) +
                                  " ranks");
    return data;
  }

  // The operands of each half into its parameter struct (shared by the halves and the EP = 1
  // handlers); false for an operand dtype the kernels do not take.
  static bool fill_send(gpu::DispatchSendParams* p, Any x, F32 x_scale, S32 ids, F32 weights, S32 num_tokens,
                        Out<S32>& handle, Out<S32>& dest, Out<S32>& pair_slot, Out<S32>& dropped) {
    p->x = x.untyped_data();
    const bool known = elem_kind_of(x.element_type(), &p->x_kind);
    p->x_scale = x_scale.element_count() ? x_scale.typed_data() : nullptr;
    p->ids = ids.typed_data();
    p->weights = weights.typed_data();
    p->num_tokens = num_tokens.typed_data();
    p->handle = handle->typed_data();
    p->dest = dest->typed_data();
    p->pair_slot = pair_slot->typed_data();
    p->dropped = dropped->typed_data();
    return known;
  }
  static bool fill_recv(gpu::DispatchRecvParams* p, Out<Any>& x, Out<F32>& scale, Out<S32>& group_sizes,
                        Out<F32>& weights, Out<S32>& src, Out<S32>& recv_slot, Out<S32>& recv_counts,
                        Out<S32>& overflow) {
    p->x = x->untyped_data();
    // x in the wire's dtype, or f32/bf16/f16 with fp8 on the wire (dequantised on receive: Spec.recv_dtype)
    if (!elem_kind_of(x->element_type(), &p->x_kind) ||
        (p->x_kind != p->g.wire_kind && !(p->g.wire_is_fp8() && is_float(p->x_kind))))
      throw std::invalid_argument("dispatch_recv's x output must be the wire dtype, or f32/bf16/f16 with fp8 on the wire");
    p->scale = scale->element_count() ? scale->typed_data() : nullptr;
    p->group_sizes = group_sizes->typed_data();
    p->weights = weights->typed_data();
    p->src = src->typed_data();
    p->recv_slot = recv_slot->typed_data();
    p->recv_counts = recv_counts->typed_data();
    p->overflow = overflow->typed_data();
    return true;
  }
  static bool fill_combine_recv(gpu::CombineRecvParams* p, ElemKind y_kind, S32 dest, S32 pair_slot, F32 weights,
                                S32 num_tokens, Any out_in, Out<Any>& out, Out<F32>& pairs) {
    p->y_kind = y_kind;
    p->dest = dest.typed_data();
    p->pair_slot = pair_slot.typed_data();
    p->weights = weights.typed_data();
    p->num_tokens = num_tokens.typed_data();
    p->out_in = out_in.element_count() ? out_in.untyped_data() : nullptr;
    p->out = out->untyped_data();
    p->pairs = pairs->element_count() ? pairs->typed_data() : nullptr;
    // out_in empty: its kind is never read
    const bool in_ok = elem_kind_of(out_in.element_type(), &p->out_in_kind) || !p->out_in;
    return in_ok && elem_kind_of(out->element_type(), &p->out_kind);
  }

  // The rank's geometry and slot pointers into a parameter struct (both halves' for the EP = 1 ones).
  template <typename P>
  static void init(P* p, typename Backend::Rank& rank, int32_t slot) {
    p->g = rank.geometry();
    p->p = rank.slot(slot);
  }
  static void init(gpu::LocalDispatchParams* p, typename Backend::Rank& rank, int32_t slot) {
    init(&p->s, rank, slot);
    init(&p->r, rank, slot);
  }
  static void init(gpu::LocalCombineParams* p, typename Backend::Rank& rank, int32_t slot) { init(&p->c, rank, slot); }

 private:
  // Finds the rank, raises an error a kernel recorded earlier, fills P (the rank's geometry and
  // slot pointers, then the operands: `fill` returns false for an operand dtype the kernels do not
  // take), makes `dev` current and launches (Backend::launch, or `launch` for the EP = 1 dispatch).
  template <typename P, typename Fill>
  static ffi::Error run(const char* op, Half half, Stream stream, Device dev, int64_t comm_id, int32_t slot,
                        Fill&& fill) {
    return run<P>(op, half, stream, dev, comm_id, slot, fill,
                  [](typename Backend::Rank& rank, Half i, cudaStream_t s, const P& p) {
                    return Backend::launch(rank, i, s, p);
                  });
  }
  template <typename P, typename Fill, typename Launch>
  static ffi::Error run(const char* op, Half half, Stream stream, Device dev, int64_t comm_id, int32_t slot,
                        Fill&& fill, Launch&& launch) {
    const auto fail = [&](const std::string& what) {
      return ffi::Error(ffi::ErrorCode::kInternal, std::string("jax_moe_a2a ") + Backend::kName + " " + op + ": " + what);
    };
    try {
      std::shared_ptr<void> keep;
      std::string why;
      typename Backend::Rank* rank = Backend::find(comm_id, dev.ordinal, &keep, &why);
      if (!rank) return ffi::Error(ffi::ErrorCode::kInternal, why);
      rank->check_error();
      P p{};
      init(&p, *rank, slot);
      cudaError_t rc = fill(&p) ? cudaSuccess : cudaErrorInvalidValue;
      int cur = -1;
      if (rc == cudaSuccess && (cudaGetDevice(&cur) != cudaSuccess || cur != dev.ordinal)) rc = cudaSetDevice(dev.ordinal);
      if (rc == cudaSuccess) rc = launch(*rank, half, stream.s, p);
      if (rc != cudaSuccess) return fail(cudaGetErrorString(rc));
      return ffi::Error::Success();
    } catch (const std::exception& e) {
      return fail(e.what());
    }
  }
};

}  // namespace a2a::ffi_gpu

// Defines one XLA FFI handler symbol for a static member function, its binding inferred from the
// signature.
#define A2A_GPU_HANDLER(symbol, impl)                                                                   \
  extern "C" XLA_FFI_Error* symbol(XLA_FFI_CallFrame* call_frame) {                                     \
    static auto* handler =                                                                              \
        ::xla::ffi::Ffi::BindTo(impl, {::xla::ffi::Traits::kCmdBufferCompatible}).release();           \
    return handler->Call(call_frame);                                                                   \
  }

// The handler symbols <prefix>DispatchSend, ..., <prefix>LocalDispatch, <prefix>LocalCombine
// (cc/ffi/handlers.h) of backend `Backend`.
#define A2A_GPU_HANDLERS(prefix, Backend)                                                               \
  A2A_GPU_HANDLER(prefix##DispatchSend, &::a2a::ffi_gpu::Handlers<Backend>::dispatch_send)              \
  A2A_GPU_HANDLER(prefix##DispatchRecv, &::a2a::ffi_gpu::Handlers<Backend>::dispatch_recv)              \
  A2A_GPU_HANDLER(prefix##CombineSend, &::a2a::ffi_gpu::Handlers<Backend>::combine_send)                \
  A2A_GPU_HANDLER(prefix##CombineRecv, &::a2a::ffi_gpu::Handlers<Backend>::combine_recv)                \
  A2A_GPU_HANDLER(prefix##LocalDispatch, &::a2a::ffi_gpu::Handlers<Backend>::local_dispatch)            \
  A2A_GPU_HANDLER(prefix##LocalCombine, &::a2a::ffi_gpu::Handlers<Backend>::local_combine)
