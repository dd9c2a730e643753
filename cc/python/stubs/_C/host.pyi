"""host backend communicators (cc/host)"""

from collections.abc import Sequence


def create(comm_id: int, num_ranks: int, num_experts: int, topk: int, hidden: int, max_tokens: int, tp: int, num_scales: int, scale_block: int, wire_kind: int, layout: int, capacity: int, pow2: bool, slots: int, priv_rows: int, timeout_s: float, local_ranks: Sequence[int], engine: str, provider: str, proxied: bool = False, node_size: int = 0, group: int = 0) -> None:
    """
    Creates EP group `group` of the communicator `comm_id` for this process's ranks of it (ranks within the group; engine 'local' or 'fabric', its engines know only the group's ranks); proxied: the protocol runs on a proxy thread per rank (cc/proxy), as in the cuda backend. Call once per group with local ranks.
    """

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

def proxy_stats(comm_id: int, rank: int) -> dict:
    """
    Counters of a local rank's proxy thread (proxied mode; zeros and flag_path '' without).
    """
