"""
jax_moe_a2a native extension: XLA FFI handlers (CPU and, when compiled, CUDA).
"""

from jax_moe_a2a._C import (
    cuda as cuda,
    host as host,
    nvshmem as nvshmem,
    proxy as proxy,
    transfer as transfer
)


def cpu_targets() -> dict:
    """FFI handlers for the 'cpu' platform: {target name: capsule}."""

def cuda_targets() -> dict:
    """
    FFI handlers for the 'CUDA' platform: {target name: capsule}; empty without nvcc at build time.
    """

def built_with_libfabric() -> bool: ...

def built_with_cuda() -> bool: ...

def built_with_nvshmem() -> bool: ...
