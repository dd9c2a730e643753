"""`host` backend: the route-exchange protocol of the EFA design, run by C++ on CPU devices
(cc/host) over the TransferEngine: in-process copies between devices of one process, libfabric
(`shm`, `tcp;ofi_rxm`, ...) between processes. The four halves are XLA FFI calls."""

from __future__ import annotations

import os
import weakref

import jax
import jax.numpy as jnp
import numpy as np

from .. import _ffi, runtime
from .base import Backend, Ctx, finish_recv, recv_result_shapes, varying

_WIRE = {np.dtype(jnp.float32): 0, np.dtype(jnp.bfloat16): 1, np.dtype(jnp.float16): 2,
         np.dtype(jnp.float8_e4m3fn): 3}


def unavailable_reason():
    if not _ffi.native_available():
        return "the native extension is not built"
    if not _ffi.built_with_libfabric():
        return "the extension was built without libfabric (install libfabric-dev and rebuild)"
    if jax.default_backend() != "cpu":
        return f"the host backend runs on CPU devices (default backend here: {jax.default_backend()})"
    return None


def _after(after):
    """The ordering operand of the send halves: any array (never read), or an empty one."""
    return jnp.zeros((0,), jnp.int32) if after is None else after


def _layout_bytes(spec, n, priv_rows):
    """Buffer bytes per rank and slot, mirroring cc/host/host_comm.cc SlotLayout."""
    pad = lambda b: (b + 15) // 16 * 16
    l_count = spec.local_experts(n)
    p = spec.rows_per_peer(n)
    priv = p if priv_rows is None else min(priv_rows, p)
    row = pad(spec.hidden * spec.dispatch_dtype.itemsize + 4 * spec.num_scales + 8)
    d_recv = pad(n * n * l_count * 4) + n * priv * row + n * (p - priv) * row
    d_send = pad(n * l_count * 4) + n * p * row
    c_send = n * p * spec.hidden * 4
    c_recv = n * spec.tp_size * p * spec.hidden * 4
    return d_recv + d_send + c_send + c_recv


