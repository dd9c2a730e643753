"""`host` backend: the route-exchange protocol of the EFA design, run by C++ on CPU devices
(cc/host) over the TransferEngine: in-process copies between devices of one process, libfabric
(`shm`, `tcp;ofi_rxm`, ...) between processes. The four halves are XLA FFI calls."""

from __future__ import annotations

import weakref

import jax

from .. import _ffi, env, runtime
from .base import group_index
from .ffi import WIRE, FfiBackend, native_reason


def unavailable_reason():
    return native_reason("built_with_libfabric",
                         "the extension was built without libfabric (install libfabric-dev and rebuild)", "host", "cpu")


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


class HostBackend(FfiBackend):
    name = "host"
    target = "host"
    OPTIONS = {
        "max_private_tokens": "rows each sender may write before the counts arrive (default all; 0: every row "
                              "through the exact-offset overflow path)",
        "provider": "libfabric provider between processes (default $JAX_MOE_A2A_PROVIDER, else shm)",
        "engine": "'local' (one process) or 'fabric' (default: local in one process, else fabric)",
        "proxied": "run the protocol on a proxy thread per rank, as the cuda backend's inter-node path "
                   "(default $JAX_MOE_A2A_HOST_PROXIED, else off)",
        "node_size": "with proxied: ranks r // node_size share a node (default 0: none do)",
    }

    def __init__(self):
        self._priv_rows = None
        self._proxied = False

    # ---- setup ---------------------------------------------------------------------------
    def init(self, comm):
        """Creates this process's ranks in C++ and connects each to every rank of its EP group
        (collective). Every EP group (one per position along the mesh's other axes) is a
        communicator of its own in C++: its own engines (knowing only the group's ranks),
        buffers and bootstrap keys."""
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
        engine = opts.get("engine") or ("local" if jax.process_count() == 1 else "fabric")
        provider = opts.get("provider") or env.get_str("PROVIDER", "shm")
        proxied = bool(opts.get("proxied", env.get_bool("HOST_PROXIED")))
        node_size = int(opts.get("node_size") or 0)  # proxied: ranks r // node_size share a node
        if node_size and not proxied:
            raise ValueError("host backend: node_size needs proxied=True")
        self._proxied = proxied
        c = _ffi.require_native()
        _ffi.register_targets()
        self._finalizer = weakref.finalize(comm, c.host.destroy, comm.comm_id)  # every group, also if one fails
        self.provider = provider
        members = comm.local_members()
        for g, local in members.items():
            c.host.create(comm.comm_id, n, spec.num_experts, spec.experts_per_token, spec.hidden,
                          spec.max_tokens_per_rank, spec.tp_size, spec.num_scales, spec.scale_block,
                          WIRE[spec.dispatch_dtype], 0 if spec.layout == "ragged" else 1, spec.recv_rows(n),
                          spec.pow2_scale, spec.slots, -1 if priv is None else int(priv), comm.timeout_s,
                          local, engine, provider, proxied, node_size, group=g)
        # Groups in ascending order on every process: a group's exchange waits only for processes
        # that finished their lower groups, and its engines' connections only on lower ranks.
        for g, local in members.items():
            prefix = f"jax_moe_a2a/host/{comm.comm_id}" + (f"/group{g}" if comm.num_groups > 1 else "")
            self.provider = runtime.connect_engines(
                prefix, {r: c.host.bootstrap_info(comm.comm_id, r, g) for r in local}, n, comm.timeout_s,
                lambda r, peers, g=g: c.host.connect(comm.comm_id, r, peers, g), provider)

    def close(self):
        if getattr(self, "_finalizer", None) is not None:
            self._finalizer()  # runs destroy once

    # ---- elastic EP recovery (docs/protocol.md "Recovery") ---------------------------------
    def recover(self, comm, alive):
        if self._proxied:
            raise NotImplementedError("recover() is not supported by the host backend with proxied=True: the "
                                      "proxy thread waits for every rank (use the inline mode, proxied=False)")
        c = _ffi.require_native()
        for g in comm.local_members():  # ascending on every process, as at init
            c.host.recover(comm.comm_id, [int(v) for v in alive], g)

    def last_error(self, comm):
        from ..comm import PeerFailure
        c = _ffi.require_native()
        texts, missing = [], set()
        for g in comm.local_members():
            got = c.host.last_error(comm.comm_id, g)
            if got is not None:
                texts.append(got[0])
                missing.update(got[1])
        return PeerFailure(texts[0], missing) if texts else None

    def proxy_stats(self, comm):
        """Counters of this process's proxy threads ({rank: dict}, proxied mode); flag_path says
        where the proxy's flags live ("mapped-host: <why GDRCopy is not used>" here)."""
        c = _ffi.require_native()
        local = [r for r, d in enumerate(comm.mesh.devices.flat) if d.process_index == jax.process_index()]
        return {r: dict(c.host.proxy_stats(comm.comm_id, r)) for r in local}

    def buffer_bytes(self, spec, num_ranks):
        return spec.slots * _layout_bytes(spec, num_ranks, self._priv_rows)

    # ---- FfiBackend hooks: the CPU handlers take the rank and its EP group as operands ---
    def _rank(self, ctx):
        return (ctx.rank.reshape(()), group_index(ctx))

    def _counts_shape(self, spec, n):
        return (n,)

    def _combine_send_routing(self, a):
        return (a["recv_src"], a["recv_slot"], a["recv_counts"])

    # ---- elastic EP: the rank mask is the last operand of every half (all ones without one) ---
    def rank_mask_unsupported(self):
        if self._proxied:
            return "proxied=True (the proxy thread waits for every rank); use the inline mode (proxied=False)"
        return None

    def _mask_operands(self, ctx, rank_mask):
        import jax.numpy as jnp
        if rank_mask is None:
            return (jnp.ones((ctx.num_ranks,), jnp.int32),)
        return (rank_mask.astype(jnp.int32),)
