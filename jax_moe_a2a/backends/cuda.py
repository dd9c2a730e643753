"""`cuda` backend: one cooperative kernel per half on NVIDIA GPUs; peers inside a node write
straight into each other's library-owned buffers (CUDA IPC between processes, plain pointers
with peer access inside one process). See cc/cuda and docs/protocol.md.

Every FFI call only launches kernels on XLA's stream (command-buffer compatible)."""

from __future__ import annotations

import weakref

import jax
import jax.numpy as jnp
import numpy as np

from .. import _ffi, runtime
from .base import Backend, Ctx, finish_recv, recv_result_shapes, varying
from .host import _WIRE, _after


def unavailable_reason():
    if not _ffi.native_available():
        return "the native extension is not built"
    if not _ffi.built_with_cuda():
        return "the extension was built without nvcc"
    if jax.default_backend() != "gpu":
        return f"the cuda backend runs on NVIDIA GPUs (default backend here: {jax.default_backend()})"
    return None


class CudaBackend(Backend):
    name = "cuda"

    def init(self, comm):
        spec, n = comm.spec, comm.num_ranks
        if n > 64:
            raise ValueError("cuda backend: at most 64 ranks")
        devices = list(comm.mesh.devices.flat)
        for d in devices:
            if d.platform != "gpu":
                raise ValueError(f"cuda backend: mesh device {d} is not a GPU")
        me = jax.process_index()
        local = [r for r, d in enumerate(devices) if d.process_index == me]
        c = _ffi.require_native()
        _ffi.register_targets()
        c.cuda.create(comm.comm_id, n, spec.num_experts, spec.experts_per_token, spec.hidden,
                      spec.max_tokens_per_rank, spec.tp_size, spec.num_scales, spec.scale_block,
                      _WIRE[spec.dispatch_dtype], 0 if spec.layout == "ragged" else 1, spec.recv_rows(n),
                      spec.pow2_scale, spec.slots, comm.timeout_s, local,
                      [devices[r].local_hardware_id for r in local])
        self._finalizer = weakref.finalize(comm, c.cuda.destroy, comm.comm_id)
        mine = {r: bytes(c.cuda.bootstrap_info(comm.comm_id, r)) for r in local}
        table = runtime.exchange(f"jax_moe_a2a/cuda/{comm.comm_id}", mine, n, comm.timeout_s)
        for r in local:
            c.cuda.connect(comm.comm_id, r, [table[i] for i in range(n)])

    def last_error(self, comm):
        """What a kernel recorded before trapping (a peer that never arrived), or None."""
        text = _ffi.require_native().cuda.last_error(comm.comm_id)
        return text or None

    def close(self):
        if getattr(self, "_finalizer", None) is not None:
            self._finalizer()

    def buffer_bytes(self, spec, num_ranks):
        c = _ffi.require_native()
        return int(c.cuda.buffer_bytes(num_ranks, spec.num_experts, spec.experts_per_token, spec.hidden,
                                       spec.max_tokens_per_rank, spec.tp_size, spec.num_scales,
                                       _WIRE[spec.dispatch_dtype], spec.slots))

    def dispatch_send(self, ctx: Ctx, x, x_scale, topk_ids, topk_weights, num_tokens, slot, after=None):
        t, k = topk_ids.shape
        i32 = jnp.int32
        outs = (jax.ShapeDtypeStruct((2,), i32), jax.ShapeDtypeStruct((t, k), i32),
                jax.ShapeDtypeStruct((t, k), i32), jax.ShapeDtypeStruct((), i32))
        xs = x_scale if x_scale is not None else jnp.zeros((0,), jnp.float32)
        call = jax.ffi.ffi_call("jax_moe_a2a_cuda_dispatch_send", outs, has_side_effect=True)
        handle, dest, pair_slot, dropped = varying(call(
            x, xs, topk_ids, topk_weights.astype(jnp.float32), num_tokens.reshape(()), _after(after),
            comm_id=np.int64(ctx.comm_id), slot=np.int32(slot), call_id=np.int64(ctx.call_id)), ctx.axis)
        return {"handle": handle}, {"dest": dest, "slot": pair_slot}, dropped

    def dispatch_recv(self, ctx: Ctx, arrays, route, slot):
        spec, n = ctx.spec, ctx.num_ranks
        call = jax.ffi.ffi_call("jax_moe_a2a_cuda_dispatch_recv",
                                recv_result_shapes(spec, n, (n, spec.local_experts(n))), has_side_effect=True)
        outs = varying(call(arrays["handle"], comm_id=np.int64(ctx.comm_id), slot=np.int32(slot)), ctx.axis)
        return finish_recv(spec, n, outs, route)

    def combine_send(self, ctx: Ctx, y, route, slot, after=None):
        spec = ctx.spec
        call = jax.ffi.ffi_call("jax_moe_a2a_cuda_combine_send", jax.ShapeDtypeStruct((2,), jnp.int32),
                                has_side_effect=True)
        handle = varying(call(y.reshape(-1, spec.hidden), route.arrays["recv_counts"], _after(after),
                              comm_id=np.int64(ctx.comm_id), slot=np.int32(slot), call_id=np.int64(ctx.call_id)),
                         ctx.axis)
        return {"handle": handle, "y_dtype": jnp.zeros((0,), y.dtype)}

    def combine_recv(self, ctx: Ctx, arrays, route, slot, out, pairs=False):
        spec = ctx.spec
        t, h, k = spec.max_tokens_per_rank, spec.hidden, spec.experts_per_token
        y_kind = _WIRE[np.dtype(arrays["y_dtype"].dtype)]
        out_in = out if out is not None else jnp.zeros((0,), spec.combine_dtype)
        outs = (jax.ShapeDtypeStruct((t, h), spec.combine_dtype),
                jax.ShapeDtypeStruct((t, k, h) if pairs else (0,), jnp.float32))
        call = jax.ffi.ffi_call("jax_moe_a2a_cuda_combine_recv", outs, has_side_effect=True)
        res, rows = varying(call(arrays["handle"], route.arrays["dest"], route.arrays["slot"],
                                 route.topk_weights.astype(jnp.float32), route.num_tokens.reshape(()), out_in,
                                 comm_id=np.int64(ctx.comm_id), slot=np.int32(slot), y_kind=np.int32(y_kind)),
                            ctx.axis)
        return (res, rows) if pairs else res
