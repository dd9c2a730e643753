"""`cuda` backend: one kernel per half on NVIDIA GPUs (docs/gpu_kernels.md); peers inside a node write
straight into each other's library-owned buffers (CUDA IPC between processes, plain pointers
with peer access inside one process). Peers on other nodes (option `node_size`) go through a
proxy thread per rank and the TransferEngine: the kernels pack and unpack pinned host memory that
the proxy moves (cc/cuda/remote.cuh, cc/proxy). See cc/cuda and docs/protocol.md.

Every FFI call only launches kernels on XLA's stream (command-buffer compatible)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from .. import _ffi, env, runtime
from ..groups import ep_groups, local_members
from .ffi import FfiBackend, native_reason


def unavailable_reason():
    return native_reason("built_with_cuda", "the extension was built without nvcc", "cuda", "gpu")


class CudaBackend(FfiBackend):
    name = "cuda"
    target = "cuda"
    debug_psum = False  # see Backend.debug_psum
    local_path = True   # EP = 1: one kernel per op (FfiBackend, cc/gpu/local)
    dequantizes_on_recv = True  # Spec.recv_dtype: the receive kernels write dequantised rows (cc/gpu/dequant.cuh)
    OPTIONS = {
        "node_size": "ranks r, s share a node iff r // node_size == s // node_size (default every rank, or "
                     "$JAX_MOE_A2A_NODE_SIZE); other nodes' peers go through a proxy thread",
        "max_private_tokens": "rows each remote sender may write before the counts arrive (default all, or "
                              "$JAX_MOE_A2A_MAX_PRIVATE_TOKENS)",
        "provider": "libfabric provider for remote peers (default $JAX_MOE_A2A_PROVIDER, else shm)",
    }

    @staticmethod
    def _native(c):
        """The extension's submodule of this backend (communicators, buffer sizes, errors)."""
        return c.cuda

    def rank_mask_unsupported(self):
        # The kernels leave masked ranks out of every wait and write (cc/gpu/mask.cuh); the
        # inter-node proxy does not (it waits for every remote rank).
        config = getattr(self, "config", None)
        if config is not None and config.node_size < config.num_ranks:
            return (f"node_size={config.node_size} < {config.num_ranks} ranks: the inter-node proxy waits for "
                    "every remote rank; use node_size = the EP size, or the host backend")
        return None

    def _mask_operands(self, ctx, rank_mask):
        # every half's last operand: the mask [N] int32, or empty (no mask: the kernels load nothing)
        if rank_mask is None:
            return (jnp.zeros((0,), jnp.int32),)
        return (rank_mask.astype(jnp.int32),)

    def _gpu_devices(self, mesh):
        """The mesh's devices, after checking they are GPUs (Config.build checked the rank count)."""
        devices = list(mesh.devices.flat)
        for d in devices:
            if d.platform != "gpu":
                raise ValueError(f"{self.name} backend: mesh device {d} is not a GPU")
        return devices

    # Dynamic shared memory a block may take without opting in: every block of dispatch_recv and
    # combine_send holds the receive arrangement, 4 * (3 E + 3 L + N + 2) bytes (cc/gpu/arrange.cuh).
    SMEM_BYTES = 48 * 1024

    @classmethod
    def check_shape(cls, spec, n):
        """ValueError past the kernels' limits: at most 64 ranks, and the receive arrangement within
        a block's shared memory (about 4,000 experts). `spec`: a Spec or a Config."""
        if n > 64:
            raise ValueError(f"{cls.name} backend: at most 64 ranks, got {n}")
        L = spec.num_experts // n
        need = 4 * (3 * spec.num_experts + 3 * L + n + 2)
        if need > cls.SMEM_BYTES:
            raise ValueError(f"{cls.name} backend: num_experts={spec.num_experts} on {n} ranks needs {need} bytes of "
                             f"shared memory per block for the receive arrangement, more than {cls.SMEM_BYTES}")

    @classmethod
    def transport(cls, opts, n):
        """node_size (ranks r // node_size share a node; default: all ranks, or
        $JAX_MOE_A2A_NODE_SIZE; at most n), max_private_tokens (rows per remote sender written
        before the counts arrive; default all (-1), or $JAX_MOE_A2A_MAX_PRIVATE_TOKENS) and
        provider ($JAX_MOE_A2A_PROVIDER, default shm) of the inter-node path."""
        node_size = opts.get("node_size")
        if node_size is None:
            node_size = env.get_int("NODE_SIZE", 0) or n
        if isinstance(node_size, bool) or not isinstance(node_size, (int, np.integer)) or node_size < 1:
            raise ValueError(f"node_size: expected a positive int, got {node_size!r}")
        priv = opts.get("max_private_tokens", env.get_int("MAX_PRIVATE_TOKENS"))
        if priv is not None and int(priv) < 0:
            raise ValueError(f"max_private_tokens: expected >= 0, got {priv}")
        provider = opts.get("provider") or env.get_str("PROVIDER", "shm")
        return dict(node_size=min(int(node_size), n), max_private_tokens=-1 if priv is None else int(priv),
                    provider=provider)

    def open(self, config, mesh, axis, comm_id):
        """Creates this process's ranks and connects each to the ranks of its EP group. Every EP
        group (one per position along the mesh's other axes) is a communicator of its own in C++
        (buffers, IPC exchange, proxy and engines); the handlers find theirs by device."""
        n = config.num_ranks
        self.check_shape(config, n)
        self._gpu_devices(mesh)
        c = _ffi.require_native()
        _ffi.register_targets()
        remote = config.node_size < n
        if remote and not hasattr(c.cuda, "connect_remote"):
            raise ValueError(f"cuda backend: node_size={config.node_size} puts peers on other nodes, which needs the "
                             "TransferEngine: rebuild the extension with libfabric")
        self.config, self.comm_id = config, comm_id
        _, groups = ep_groups(mesh, axis)
        self.num_groups = len(groups)
        self.members = local_members(groups)
        self.provider = config.provider
        self._closed = False
        native = config.native()
        first = 0  # this process's ranks in earlier groups (the proxies' local index goes on counting)
        for g, local in self.members.items():
            c.cuda.create(comm_id, native, local, [groups[g][r].local_hardware_id for r in local], group=g,
                          first_local_index=first)
            first += len(local)
        for g, local in self.members.items():  # ascending on every process (see HostBackend.open)
            mine = {r: bytes(c.cuda.bootstrap_info(comm_id, r, g)) for r in local}
            table = runtime.exchange(f"jax_moe_a2a/cuda/{self._group_key(g)}", mine, n, config.timeout_s)
            for r in local:
                c.cuda.connect(comm_id, r, [table[i] for i in range(n)], g)
        if remote:  # every rank has peers on another node: exchange engine addresses and regions
            for g, local in self.members.items():
                self.provider = runtime.connect_engines(
                    f"jax_moe_a2a/cuda-remote/{self._group_key(g)}",
                    {r: c.cuda.remote_info(comm_id, r, g) for r in local}, n, config.timeout_s,
                    lambda r, peers, g=g: c.cuda.connect_remote(comm_id, r, peers, g), config.provider)

    def _group_key(self, g):
        """Key-value store prefix part of EP group g (the communicator id alone with one group)."""
        return f"{self.comm_id}" + (f"/group{g}" if self.num_groups > 1 else "")

    @staticmethod
    def _group_arg(g):
        """The group argument of the native per-rank calls (nvshmem has one rank per process and
        finds it by communicator id alone)."""
        return (g,)

    def _local(self):
        """[(group, rank)] of this process's ranks, ascending."""
        return [(g, r) for g, ranks in self.members.items() for r in ranks]

    def proxy_stats(self):
        """Counters of this process's proxy threads ({rank: dict}, or {(group, rank): dict} on a
        mesh with several EP groups); {} without remote peers."""
        if self.config.node_size >= self.config.num_ranks:
            return {}
        c = _ffi.require_native()
        return {(r if self.num_groups == 1 else (g, r)): dict(c.cuda.proxy_stats(self.comm_id, r, g))
                for g, r in self._local()}

    def last_error(self):
        """What a kernel recorded when a peer never arrived (or the proxy's failure), or None."""
        text = self._native(_ffi.require_native()).last_error(self.comm_id)
        return text or None

    def kernel_seconds(self, half):
        """Seconds the last kernel of `half` (e.g. "dispatch_send") took on the slowest local rank,
        from CUDA events recorded around the launch when JAX_MOE_A2A_KERNEL_TIMING=1 was set at
        init; None when not recorded (timing off, or the launch was inside a command buffer)."""
        op = ("dispatch_send", "dispatch_recv", "combine_send", "combine_recv").index(half)
        native = self._native(_ffi.require_native())
        if not hasattr(native, "kernel_ms"):  # a subclass backend without kernel timing
            return None
        ms = [native.kernel_ms(self.comm_id, r, op, *self._group_arg(g)) for g, r in self._local()]
        if ms and min(ms) < 0 and op in (1, 2) and self.uses_local_path(self.config.num_ranks):
            return 0.0  # EP = 1: the dispatch and combine kernels are timed as dispatch_send and combine_recv
        return None if not ms or min(ms) < 0 else max(ms) * 1e-3

    def diagnostics(self):
        return {"node_size": self.config.node_size, "provider": self.provider,
                "local_path": self.uses_local_path(self.config.num_ranks)}

    def close(self):
        if not getattr(self, "_closed", True):
            self._closed = True
            self._native(_ffi.require_native()).destroy(self.comm_id)  # every group

    def buffer_regions(self, config):
        return dict(self._native(_ffi.require_native()).buffer_regions(config.native()))

    def buffer_bytes(self, config):
        """Device memory per rank (all slots; the cuda backend's remote_* pinned host buffers are
        reported by buffer_regions but not counted here)."""
        return int(self._native(_ffi.require_native()).buffer_bytes(config.native()))

    # ---- FfiBackend hooks: the device ordinal names the rank; counts are [N, L + 1] --------
    def _counts_shape(self, spec, n):
        # per source: rows for each local expert, then where our rows start in the source's
        # combine region (the rows it sends lower ranks; cc/gpu/params.h counts_stride)
        return (n, spec.local_experts(n) + 1)

    def _combine_send_routing(self, p):
        return (p.recv_counts,)

    def _dest_counts_shape(self, n):
        return (0,)  # the GPU handlers' dest_counts (cc/ffi/gpu_handlers.h), empty: not counted here
