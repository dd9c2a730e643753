"""Loads the native extension and registers its XLA FFI targets for `cpu` and `CUDA` (once)."""

from __future__ import annotations

import functools
import re
import warnings

import jax

try:  # the extension is optional at import time so that pure-JAX parts work from a source tree
    from . import _C  # type: ignore[attr-defined]
    _IMPORT_ERROR = None
except ImportError as e:  # pragma: no cover - exercised only without a build
    _C = None
    _IMPORT_ERROR = e

try:  # written by CMake next to _C: the jax/jaxlib and XLA FFI API version it was built against
    from . import _build_info  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - a source tree, or a build from before the file existed
    _build_info = None


def build_info() -> dict | None:
    """What the extension was built against (jax, jaxlib, XLA FFI API, CUDA compiler), or None."""
    if _build_info is None:
        return None
    return {k.lower(): getattr(_build_info, k) for k in
            ("JAX_VERSION", "JAXLIB_VERSION", "XLA_FFI_API_VERSION", "CUDA_COMPILER_VERSION")}


def _version_tuple(v: str) -> tuple:
    return tuple(int(x) for x in re.findall(r"\d+", v.split("+")[0])[:3])


def _jaxlib_mismatch() -> str | None:
    """A sentence when the running jaxlib is older than the one the extension was built against.

    XLA keeps accepting FFI handlers built against older FFI headers for at least 12 months
    (xla/ffi/api/c_api.h, "Version"): a newer jaxlib at run time is expected to work, an older one
    is not covered."""
    if _build_info is None:
        return None
    import jaxlib
    built, running = _build_info.JAXLIB_VERSION, jaxlib.__version__
    if _version_tuple(running) >= _version_tuple(built):
        return None
    return (f"jax_moe_a2a's extension was built against jaxlib {built} (XLA FFI API "
            f"{'.'.join(map(str, _build_info.XLA_FFI_API_VERSION))}) but jaxlib {running} is running; "
            "XLA's FFI guarantees only that newer runtimes accept handlers built with older headers. "
            "Rebuild against this jaxlib: pip install --no-build-isolation .")


_MISMATCH = _jaxlib_mismatch()
if _MISMATCH:
    warnings.warn(_MISMATCH, RuntimeWarning, stacklevel=2)


def native_available() -> bool:
    return _C is not None


def require_native():
    """Returns the extension module or raises a RuntimeError that says how to build it."""
    if _C is None:
        raise RuntimeError(
            "jax_moe_a2a's native extension is not built (import failed: "
            f"{_IMPORT_ERROR}). Install with `pip install --no-build-isolation .`"
            + (f" (it was built against jaxlib {_build_info.JAXLIB_VERSION})" if _build_info else ""))
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
