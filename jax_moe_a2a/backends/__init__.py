"""Backend registry: name -> factory, and which are usable in this process.

Every backend module is imported here (none needs more than JAX and the optional native
extension, which `_ffi` loads once); the registry is the top of the backends package."""

from __future__ import annotations

from typing import Callable, Dict

from . import cuda, host, nvshmem, ragged
from .base import Backend, Ctx  # noqa: F401
from .cuda import CudaBackend
from .host import HostBackend
from .nvshmem import NvshmemBackend
from .ragged import RaggedBackend
from .reference import ReferenceBackend

_FACTORIES: Dict[str, Callable[[], Backend]] = {}
_AVAILABLE: Dict[str, Callable[[], "str | None"]] = {}

# Every backend, best first (what available() lists).
ORDER = ("cuda", "nvshmem", "host", "reference", "ragged")
# What backend="auto" tries, first available wins. Never nvshmem: it needs one process per GPU
# (the cuda backend also drives several GPUs from one process) and has not run on a GPU yet; it is
# used only when named. Never ragged: a baseline (XLA's ragged-all-to-all), and absent on XLA:CPU.
AUTO_ORDER = ("cuda", "host", "reference")


def register(name: str, factory: Callable[[], Backend], unavailable_reason: Callable[[], "str | None"]):
    """Registers a backend, or replaces the one of that name; `unavailable_reason()` returns None
    when usable here, else why not. Returns the (factory, unavailable_reason) it replaced, or
    None: registering that pair again restores the previous backend."""
    previous = (_FACTORIES[name], _AVAILABLE[name]) if name in _FACTORIES else None
    _FACTORIES[name] = factory
    _AVAILABLE[name] = unavailable_reason
    return previous


def known() -> list:
    return list(_FACTORIES)


def why_unavailable(name: str) -> "str | None":
    if name not in _FACTORIES:
        return f"unknown backend {name!r} (known: {known()})"
    return _AVAILABLE[name]()


def available() -> list:
    """Backends usable in this process, in ORDER."""
    return [b for b in ORDER if b in _FACTORIES and _AVAILABLE[b]() is None]


def create(name: str) -> Backend:
    if name == "auto":
        avail = [b for b in available() if b in AUTO_ORDER]
        if not avail:
            raise RuntimeError("no jax_moe_a2a backend is available")
        name = avail[0]
    reason = why_unavailable(name)
    if reason is not None:
        raise ValueError(f"backend {name!r} is not available here: {reason}")
    return _FACTORIES[name]()


def backend_class(backend) -> type:
    """The Backend class of `backend`: a registered name (available here or not), a Backend class,
    or an instance."""
    if isinstance(backend, type) and issubclass(backend, Backend):
        return backend
    if isinstance(backend, Backend):
        return type(backend)
    if backend not in _FACTORIES:
        raise ValueError(f"unknown backend {backend!r} (known: {known()})")
    return type(_FACTORIES[backend]())


register("reference", ReferenceBackend, lambda: None)
register("cuda", CudaBackend, cuda.unavailable_reason)
register("nvshmem", NvshmemBackend, nvshmem.unavailable_reason)
register("host", HostBackend, host.unavailable_reason)
register("ragged", RaggedBackend, ragged.unavailable_reason)