class HostBackend(Backend):
    name = "host"

    def __init__(self):
        self._priv_rows = None

    # ---- setup ---------------------------------------------------------------------------
    def init(self, comm):
        """Creates this process's ranks in C++ and connects them to every rank (collective)."""
        spec, n = comm.spec, comm.num_ranks
        if spec.slots > 8 or spec.tp_size > 8:
            raise ValueError("host backend: Spec.slots and Spec.tp_size must be <= 8")
        for d in comm.mesh.devices.flat:
            if d.platform != "cpu":
                raise ValueError(f"host backend: mesh device {d} is not a CPU device")
        opts = comm.options
        priv = opts.get("max_private_tokens")
        if priv is not None and (int(priv) < 0):
            raise ValueError(f"max_private_tokens: expected >= 0, got {priv}")
        self._priv_rows = None if priv is None else int(priv)
        devices = list(comm.mesh.devices.flat)
        me = jax.process_index()
        local = [r for r, d in enumerate(devices) if d.process_index == me]
        engine = opts.get("engine") or ("local" if jax.process_count() == 1 else "fabric")
        provider = opts.get("provider") or os.environ.get("JAX_MOE_A2A_PROVIDER", "shm")
        c = _ffi.require_native()
        _ffi.register_targets()
        c.host.create(comm.comm_id, n, spec.num_experts, spec.experts_per_token, spec.hidden,
                      spec.max_tokens_per_rank, spec.tp_size, spec.num_scales, spec.scale_block,
                      _WIRE[spec.dispatch_dtype], 0 if spec.layout == "ragged" else 1, spec.recv_rows(n),
                      spec.pow2_scale, spec.slots, -1 if priv is None else int(priv), comm.timeout_s,
                      local, engine, provider)
        self._finalizer = weakref.finalize(comm, c.host.destroy, comm.comm_id)
        info = {r: c.host.bootstrap_info(comm.comm_id, r) for r in local}
        self.provider = next(iter(info.values()))[2] if info else provider
        mine = {r: (bytes(addr), [bytes(d) for d in descs]) for r, (addr, descs, _) in info.items()}
        table = runtime.exchange(f"jax_moe_a2a/host/{comm.comm_id}", mine, n, comm.timeout_s)
        peers = [(r, table[r][0], list(table[r][1])) for r in range(n)]
        for r in local:
            c.host.connect(comm.comm_id, r, peers)

    def close(self):
        if getattr(self, "_finalizer", None) is not None:
            self._finalizer()  # runs destroy once

    def buffer_bytes(self, spec, num_ranks):
        return spec.slots * _layout_bytes(spec, num_ranks, self._priv_rows)

    # ---- the four halves -----------------------------------------------------------------
    def dispatch_send(self, ctx: Ctx, x, x_scale, topk_ids, topk_weights, num_tokens, slot, after=None):
        t, k = topk_ids.shape
        i32 = jnp.int32
        outs = (jax.ShapeDtypeStruct((2,), i32), jax.ShapeDtypeStruct((t, k), i32),
                jax.ShapeDtypeStruct((t, k), i32), jax.ShapeDtypeStruct((), i32))
        xs = x_scale if x_scale is not None else jnp.zeros((0,), jnp.float32)
        call = jax.ffi.ffi_call("jax_moe_a2a_host_dispatch_send", outs, has_side_effect=True)
        handle, dest, pair_slot, dropped = varying(call(
            ctx.rank.reshape(()), x, xs, topk_ids, topk_weights.astype(jnp.float32), num_tokens.reshape(()),
            _after(after), comm_id=np.int64(ctx.comm_id), slot=np.int32(slot), call_id=np.int64(ctx.call_id)), ctx.axis)
        return {"handle": handle}, {"dest": dest, "slot": pair_slot}, dropped

    def dispatch_recv(self, ctx: Ctx, arrays, route, slot):
        spec, n = ctx.spec, ctx.num_ranks
        call = jax.ffi.ffi_call("jax_moe_a2a_host_dispatch_recv", recv_result_shapes(spec, n, (n,)),
                                has_side_effect=True)
        outs = varying(call(ctx.rank.reshape(()), arrays["handle"], comm_id=np.int64(ctx.comm_id),
                            slot=np.int32(slot)), ctx.axis)
        return finish_recv(spec, n, outs, route)

    def combine_send(self, ctx: Ctx, y, route, slot, after=None):
        spec = ctx.spec
        a = route.arrays
        call = jax.ffi.ffi_call("jax_moe_a2a_host_combine_send", jax.ShapeDtypeStruct((2,), jnp.int32),
                                has_side_effect=True)
        handle = varying(call(ctx.rank.reshape(()), y.reshape(-1, spec.hidden), a["recv_src"], a["recv_slot"],
                              a["recv_counts"], _after(after), comm_id=np.int64(ctx.comm_id), slot=np.int32(slot),
                              call_id=np.int64(ctx.call_id)), ctx.axis)
        return {"handle": handle, "y_dtype": jnp.zeros((0,), y.dtype)}  # zero-size: carries y's dtype

    def combine_recv(self, ctx: Ctx, arrays, route, slot, out, pairs=False):
        spec = ctx.spec
        t, h, k = spec.max_tokens_per_rank, spec.hidden, spec.experts_per_token
        y_kind = _WIRE[np.dtype(arrays["y_dtype"].dtype)]
        out_in = out if out is not None else jnp.zeros((0,), spec.combine_dtype)
        outs = (jax.ShapeDtypeStruct((t, h), spec.combine_dtype),
                jax.ShapeDtypeStruct((t, k, h) if pairs else (0,), jnp.float32))
        call = jax.ffi.ffi_call("jax_moe_a2a_host_combine_recv", outs, has_side_effect=True)
        res, rows = varying(call(ctx.rank.reshape(()), arrays["handle"], route.arrays["dest"], route.arrays["slot"],
                                 route.topk_weights.astype(jnp.float32), route.num_tokens.reshape(()), out_in,
                                 comm_id=np.int64(ctx.comm_id), slot=np.int32(slot), y_kind=np.int32(y_kind)),
                            ctx.axis)
        return (res, rows) if pairs else res
