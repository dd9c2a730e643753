"""`nvshmem` backend: the portable NVSHMEM design (docs/gpu_kernels.md). Rows travel with
`nvshmemx_putmem_signal_nbi_warp` into a private region per (source, local expert) at every
receiver, counts and row metadata with one put-with-signal per destination, frees with
`nvshmemx_signal_op`; receivers wait on the signals with timeouts. See cc/nvshmem.

One process drives one GPU (one EP rank per process), and the mesh spans every JAX process (they
are the NVSHMEM PEs). NVSHMEM is initialised once per process, by a unique id carried through the
jax.distributed key-value store, or reused when something else in the process already initialised
it. Communicators take blocks of one symmetric arena allocated with the first one (its size:
JAX_MOE_A2A_NVSHMEM_ARENA bytes, default twice the first communicator's need and at least
256 MiB); NVSHMEM_SYMMETRIC_SIZE defaults to the arena plus 256 MiB for NVSHMEM itself.

Elastic EP: every half takes the rank mask as its last operand, like the cuda backend's; docs/api.md,
"Elastic EP".

Across nodes: every put reads symmetric memory (combine rows for peers that loads and stores
cannot reach go through bounce rows first) and every signal is an NVSHMEM signal operation, so
NVSHMEM's remote transports carry the same kernels; JAX_MOE_A2A_NVSHMEM_REMOTE=all takes that path
for every peer (docs/api.md, "NVSHMEM across nodes").

Every FFI call only launches kernels on XLA's stream (command-buffer compatible)."""

from __future__ import annotations

import base64
import os

import jax

from .. import _ffi, env, runtime
from ..groups import ep_groups, local_members
from .cuda import CudaBackend
from .ffi import native_reason

_MIB = 1 << 20
ARENA_MIN = 256 * _MIB
NVSHMEM_RESERVE = 256 * _MIB  # symmetric heap NVSHMEM keeps for itself (teams, barriers, signals)
_UID_KEY = "jax_moe_a2a/nvshmem/unique_id"


def unavailable_reason():
    return native_reason("built_with_nvshmem",
                         "the extension was built without NVSHMEM (needs nvcc and the nvidia-nvshmem-cu13 wheel)",
                         "nvshmem", "gpu")


def arena_bytes(need: int) -> int:
    """Arena size for a process whose first communicator needs `need` bytes."""
    size = env.get_int("NVSHMEM_ARENA") or max(2 * need, ARENA_MIN)
    return -(-size // (2 * _MIB)) * (2 * _MIB)


def start_runtime(c, device: int, arena: int, timeout_s: float) -> int:
    """Initialises NVSHMEM in this process once (PE = jax.process_index()), or attaches to a
    runtime already up; returns nvshmemx_init_status()."""
    nv = c.nvshmem
    if nv.status() != 0:
        return nv.ensure_initialized(0, 0, b"", device)  # reuse: only registers our device code
    os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", str(arena + NVSHMEM_RESERVE))
    if jax.process_count() == 1:
        uid = bytes(nv.unique_id())
    else:  # process 0 makes the id; the others read it from the key-value store
        client = runtime.kv_client()
        if jax.process_index() == 0:
            uid = bytes(nv.unique_id())
            client.key_value_set(_UID_KEY, base64.b64encode(uid).decode())
        else:
            uid = base64.b64decode(client.blocking_key_value_get(_UID_KEY, int(timeout_s * 1000)))
    return nv.ensure_initialized(jax.process_index(), jax.process_count(), uid, device)


class NvshmemBackend(CudaBackend):
    name = "nvshmem"
    target = "nvshmem"
    OPTIONS = {}  # none of the cuda backend's: NVSHMEM moves every byte

    @staticmethod
    def _native(c):
        return c.nvshmem

    @staticmethod
    def _group_arg(g):
        return ()

    @classmethod
    def transport(cls, opts, n):
        return {}  # NVSHMEM moves every byte: no transport options

    def open(self, config, mesh, axis, comm_id):
        n = config.num_ranks
        self.check_shape(config, n)
        devices = self._gpu_devices(mesh)
        if len({d.process_index for d in devices}) != jax.process_count():
            raise ValueError("nvshmem backend: the mesh must span every JAX process (they are the NVSHMEM PEs, and "
                             "creating a communicator is collective over all of them)")
        _, groups = ep_groups(mesh, axis)
        self.config, self.comm_id, self.num_groups = config, comm_id, len(groups)
        self.members = local_members(groups)
        self.provider = None
        local = self._local()
        if len(local) != 1:
            raise NotImplementedError(
                f"nvshmem backend: one process drives one GPU (one EP rank per process); this process holds "
                f"{'ranks ' + str([r for _, r in local]) if self.num_groups == 1 else '(group, rank) ' + str(local)}. "
                f"Launch one process per GPU, or use the cuda backend")
        # On a mesh with several EP groups every process is one rank of one group: its NvComm knows
        # only its group's PEs (bootstrap keys per group), and the handlers find it by comm id.
        group, rank = local[0]
        device = groups[group][rank].local_hardware_id
        c = _ffi.require_native()
        _ffi.register_targets()
        native = config.native()
        arena = arena_bytes(int(c.nvshmem.buffer_bytes(native)))
        start_runtime(c, device, arena, config.timeout_s)
        remote = env.get_str("NVSHMEM_REMOTE", "auto")
        if remote not in ("auto", "all"):
            raise ValueError(f"JAX_MOE_A2A_NVSHMEM_REMOTE: expected 'auto' or 'all', got {remote!r}")
        self._closed = False
        c.nvshmem.create(comm_id, native, rank, device, arena, all_remote=remote == "all")
        mine = {rank: bytes(c.nvshmem.bootstrap_info(comm_id))}
        table = runtime.exchange(f"jax_moe_a2a/nvshmem/{self._group_key(group)}", mine, n, config.timeout_s)
        c.nvshmem.connect(comm_id, [table[i] for i in range(n)])

    def _dest_counts_shape(self, n):
        # dispatch_send counts the rows each expert rank owes our combine_recv (its dest_counts,
        # cc/nvshmem/dispatch/send.cu); they travel in the placement, so a combine on another slot
        # than its dispatch has them too
        return (n,)

    def rank_mask_unsupported(self):
        # The kernels leave masked ranks out of every wait and put (cc/nvshmem/device.cuh; the mask
        # is every half's last operand, CudaBackend._mask_operands). The per-source row counters
        # (Signals::d_rows / c_rows, cumulative) stay in step: a masked rank that still runs puts
        # nothing and gets nothing, and a dead one stays masked (recover() is refused here). Remote
        # peers are reached by NVSHMEM puts too (no proxy), so unlike cuda no node_size condition
        # (this backend's Config leaves node_size at 0).
        return None

    def diagnostics(self):
        """local_path (EP = 1); remote_peers: the ranks this rank reaches by the remote path (bounce
        rows; every other rank under JAX_MOE_A2A_NVSHMEM_REMOTE=all); bounce_bytes: the symmetric
        memory those bounce rows took at init (0 without remote peers)."""
        c = _ffi.require_native()
        return {"local_path": self.uses_local_path(self.config.num_ranks),
                "remote_peers": list(c.nvshmem.remote_peers(self.comm_id)),
                "bounce_bytes": int(c.nvshmem.bounce_bytes(self.comm_id))}

    def proxy_stats(self):
        return {}  # no proxy threads
