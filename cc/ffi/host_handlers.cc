// FFI handlers of the `host` backend (CPU). Decode buffers, validate, forward to cc/host.
// They block (recv halves wait for peers), so they are not command-buffer compatible.
#include <exception>
#include <string>

#include "ffi/common.h"
#include "ffi/handlers.h"
#include "host/host_comm.h"
#include "transfer/errors.h"
#include "transfer/post_timeout.h"

namespace ffi = xla::ffi;
using a2a::ElemKind;

namespace {

// Runs one half; exceptions become FFI errors naming the op (timeouts: DEADLINE_EXCEEDED) and
// mark the communicator unusable.
// `rank` and `group` are the leading operands of every half: the rank within its EP group
// (jax.lax.axis_index of the EP axis) and the group's index (of the other mesh axes; 0 on a mesh
// without others). Every group runs the same HLO; the pair names this call's RankComm.
// The rank mask (elastic EP): the last operand of every half, int32 [N] (1 = alive; all ones
// without a mask). The Python backend passes exactly N entries (RankComm reads N).
bool mask_ok(const ffi::Buffer<ffi::S32>& m) { return m.dimensions().size() == 1 && m.element_count() >= 1; }

template <typename F>
ffi::Error run(const char* op, int64_t comm_id, ffi::Buffer<ffi::S32> rank_buf, ffi::Buffer<ffi::S32> group_buf,
               F&& f) {
  const int rank = rank_buf.typed_data()[0];
  const int group = group_buf.typed_data()[0];
  std::shared_ptr<a2a::host::HostComm> comm;
  try {
    comm = a2a::host::find_comm(comm_id, group);
    comm->check_usable();
    a2a::host::RankComm& rc = comm->rank(rank);
    // A write to a peer that takes none (its process is gone) fails within the op's timeout and
    // names that peer, as a wait for it does (not after the engine's 30 s post timeout). The bound
    // is this thread's: in proxied mode the proxy thread posts the rows and keeps post_timeout_s
    // (its own timeout names the missing peers).
    a2a::transfer::PostTimeout bound(rc.timeout_s());
    f(rc);
    return ffi::Error::Success();
  } catch (const a2a::transfer::TimeoutError& e) {
    if (comm) comm->fail(e.what(), e.missing);
    return ffi::Error(ffi::ErrorCode::kDeadlineExceeded, e.what());
  } catch (const std::exception& e) {
    if (comm) comm->fail(std::string(op) + ": " + e.what());
    return ffi::Error(ffi::ErrorCode::kInternal, std::string("jax_moe_a2a host ") + op + " (rank " +
                                                     std::to_string(rank) +
                                                     (group ? ", EP group " + std::to_string(group) : "") +
                                                     "): " + e.what());
  }
}

ffi::Error DispatchSend(ffi::Buffer<ffi::S32> rank, ffi::Buffer<ffi::S32> group, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> x_scale,
                        ffi::Buffer<ffi::S32> ids, ffi::Buffer<ffi::F32> weights,
                        ffi::Buffer<ffi::S32> num_tokens, ffi::AnyBuffer after, ffi::Buffer<ffi::S32> rank_mask,
                        ffi::Result<ffi::Buffer<ffi::S32>> handle, ffi::Result<ffi::Buffer<ffi::S32>> dest,
                        ffi::Result<ffi::Buffer<ffi::S32>> pair_slot, ffi::Result<ffi::Buffer<ffi::S32>> dropped,
                        int64_t comm_id, int32_t slot, int64_t call_id) {
  // call_id: distinct per call site so that XLA never merges two sends. after: any array this
  // send must follow (XLA orders custom calls only by data), never read.
  (void)call_id;
  (void)after;
  a2a::host::DispatchSendArgs a{};
  if (!a2a::ffi_util::elem_kind_of(x.element_type(), &a.x_kind)) return a2a::ffi_util::invalid("host dispatch_send: x dtype");
  a.x = x.untyped_data();
  a.x_scale = x_scale.element_count() ? x_scale.typed_data() : nullptr;
  a.ids = ids.typed_data();
  a.weights = weights.typed_data();
  a.num_tokens = num_tokens.typed_data()[0];
  a.slot = slot;
  a.handle = handle->typed_data();
  a.dest = dest->typed_data();
  a.pair_slot = pair_slot->typed_data();
  a.dropped = dropped->typed_data();
  a.alive = rank_mask.typed_data();
  if (!mask_ok(rank_mask)) return a2a::ffi_util::invalid("host dispatch_send: rank_mask must be int32 [N]");
  return run("dispatch_send", comm_id, rank, group, [&](a2a::host::RankComm& c) { c.dispatch_send(a); });
}

ffi::Error DispatchRecv(ffi::Buffer<ffi::S32> rank, ffi::Buffer<ffi::S32> group, ffi::Buffer<ffi::S32> handle,
                        ffi::Buffer<ffi::S32> rank_mask, ffi::Result<ffi::AnyBuffer> x,
                        ffi::Result<ffi::Buffer<ffi::F32>> scale, ffi::Result<ffi::Buffer<ffi::S32>> group_sizes,
                        ffi::Result<ffi::Buffer<ffi::F32>> weights, ffi::Result<ffi::Buffer<ffi::S32>> src,
                        ffi::Result<ffi::Buffer<ffi::S32>> recv_slot, ffi::Result<ffi::Buffer<ffi::S32>> recv_counts,
                        ffi::Result<ffi::Buffer<ffi::S32>> overflow, int64_t comm_id, int32_t slot) {
  a2a::host::DispatchRecvArgs a{};
  a.handle = handle.typed_data();
  a.slot = slot;
  a.x = x->untyped_data();
  a.scale = scale->element_count() ? scale->typed_data() : nullptr;
  a.group_sizes = group_sizes->typed_data();
  a.weights = weights->typed_data();
  a.src = src->typed_data();
  a.recv_slot = recv_slot->typed_data();
  a.recv_counts = recv_counts->typed_data();
  a.overflow = overflow->typed_data();
  a.alive = rank_mask.typed_data();
  if (!mask_ok(rank_mask)) return a2a::ffi_util::invalid("host dispatch_recv: rank_mask must be int32 [N]");
  return run("dispatch_recv", comm_id, rank, group, [&](a2a::host::RankComm& c) { c.dispatch_recv(a); });
}

ffi::Error CombineSend(ffi::Buffer<ffi::S32> rank, ffi::Buffer<ffi::S32> group, ffi::AnyBuffer y, ffi::Buffer<ffi::S32> src,
                       ffi::Buffer<ffi::S32> recv_slot, ffi::Buffer<ffi::S32> recv_counts, ffi::AnyBuffer after,
                       ffi::Buffer<ffi::S32> rank_mask, ffi::Result<ffi::Buffer<ffi::S32>> handle, int64_t comm_id,
                       int32_t slot, int32_t from_slot, int64_t call_id) {
  (void)call_id;
  (void)after;
  a2a::host::CombineSendArgs a{};
  if (!a2a::ffi_util::elem_kind_of(y.element_type(), &a.y_kind) || a.y_kind == ElemKind::kF8E4M3)
    return a2a::ffi_util::invalid("host combine_send: y must be bf16, f16 or f32");
  a.y = y.untyped_data();
  a.recv_src = src.typed_data();
  a.recv_src_stride = 2;
  a.recv_slot = recv_slot.typed_data();
  a.recv_counts = recv_counts.typed_data();
  a.slot = slot;
  a.from_slot = from_slot;
  a.handle = handle->typed_data();
  a.alive = rank_mask.typed_data();
  if (!mask_ok(rank_mask)) return a2a::ffi_util::invalid("host combine_send: rank_mask must be int32 [N]");
  return run("combine_send", comm_id, rank, group, [&](a2a::host::RankComm& c) { c.combine_send(a); });
}

ffi::Error CombineRecv(ffi::Buffer<ffi::S32> rank, ffi::Buffer<ffi::S32> group, ffi::Buffer<ffi::S32> handle, ffi::Buffer<ffi::S32> dest,
                       ffi::Buffer<ffi::S32> pair_slot, ffi::Buffer<ffi::F32> weights,
                       ffi::Buffer<ffi::S32> num_tokens, ffi::AnyBuffer out_in, ffi::Buffer<ffi::S32> rank_mask,
                       ffi::Result<ffi::AnyBuffer> out,
                       ffi::Result<ffi::Buffer<ffi::F32>> pairs, int64_t comm_id, int32_t slot, ElemKind y_kind) {
  a2a::host::CombineRecvArgs a{};
  a.handle = handle.typed_data();
  a.y_kind = y_kind;
  a.dest = dest.typed_data();
  a.pair_slot = pair_slot.typed_data();
  a.weights = weights.typed_data();
  a.num_tokens = num_tokens.typed_data()[0];
  a.out_in = out_in.element_count() ? out_in.untyped_data() : nullptr;
  if (a.out_in && !a2a::ffi_util::elem_kind_of(out_in.element_type(), &a.out_in_kind))
    return a2a::ffi_util::invalid("host combine_recv: out dtype");
  if (!a2a::ffi_util::elem_kind_of(out->element_type(), &a.out_kind)) return a2a::ffi_util::invalid("host combine_recv: result dtype");
  a.out = out->untyped_data();
  a.pairs = pairs->element_count() ? pairs->typed_data() : nullptr;
  a.slot = slot;
  a.alive = rank_mask.typed_data();
  if (!mask_ok(rank_mask)) return a2a::ffi_util::invalid("host combine_recv: rank_mask must be int32 [N]");
  return run("combine_recv", comm_id, rank, group, [&](a2a::host::RankComm& c) { c.combine_recv(a); });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(A2aHostDispatchSend, DispatchSend,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()  // rank within the EP group
                                  .Arg<ffi::Buffer<ffi::S32>>()  // EP group
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()  // rank mask [N] (elastic EP)
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("comm_id")
                                  .Attr<int32_t>("slot")
                                  .Attr<int64_t>("call_id"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(A2aHostDispatchRecv, DispatchRecv,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()  // rank within the EP group
                                  .Arg<ffi::Buffer<ffi::S32>>()  // EP group
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()  // rank mask [N] (elastic EP)
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("comm_id")
                                  .Attr<int32_t>("slot"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(A2aHostCombineSend, CombineSend,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()  // rank within the EP group
                                  .Arg<ffi::Buffer<ffi::S32>>()  // EP group
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()  // rank mask [N] (elastic EP)
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("comm_id")
                                  .Attr<int32_t>("slot")
                                  .Attr<int32_t>("from_slot")  // the dispatch's slot
                                  .Attr<int64_t>("call_id"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(A2aHostCombineRecv, CombineRecv,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()  // rank within the EP group
                                  .Arg<ffi::Buffer<ffi::S32>>()  // EP group
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()  // rank mask [N] (elastic EP)
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("comm_id")
                                  .Attr<int32_t>("slot")
                                  .Attr<ElemKind>("y_kind"));
