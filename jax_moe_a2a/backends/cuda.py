"""`cuda` backend: one kernel per half on NVIDIA GPUs (docs/gpu_kernels.md); peers inside a node write
straight into each other's library-owned buffers (CUDA IPC between processes, plain pointers
with peer access inside one process). Peers on other nodes (option `node_size`) go through a
proxy thread per rank and the TransferEngine: the kernels pack and unpack pinned host memory that
the proxy moves (cc/cuda/remote.cuh, cc/proxy). See cc/cuda and docs/protocol.md.

Every FFI call only launches kernels on XLA's stream (command-buffer compatible)."""

from __future__ import annotations

import weakref

import numpy as np

from .. import _ffi, env, runtime
from .ffi import WIRE, FfiBackend, native_reason


def unavailable_reason():
    return native_reason("built_with_cuda", "the extension was built without nvcc", "cuda", "gpu")


class CudaBackend(FfiBackend):
    name = "cuda"
    target = "cuda"
    debug_psum = False  # see Backend.debug_psum
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
        # The kernels wait for every rank's counts and flags: a mask would still hang on a dead peer.
        return ("its kernels wait for every rank (a dead peer still ends the op at timeout_s); use the host "
                "backend, or leave rank_mask out (an all-alive constant mask is accepted)")

    def _gpu_mesh(self, comm):
        """The mesh's devices, after checking they are GPUs (check_shape checked the rank count)."""
        devices = list(comm.mesh.devices.flat)
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
        a block's shared memory (about 4,000 experts)."""
        if n > 64:
            raise ValueError(f"{cls.name} backend: at most 64 ranks, got {n}")
        L = spec.num_experts // n
        need = 4 * (3 * spec.num_experts + 3 * L + n + 2)
        if need > cls.SMEM_BYTES:
            raise ValueError(f"{cls.name} backend: num_experts={spec.num_experts} on {n} ranks needs {need} bytes of "
                             f"shared memory per block for the receive arrangement, more than {cls.SMEM_BYTES}")

    def init(self, comm):
        """Creates this process's ranks and connects each to the ranks of its EP group. Every EP
        group (one per position along the mesh's other axes) is a communicator of its own in C++
        (buffers, IPC exchange, proxy and engines); the handlers find theirs by device."""
        spec, n = comm.spec, comm.num_ranks
        self.check_shape(spec, n)
        self._gpu_mesh(comm)
        node_size, priv, provider = self._remote_options(comm, n)
        c = _ffi.require_native()
        _ffi.register_targets()
        remote = node_size < n
        if remote and not hasattr(c.cuda, "connect_remote"):
            raise ValueError(f"cuda backend: node_size={node_size} puts peers on other nodes, which needs the "
                             "TransferEngine: rebuild the extension with libfabric")
        self._finalizer = weakref.finalize(comm, c.cuda.destroy, comm.comm_id)  # every group
        members = comm.local_members()
        first = 0  # this process's ranks in earlier groups (the proxies' local index goes on counting)
        for g, local in members.items():
            devices = comm.groups[g]
            c.cuda.create(comm.comm_id, n, spec.num_experts, spec.experts_per_token, spec.hidden,
                          spec.max_tokens_per_rank, spec.tp_size, spec.num_scales, spec.scale_block,
                          WIRE[spec.dispatch_dtype], 0 if spec.layout == "ragged" else 1, spec.recv_rows(n),
                          spec.pow2_scale, spec.slots, comm.timeout_s, local,
                          [devices[r].local_hardware_id for r in local], node_size if remote else 0,
                          -1 if priv is None else priv, provider, group=g, first_local_index=first)
            first += len(local)
        for g, local in members.items():  # ascending on every process (see HostBackend.init)
            key = self._group_key(comm, g)
            mine = {r: bytes(c.cuda.bootstrap_info(comm.comm_id, r, g)) for r in local}
            table = runtime.exchange(f"jax_moe_a2a/cuda/{key}", mine, n, comm.timeout_s)
            for r in local:
                c.cuda.connect(comm.comm_id, r, [table[i] for i in range(n)], g)
        self.node_size = node_size
        self.provider = provider
        if remote:  # every rank has peers on another node: exchange engine addresses and regions
            for g, local in members.items():
                self.provider = runtime.connect_engines(
                    f"jax_moe_a2a/cuda-remote/{self._group_key(comm, g)}",
                    {r: c.cuda.remote_info(comm.comm_id, r, g) for r in local}, n, comm.timeout_s,
                    lambda r, peers, g=g: c.cuda.connect_remote(comm.comm_id, r, peers, g), provider)

    @staticmethod
    def _group_key(comm, g):
        """Key-value store prefix part of EP group g (the communicator id alone with one group)."""
        return f"{comm.comm_id}" + (f"/group{g}" if comm.num_groups > 1 else "")

    @staticmethod
    def _group_arg(g):
        """The group argument of the native per-rank calls (nvshmem has one rank per process and
        finds it by communicator id alone)."""
        return (g,)

    @staticmethod
    def _local(comm):
        """[(group, rank)] of this process's ranks, ascending."""
        return [(g, r) for g, ranks in comm.local_members().items() for r in ranks]

    @staticmethod
    def _remote_options(comm, n):
        """node_size (ranks r // node_size share a node; default: all ranks, or
        $JAX_MOE_A2A_NODE_SIZE), max_private_tokens (rows per remote sender written before the
        counts arrive; default all, or $JAX_MOE_A2A_MAX_PRIVATE_TOKENS) and provider
        ($JAX_MOE_A2A_PROVIDER, default shm) of the inter-node path."""
        opts = comm.options
        node_size = opts.get("node_size")
        if node_size is None:
            node_size = env.get_int("NODE_SIZE", 0) or n
        if isinstance(node_size, bool) or not isinstance(node_size, (int, np.integer)) or node_size < 1:
            raise ValueError(f"node_size: expected a positive int, got {node_size!r}")
        node_size = min(int(node_size), n)
        priv = opts.get("max_private_tokens", env.get_int("MAX_PRIVATE_TOKENS"))
        if priv is not None and int(priv) < 0:
            raise ValueError(f"max_private_tokens: expected >= 0, got {priv}")
        provider = opts.get("provider") or env.get_str("PROVIDER", "shm")
        return node_size, None if priv is None else int(priv), provider

    def proxy_stats(self, comm):
        """Counters of this process's proxy threads ({rank: dict}, or {(group, rank): dict} on a
        mesh with several EP groups); {} without remote peers."""
        c = _ffi.require_native()
        if getattr(self, "node_size", comm.num_ranks) >= comm.num_ranks:
            return {}
        return {(r if comm.num_groups == 1 else (g, r)): dict(c.cuda.proxy_stats(comm.comm_id, r, g))
                for g, r in self._local(comm)}

    def last_error(self, comm):
        """What a kernel recorded when a peer never arrived (or the proxy's failure), or None."""
        text = self._native(_ffi.require_native()).last_error(comm.comm_id)
        return text or None

    def kernel_seconds(self, comm, half):
        """Seconds the last kernel of `half` (e.g. "dispatch_send") took on the slowest local rank,
        from CUDA events recorded around the launch when JAX_MOE_A2A_KERNEL_TIMING=1 was set at
        init; None when not recorded (timing off, or the launch was inside a command buffer)."""
        op = ("dispatch_send", "dispatch_recv", "combine_send", "combine_recv").index(half)
        native = self._native(_ffi.require_native())
        if not hasattr(native, "kernel_ms"):  # a subclass backend without kernel timing
            return None
        ms = [native.kernel_ms(comm.comm_id, r, op, *self._group_arg(g)) for g, r in self._local(comm)]
        return None if not ms or min(ms) < 0 else max(ms) * 1e-3

    def close(self):
        if getattr(self, "_finalizer", None) is not None:
            self._finalizer()

    def buffer_bytes(self, spec, num_ranks):
        c = _ffi.require_native()
        return int(self._native(c).buffer_bytes(num_ranks, spec.num_experts, spec.experts_per_token, spec.hidden,
                                       spec.max_tokens_per_rank, spec.tp_size, spec.num_scales,
                                       WIRE[spec.dispatch_dtype], spec.slots))

    # ---- FfiBackend hooks: the device ordinal names the rank; counts are [N, L] ------------
    def _counts_shape(self, spec, n):
        return (n, spec.local_experts(n))

    def _combine_send_routing(self, a):
        return (a["recv_counts"],)
