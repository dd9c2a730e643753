"""
TransferEngine: libfabric RMA writes with immediate counters (no MoE knowledge).
"""

from collections.abc import Sequence
from typing import Annotated

from numpy.typing import NDArray


class TransferError(RuntimeError):
    pass

class TransferTimeoutError(TimeoutError):
    pass

class Region:
    """Local registered memory. `descriptor()` goes to the peers."""

    @property
    def address(self) -> int: ...

    @property
    def size(self) -> int: ...

    @property
    def owner(self) -> int: ...

    @property
    def memory(self) -> str: ...

    @property
    def closed(self) -> bool: ...

    def descriptor(self) -> bytes:
        """
        Serialised descriptor (bytes): address, size, owner rank, keys per domain.
        """

    def close(self) -> None:
        """Deregisters the memory (idempotent)."""

    def __repr__(self) -> str: ...

class RemoteRegion:
    """A peer's memory, from Engine.remote(descriptor)."""

    @property
    def owner(self) -> int: ...

    @property
    def size(self) -> int: ...

    @property
    def address(self) -> int: ...

    @property
    def memory(self) -> str: ...

    @property
    def num_domains(self) -> int: ...

    def descriptor(self) -> bytes: ...

    def __repr__(self) -> str: ...

class PeerGroup:
    """Peers of scatter/signal/barrier, with prepared requests."""

    @property
    def ranks(self) -> list[int]: ...

    def __len__(self) -> int: ...

    def __repr__(self) -> str: ...

class Engine:
    """
    Transfer engine: one-sided writes with 32-bit immediates, counted at the receiver.
    """

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def provider(self) -> str: ...

    @property
    def num_domains(self) -> int: ...

    @property
    def instance(self) -> int: ...

    @property
    def closed(self) -> bool: ...

    def address(self) -> bytes:
        """This rank's serialised address (bytes)."""

    def add_peers(self, peers: Sequence[tuple[int, bytes]]) -> None:
        """Adds [(rank, address bytes), ...]."""

    def connect_in_order(self, timeout_s: float) -> None:
        """
        Collective: the first write of every pair goes from the lower rank to the higher (avoids simultaneous connects on connection-oriented providers); see connect_order.h.
        """

    def peers(self) -> list[int]:
        """Known ranks (ourselves included)."""

    def register_array(self, array: Annotated[NDArray, dict(order='C', device='cpu')]) -> Region:
        """
        Registers a C-contiguous, writeable host array (kept alive by the region).
        """

    def register_ptr(self, ptr: int, size: int, memory: str = 'host', device: int = 0) -> Region:
        """
        Registers raw memory: memory='host' or 'cuda' (needs FI_HMEM). You keep it alive.
        """

    def remote(self, descriptor: bytes) -> RemoteRegion:
        """Validates a peer's descriptor; unknown/stale owners are refused."""

    def peer_group(self, ranks: Sequence[int]) -> PeerGroup: ...

    def write(self, peer: int, src: Region, src_offset: int, length: int, dst: RemoteRegion | None, dst_offset: int, imm: int) -> None: ...

    def write_on(self, rail: int, peer: int, src: Region, src_offset: int, length: int, dst: RemoteRegion | None, dst_offset: int, imm: int) -> None:
        """
        write() on rail `rail`: our domain rail % num_domains to the peer's domain rail % its num_domains.
        """

    def scatter(self, group: PeerGroup, src: Region, entries: object, imm: int) -> None:
        """
        entries: [(peer_index, src_offset, length, dst RemoteRegion | None, dst_offset)].
        """

    def signal(self, group: PeerGroup, imm: int) -> None: ...

    def barrier(self, group: PeerGroup, imm: int, timeout_s: float = 60.0) -> None: ...

    def barrier_ranked(self, group: PeerGroup, tag: int, epoch: int, timeout_s: float = 60.0) -> None: ...

    def wait(self, imm: int, n: int = 1, timeout_s: float = 60.0) -> None: ...

    def wait_ranks(self, tag: int, epoch: int, ranks: Sequence[int], timeout_s: float = 60.0) -> None: ...

    def count(self, imm: int) -> int:
        """Arrivals of imm not consumed yet."""

    def counts(self) -> dict:
        """{imm: unconsumed arrivals}."""

    def flush(self, timeout_s: float = 60.0) -> None: ...

    def pending(self) -> int: ...

    def close(self) -> None: ...

    def __enter__(self) -> object: ...

    def __exit__(self, arg0: object | None, arg1: object | None, arg2: object | None, /) -> None: ...

    def __repr__(self) -> str: ...

class FabricEngine(Engine):
    """The engine over libfabric RDM endpoints."""

    def __init__(self, provider: str = '', num_domains: int = 1, rank: int = 0, world_size: int = 1, iface: str = '', hmem: bool = False, post_timeout_s: float = 30.0) -> None:
        """
        provider '' -> $JAX_MOE_A2A_PROVIDER -> 'shm'; iface '' -> $JAX_MOE_A2A_IFACE (domain names, e.g. 'lo' for tcp on loopback).
        """

    def domain_names(self) -> list[str]: ...

    def mr_mode(self) -> int:
        """domain 0's FI_MR_* bits as reported by the provider."""

    def progress(self) -> int:
        """Polls the completion queues once (the progress thread does this too)."""

class LocalEngine(Engine):
    """Rank of an in-process hub (memcpy + counters)."""

def local_engines(world_size: int) -> list[LocalEngine]:
    """
    world_size in-process engines that know each other: [rank 0, rank 1, ...].
    """

def pack_imm(tag: int, epoch: int, rank: int) -> int:
    """
    tag (8 bits) | epoch (8 bits) | rank (16 bits) as one 32-bit immediate.
    """

def unpack_imm(imm: int) -> tuple[int, int, int]: ...

fabric_api_version: tuple = (1, 17)
