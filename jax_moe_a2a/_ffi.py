"""Loads the native extension and registers its XLA FFI targets for `cpu` and `CUDA` (once)."""

from __future__ import annotations

import functools
import importlib.machinery
import os
import re
import sys
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


def _source_checkout(pkg_dir: str) -> str | None:
    """The checkout's root when `pkg_dir` (this package's folder) is the source folder of a
    checkout, with no compiled extension beside __init__.py (pyproject.toml and cc/ beside it)."""
    root = os.path.dirname(pkg_dir)
    if os.path.isfile(os.path.join(root, "pyproject.toml")) and os.path.isdir(os.path.join(root, "cc")):
        return root
    return None


def _installed_elsewhere(root: str, path: list) -> str | None:
    """The folder of a jax_moe_a2a with a compiled _C found on `path` (sys.path) outside `root`."""
    real_root = os.path.realpath(root)
    others = [p for p in path if os.path.realpath(p or os.curdir) != real_root]
    spec = importlib.machinery.PathFinder.find_spec("jax_moe_a2a", others)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        if any(f.startswith("_C.") and f.endswith((".so", ".pyd")) for f in os.listdir(folder)):
            return folder
    return None


def shadowing(pkg_dir: str | None = None, path: list | None = None) -> str | None:
    """A sentence when the imported jax_moe_a2a is a source checkout without the extension (a
    script run from the checkout's root: its folder comes first on sys.path), naming the installed
    package with the extension that it hides, if any; None otherwise."""
    pkg_dir = os.path.dirname(os.path.abspath(__file__)) if pkg_dir is None else pkg_dir
    root = _source_checkout(pkg_dir)
    if root is None:
        return None
    installed = _installed_elsewhere(root, sys.path if path is None else path)
    if installed:
        where, todo = f"it hides the installed jax_moe_a2a at {installed}, which has it", ""
    else:
        where, todo = "no installed jax_moe_a2a with one is on sys.path either", "install it (pip install .) and "
    return (f"jax_moe_a2a was imported from the source checkout {pkg_dir}, which has no compiled "
            f"extension (_C), so only the reference backend is available; {where}. Python puts the "
            f"folder it runs from first on sys.path: {todo}run from outside the checkout's root "
            "(cd /tmp, or examples/, tests/).")


_SHADOWED = shadowing() if _C is None else None
if _SHADOWED:
    warnings.warn(_SHADOWED, RuntimeWarning, stacklevel=2)


def not_built_reason() -> str:
    """Why the native extension is unavailable (for error messages): shadowed, or not built (with
    the import error and how to build it)."""
    if _SHADOWED:
        return "the native extension is not importable here: " + _SHADOWED
    return ("the native extension is not built (import failed: "
            f"{_IMPORT_ERROR}). Install with `pip install .` (or `pip install --no-build-isolation .` "
            "to compile against the installed jaxlib)"
            + (f" (it was built against jaxlib {_build_info.JAXLIB_VERSION})" if _build_info else ""))


def native_available() -> bool:
    return _C is not None


def require_native():
    """Returns the extension module or raises a RuntimeError that says why it is missing and how
    to build it (`not_built_reason`)."""
    if _C is None:
        raise RuntimeError(f"jax_moe_a2a: {not_built_reason()}")
    return _C


@functools.lru_cache(maxsize=None)
def register_targets() -> dict:
    """Registers every FFI handler with XLA; returns {platform: [target names]}."""
    c = require_native()
    done = {}
    for platform, table in (("cpu", c.cpu_targets()), ("CUDA", c.cuda_targets())):
        for name, capsule in table.items():
            try:
                jax.ffi.register_ffi_target(name, capsule, platform=platform)
            except Exception as e:  # XLA refuses handlers whose FFI API version it no longer supports
                if "API version" not in str(e):
                    raise
                raise RuntimeError(_api_version_refused(e)) from e
        done[platform] = sorted(table)
    return done


def _api_version_refused(err: Exception) -> str:
    import jaxlib
    built = (f"jaxlib {_build_info.JAXLIB_VERSION}'s (XLA FFI API "
             f"{'.'.join(map(str, _build_info.XLA_FFI_API_VERSION))})" if _build_info else "another jaxlib's")
    return (f"jaxlib {jaxlib.__version__} refuses jax_moe_a2a's FFI handlers, which were compiled "
            f"against {built} FFI headers: {err}. Rebuild against the running jaxlib: "
            "pip install --no-build-isolation --force-reinstall --no-deps .")


def built_with_cuda() -> bool:
    return bool(_C is not None and _C.built_with_cuda())


def built_with_libfabric() -> bool:
    return bool(_C is not None and _C.built_with_libfabric())


def built_with_nvshmem() -> bool:
    return bool(_C is not None and _C.built_with_nvshmem())
