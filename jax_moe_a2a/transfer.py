"""TransferEngine from Python: one-sided RDMA-style writes with 32-bit immediates (libfabric).

The engine (C++, ``cc/transfer``) knows nothing about MoE. This module adds the bootstrap: every
rank's endpoint address and memory descriptors travel through the job's key-value store (the
``jax.distributed`` client, or :class:`DictKV` inside one process) and nothing else.

    conn = transfer.connect(provider="shm")          # collective over all processes
    buf = np.zeros(1 << 20, np.uint8)
    region = conn.register(buf)
    dst = conn.share(region)                          # [RemoteRegion of rank 0, 1, ...]
    group = conn.group()                              # every other rank
    e = conn.engine
    e.scatter(group, region, [(i, 0, 64, dst[r], 0) for i, r in enumerate(group.ranks)], imm=7)
    e.wait(7, len(group.ranks), timeout_s=5)          # everyone's 64 bytes have landed in buf

Immediates are counted per 32-bit value at the receiver, in any arrival order; ``pack_imm(tag,
epoch, rank)`` is the suggested layout (``wait_ranks`` / ``barrier_ranked`` name missing ranks).
See docs/transfer_engine.md.
"""

from __future__ import annotations

import base64
import itertools
import threading
from typing import Any, Protocol, Sequence

import numpy as np

try:
    from jax_moe_a2a._C import transfer as _native
except (ImportError, AttributeError):  # built without libfabric
    _native = None

__all__ = [
    "available", "connect", "Connection", "DictKV", "jax_kv", "local_engines", "pack_imm",
    "unpack_imm", "Engine", "FabricEngine", "LocalEngine", "Region", "RemoteRegion", "PeerGroup",
    "TransferError", "TransferTimeoutError",
]


def available() -> bool:
    """True when the extension was built with libfabric (the TransferEngine exists)."""
    return _native is not None


def _need_native():
    if _native is None:
        raise RuntimeError("jax_moe_a2a was built without libfabric: install libfabric-dev and "
                           "rebuild (pip install --no-build-isolation .) to use the TransferEngine")
    return _native


if _native is not None:
    Engine = _native.Engine
    FabricEngine = _native.FabricEngine
    LocalEngine = _native.LocalEngine
    Region = _native.Region
    RemoteRegion = _native.RemoteRegion
    PeerGroup = _native.PeerGroup
    TransferError = _native.TransferError
    TransferTimeoutError = _native.TransferTimeoutError
    pack_imm = _native.pack_imm
    unpack_imm = _native.unpack_imm
    local_engines = _native.local_engines
else:  # names exist so that imports work; using them raises
    Engine = FabricEngine = LocalEngine = Region = RemoteRegion = PeerGroup = None

    class TransferError(RuntimeError):
        pass

    class TransferTimeoutError(TimeoutError):
        pass

    def pack_imm(tag: int, epoch: int, rank: int) -> int:
        _need_native()

    def unpack_imm(imm: int):
        _need_native()

    def local_engines(world_size: int):
        _need_native()


class KeyValueStore(Protocol):
    """The two calls of the jax.distributed key-value client (`runtime.kv_client()`) that the bootstrap uses."""

    def key_value_set(self, key: str, value: str) -> None: ...

    def blocking_key_value_get(self, key: str, timeout_in_ms: int) -> str: ...


class DictKV:
    """In-process stand-in for the jax.distributed key-value store (threads may share one)."""

    def __init__(self):
        self._data: dict = {}
        self._cv = threading.Condition()

    def key_value_set(self, key: str, value: str) -> None:
        with self._cv:
            if key in self._data:
                raise ValueError(f"key {key!r} is already set")
            self._data[key] = value
            self._cv.notify_all()

    def blocking_key_value_get(self, key: str, timeout_in_ms: int) -> str:
        with self._cv:
            if not self._cv.wait_for(lambda: key in self._data, timeout_in_ms / 1000):
                raise TimeoutError(f"key {key!r} not set within {timeout_in_ms} ms")
            return self._data[key]


def jax_kv():
    """The jax.distributed key-value client, or None when jax.distributed is not initialised."""
    import jax
    if not jax.distributed.is_initialized():
        return None
    from .runtime import kv_client
    return kv_client()


_connect_seq = itertools.count()


