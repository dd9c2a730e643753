"""host backend communicators (cc/host)"""

from collections.abc import Sequence

import jax_moe_a2a._C


def create(comm_id: int, config: jax_moe_a2a._C.Config, local_ranks: Sequence[int], group: int = 0) -> None:
    """
    Creates EP group `group` of the communicator `comm_id` for this process's ranks of it (ranks within the group; config.engine 'local' or 'fabric', its engines know only the group's ranks); config.proxied: the protocol runs on a proxy thread per rank (cc/proxy), as in the cuda backend. Call once per group.
    """

def buffer_bytes(config: jax_moe_a2a._C.Config) -> int:
    """Buffer bytes one rank holds (all slots): the sum of buffer_regions."""

def buffer_regions(config: jax_moe_a2a._C.Config) -> dict:
    """{region: bytes per rank, all slots} of the host backend's buffers."""

def bootstrap_info(comm_id: int, rank: int, group: int = 0) -> tuple:
    """
    (engine address, [region descriptors], provider) of one local rank of EP group `group`.
    """

def connect(comm_id: int, rank: int, peers: Sequence[tuple[int, bytes, Sequence[bytes]]], group: int = 0) -> None:
    """
    Connects one local rank to every rank of its EP group: [(rank, address, descriptors)].
    """

def recover(comm_id: int, alive: Sequence[int], group: int = 0) -> None:
    """
    Elastic EP recovery of EP group `group` after a peer failure (every survivor, same mask; docs/protocol.md).
    """

def last_error(comm_id: int, group: int = 0) -> object:
    """
    (failure text, missing ranks) of EP group `group`, or None when usable.
    """

def destroy(comm_id: int) -> None:
    """Closes the engines and forgets the communicator (every EP group)."""

def proxy_stats(comm_id: int, rank: int, group: int = 0) -> dict:
    """
    Counters of a local rank's proxy thread in EP group `group` (proxied mode; zeros and flag_path '' without).
    """
