"""cuda backend communicators (cc/cuda)"""

from collections.abc import Sequence

import jax_moe_a2a._C


def create(comm_id: int, config: jax_moe_a2a._C.Config, ranks: Sequence[int], devices: Sequence[int], group: int = 0, first_local_index: int = 0) -> None:
    """
    Creates EP group `group` of the communicator for this process's ranks of it (ranks within the group, one device each; first_local_index: how many ranks of this process earlier groups hold). With 0 < config.node_size < num_ranks, ranks r // node_size share a node and peers on other nodes go through a proxy thread and the TransferEngine over config.provider.
    """

def remote_info(comm_id: int, rank: int, group: int = 0) -> object:
    """
    (engine address, [descriptors], provider) of a rank's inter-node path, or None.
    """

def connect_remote(comm_id: int, rank: int, peers: Sequence[tuple[int, bytes, Sequence[bytes]]], group: int = 0) -> None:
    """
    Connects a rank's inter-node path: [(rank, address, descriptors)] of every rank of its EP group.
    """

def proxy_stats(comm_id: int, rank: int, group: int = 0) -> dict:
    """
    Counters of a rank's proxy thread (zeros without one); flag_path: 'gdrcopy' or 'mapped-host: <why>'; row_path: 'host', 'copy' or 'device' (JAX_MOE_A2A_STAGING); rails: the engine's domains (JAX_MOE_A2A_RAILS; unset: 2 with copy rows, else 1); staged_bytes, staging_ns, staging_busy_ns: what the copy path's row copies moved, how long they took (summed) and their wall time (any in flight).
    """

def bootstrap_info(comm_id: int, rank: int, group: int = 0) -> bytes: ...

def connect(comm_id: int, rank: int, peers: Sequence[bytes], group: int = 0) -> None: ...

def buffer_bytes(config: jax_moe_a2a._C.Config) -> int:
    """
    Device memory bytes one rank's communicator allocates (all slots): the shared_* and private_* regions.
    """

def buffer_regions(config: jax_moe_a2a._C.Config) -> dict:
    """
    {region: bytes per rank, all slots}: device memory (shared_*, private_*) and, with peers on other nodes, the inter-node path's pinned host buffers (remote_*).
    """

def destroy(comm_id: int) -> None: ...

def kernel_ms(comm_id: int, rank: int, op: int, group: int = 0) -> float:
    """
    Milliseconds of the last timed launch of op (0 dispatch_send .. 3 combine_recv) on a local rank; negative when none was timed (JAX_MOE_A2A_KERNEL_TIMING=1 not set, or the launch was captured in a command buffer).
    """

def last_error(comm_id: int) -> str:
    """Timeouts recorded by this process's kernels ("" if none)."""
