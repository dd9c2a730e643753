"""nvshmem backend: runtime and communicators (cc/nvshmem)"""

from collections.abc import Sequence

import jax_moe_a2a._C


def status() -> int:
    """
    nvshmemx_init_status(): 0 none, 1 bootstrapped, 2 initialised, 3/4 MPG.
    """

def status_name(arg: int, /) -> str: ...

def unique_id() -> bytes:
    """
    A fresh 128-byte NVSHMEM unique id (made by one process, read by the others).
    """

def ensure_initialized(pe: int, npes: int, uid: bytes, device: int) -> int:
    """
    Initialises NVSHMEM once per process by unique id (or attaches to a runtime already up); returns the status.
    """

def my_pe() -> int: ...

def n_pes() -> int: ...

def arena_size() -> int:
    """
    Bytes of this process's symmetric arena (0 before the first communicator).
    """

def create(comm_id: int, config: jax_moe_a2a._C.Config, rank: int, device: int, arena_bytes: int, all_remote: bool = False) -> None:
    """
    Collective over every PE (a host barrier, and the arena's nvshmem_malloc the first time). all_remote: every other rank takes the remote path ($JAX_MOE_A2A_NVSHMEM_REMOTE=all).
    """

def remote_peers(comm_id: int) -> list[int]:
    """
    The ranks that take the remote path (combine rows through the bounce rows), after connect.
    """

def bounce_bytes(comm_id: int) -> int:
    """
    Arena bytes of the bounce rows this rank took at connect (all slots): 0 when no peer is remote.
    """

def bootstrap_info(arg: int, /) -> bytes: ...

def connect(arg0: int, arg1: Sequence[bytes], /) -> None: ...

def buffer_bytes(config: jax_moe_a2a._C.Config) -> int:
    """
    Symmetric heap bytes one rank's communicator takes (all slots): the sum of buffer_regions.
    """

def buffer_regions(config: jax_moe_a2a._C.Config) -> dict:
    """
    {region: bytes per rank, all slots} of the communicator's symmetric block.
    """

def destroy(comm_id: int) -> None: ...

def kernel_ms(comm_id: int, rank: int, op: int) -> float:
    """
    Milliseconds of the last timed launch of op (0 dispatch_send .. 3 combine_recv) of this process's rank; negative when none was timed (JAX_MOE_A2A_KERNEL_TIMING=1 not set at create, or the launch was captured in a command buffer).
    """

def last_error(comm_id: int) -> str:
    """A timeout recorded by this process's kernels ("" if none)."""