def _check_array(array):
    """The array itself (never a copy): registered memory must be the caller's buffer."""
    if not isinstance(array, np.ndarray):
        raise TypeError(f"register: expected a numpy array, got {type(array).__name__}")
    if not array.flags.c_contiguous:
        raise ValueError("register: the array must be C-contiguous (a copy would be registered "
                         "instead of your buffer)")
    if not array.flags.writeable:
        raise ValueError("register: the array must be writeable (peers write into it)")
    if array.nbytes == 0:
        raise ValueError("register: empty array")
    return array


class Connection:
    """An engine plus the key-value store and namespace it was bootstrapped with."""

    def __init__(self, engine, kv: KeyValueStore, prefix: str, timeout_s: float):
        self.engine = engine
        self.kv = kv
        self.prefix = prefix
        self.timeout_s = timeout_s
        self._share_seq = itertools.count()
        self._regions: list = []

    @property
    def rank(self) -> int:
        return self.engine.rank

    @property
    def world_size(self) -> int:
        return self.engine.world_size

    def all_gather(self, name: str, value: bytes) -> list:
        """Every rank's bytes for `name` (collective: every rank calls it with the same name)."""
        key = f"{self.prefix}/{name}"
        self.kv.key_value_set(f"{key}/{self.rank}", base64.b64encode(value).decode("ascii"))
        ms = int(self.timeout_s * 1000)
        return [value if r == self.rank else
                base64.b64decode(self.kv.blocking_key_value_get(f"{key}/{r}", ms))
                for r in range(self.world_size)]

    def register(self, array: np.ndarray):
        """Registers a C-contiguous host array. The region (which keeps the array alive) stays
        registered until release(region) or close(), even if the caller drops it: peers may hold
        its descriptor."""
        region = self.engine.register_array(_check_array(array))
        self._regions.append(region)
        return region

    def release(self, region) -> None:
        """Deregisters a region obtained from register()."""
        region.close()
        self._regions = [r for r in self._regions if r is not region]

    def share(self, region, name: str | None = None) -> list:
        """Collective: every rank's descriptor of its `region`, validated: [RemoteRegion per rank]."""
        name = name if name is not None else f"region{next(self._share_seq)}"
        blobs = self.all_gather(f"region/{name}", region.descriptor())
        return [self.engine.remote(b) for b in blobs]

    def group(self, ranks: Sequence[int] | None = None, include_self: bool = False):
        """A peer group of `ranks` (default: every rank, ourselves only if include_self)."""
        if ranks is None:
            ranks = [r for r in range(self.world_size) if include_self or r != self.rank]
        return self.engine.peer_group(list(ranks))

    def close(self) -> None:
        self.engine.close()  # deregisters every region of the engine
        self._regions.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def connect(provider: str | None = None, kv: KeyValueStore | None = None, *,
            rank: int | None = None, world_size: int | None = None, num_domains: int = 1,
            iface: str | None = None, hmem: bool = False, name: str | None = None,
            timeout_s: float = 60.0) -> Connection:
    """Creates a FabricEngine on every process and connects them all (collective).

    provider: libfabric provider ("shm", "tcp;ofi_rxm", "verbs;ofi_rxm", "efa"); None reads
      $JAX_MOE_A2A_PROVIDER, default "shm".
    kv: key-value store; None uses the jax.distributed client (rank and world size then come from
      jax.process_index()/process_count()), or a private DictKV for a single process.
    iface: domain / interface names to use ("lo" keeps tcp on loopback); None reads
      $JAX_MOE_A2A_IFACE.
    name: namespace of the keys; default a per-process sequence number, so every process must call
      connect() in the same order.
    """
    native = _need_native()
    if kv is None:
        kv = jax_kv()
        if kv is not None:
            import jax
            rank = jax.process_index() if rank is None else rank
            world_size = jax.process_count() if world_size is None else world_size
        else:
            kv = DictKV()
    rank = 0 if rank is None else rank
    world_size = 1 if world_size is None else world_size
    seq = next(_connect_seq)
    prefix = f"jax_moe_a2a/transfer/{name if name is not None else f'connect{seq}'}"
    engine = native.FabricEngine(provider=provider or "", num_domains=num_domains, rank=rank,
                                 world_size=world_size, iface=iface or "", hmem=hmem)
    conn = Connection(engine, kv, prefix, timeout_s)
    try:
        addresses = conn.all_gather("address", engine.address())
        engine.add_peers(list(enumerate(addresses)))
        engine.connect_in_order(timeout_s)  # first writes one way only: no simultaneous connects
    except BaseException:
        engine.close()
        raise
    return conn


def describe(engine: Any) -> str:
    """One line for logs: provider, domains, rank."""
    names = engine.domain_names() if hasattr(engine, "domain_names") else []
    return f"{engine!r} domains {names}"
