"""Loads the native extension and registers its XLA FFI targets for `cpu` and `CUDA` (once)."""

from __future__ import annotations

import functools

import jax

try:  # the extension is optional at import time so that pure-JAX parts work from a source tree
    from . import _C  # type: ignore[attr-defined]
    _IMPORT_ERROR = None
except ImportError as e:  # pragma: no cover - exercised only without a build
    _C = None
    _IMPORT_ERROR = e


def native_available() -> bool:
    return _C is not None


def require_native():
    """Returns the extension module or raises a RuntimeError that says how to build it."""
    if _C is None:
        raise RuntimeError(
            "jax_moe_a2a's native extension is not built (import failed: "
            f"{_IMPORT_ERROR}). Install with `pip install --no-build-isolation .`")
    return _C


@functools.lru_cache(maxsize=None)
def register_targets() -> dict:
    """Registers every FFI handler with XLA; returns {platform: [target names]}."""
    c = require_native()
    done = {}
    for platform, table in (("cpu", c.cpu_targets()), ("CUDA", c.cuda_targets())):
        for name, capsule in table.items():
            jax.ffi.register_ffi_target(name, capsule, platform=platform)
        done[platform] = sorted(table)
    return done


def built_with_cuda() -> bool:
    return bool(_C is not None and _C.built_with_cuda())


def built_with_libfabric() -> bool:
    return bool(_C is not None and _C.built_with_libfabric())


def built_with_nvshmem() -> bool:
    return bool(_C is not None and _C.built_with_nvshmem())
