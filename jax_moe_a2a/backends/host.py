"""`host` backend: the route-exchange protocol of the EFA design, run by C++ on CPU devices
(cc/host) over the TransferEngine: in-process copies between devices of one process, libfabric
(`shm`, `tcp;ofi_rxm`, ...) between processes. The four halves are XLA FFI calls."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .. import _ffi, env, runtime
from ..errors import PeerFailure
from ..groups import ep_groups, local_members
from .base import group_index
from .ffi import FfiBackend, native_reason


def unavailable_reason():
    return native_reason("built_with_libfabric",
                         "the extension was built without libfabric (install libfabric-dev and rebuild)", "host", "cpu")


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

    @classmethod
    def transport(cls, opts, n):
        """max_private_tokens (-1: all), engine (local in one process, else fabric), provider
        ($JAX_MOE_A2A_PROVIDER, else shm), proxied ($JAX_MOE_A2A_HOST_PROXIED), node_size
        (proxied only; 0: no two ranks share a node)."""
        priv = opts.get("max_private_tokens")
        if priv is not None and (int(priv) < 0):
            raise ValueError(f"max_private_tokens: expected >= 0, got {priv}")
        engine = opts.get("engine") or ("local" if jax.process_count() == 1 else "fabric")
        provider = opts.get("provider") or env.get_str("PROVIDER", "shm")
        proxied = bool(opts.get("proxied", env.get_bool("HOST_PROXIED")))
        node_size = int(opts.get("node_size") or 0)  # proxied: ranks r // node_size share a node
        if node_size and not proxied:
            raise ValueError("host backend: node_size needs proxied=True")
        return dict(max_private_tokens=-1 if priv is None else int(priv), engine=engine, provider=provider,
                    proxied=proxied, node_size=node_size)

    # ---- setup ---------------------------------------------------------------------------
    def open(self, config, mesh, axis, comm_id):
        """Creates this process's ranks in C++ and connects each to every rank of its EP group
        (collective). Every EP group (one per position along the mesh's other axes) is a
        communicator of its own in C++: its own engines (knowing only the group's ranks),
        buffers and bootstrap keys."""
        n = config.num_ranks
        if config.slots > 8 or config.tp_size > 8:
            raise ValueError("host backend: Spec.slots and Spec.tp_size must be <= 8")
        for d in mesh.devices.flat:
            if d.platform != "cpu":
                raise ValueError(f"host backend: mesh device {d} is not a CPU device")
        c = _ffi.require_native()
        _ffi.register_targets()
        _, groups = ep_groups(mesh, axis)
        self.config, self.comm_id, self.num_groups = config, comm_id, len(groups)
        self.members = local_members(groups)
        self.provider = config.provider
        self._closed = False  # close() destroys every group, also if one fails here
        native = config.native()
        for g, local in self.members.items():
            c.host.create(comm_id, native, local, group=g)
        # Groups in ascending order on every process: a group's exchange waits only for processes
        # that finished their lower groups, and its engines' connections only on lower ranks.
        for g, local in self.members.items():
            prefix = f"jax_moe_a2a/host/{comm_id}" + (f"/group{g}" if len(groups) > 1 else "")
            self.provider = runtime.connect_engines(
                prefix, {r: c.host.bootstrap_info(comm_id, r, g) for r in local}, n, config.timeout_s,
                lambda r, peers, g=g: c.host.connect(comm_id, r, peers, g), config.provider)

    def close(self):
        if not getattr(self, "_closed", True):
            self._closed = True
            _ffi.require_native().host.destroy(self.comm_id)  # every group

    # ---- elastic EP recovery (docs/protocol.md "Recovery") ---------------------------------
    def recover(self, alive):
        """Every local EP group rejoins the survivors `alive` ([N] int, 1 = survivor) after a peer
        failure (collective over the survivors; docs/protocol.md "Recovery")."""
        if self.config.proxied:
            raise NotImplementedError("recover() is not supported by the host backend with proxied=True: the "
                                      "proxy thread waits for every rank (use the inline mode, proxied=False)")
        c = _ffi.require_native()
        for g in self.members:  # ascending on every process, as at open
            c.host.recover(self.comm_id, [int(v) for v in alive], g)

    def last_error(self):
        """A `PeerFailure` (message, missing ranks) after a half failed, until recover; else None."""
        c = _ffi.require_native()
        texts, missing = [], set()
        for g in self.members:
            got = c.host.last_error(self.comm_id, g)
            if got is not None:
                texts.append(got[0])
                missing.update(got[1])
        return PeerFailure(texts[0], missing) if texts else None

    def proxy_stats(self):
        """Counters of this process's proxy threads (proxied mode): {rank: dict}, or {(group, rank):
        dict} on a mesh with several EP groups; {} inline (no proxy threads). flag_path says where
        the proxy's flags live ("mapped-host: <why GDRCopy is not used>" here)."""
        if not self.config.proxied:
            return {}
        c = _ffi.require_native()
        return {((g, r) if self.num_groups > 1 else r): dict(c.host.proxy_stats(self.comm_id, r, g))
                for g, local in sorted(self.members.items()) for r in local}

    def diagnostics(self):
        return {"engine": self.config.engine, "provider": self.provider, "proxied": self.config.proxied,
                "node_size": self.config.node_size}

    def buffer_regions(self, config):
        return dict(_ffi.require_native().host.buffer_regions(config.native()))

    # ---- FfiBackend hooks: the CPU handlers take the rank and its EP group as operands ---
    def _rank(self, ctx):
        return (ctx.rank.reshape(()), group_index(ctx))

    def _counts_shape(self, spec, n):
        return (n,)

    def _combine_send_routing(self, p):
        return (p.recv_src, p.recv_slot, p.recv_counts)

    # ---- elastic EP: the rank mask is the last operand of every half (all ones without one) ---
    def rank_mask_unsupported(self):
        if getattr(self, "config", None) is not None and self.config.proxied:
            return "proxied=True (the proxy thread waits for every rank); use the inline mode (proxied=False)"
        return None

    def _mask_operands(self, ctx, rank_mask):
        if rank_mask is None:
            return (jnp.ones((ctx.num_ranks,), jnp.int32),)
        return (rank_mask.astype(jnp.int32),)
