"""Helpers of tests/test_transfer_engine.py: Open MPI rank/size and the KV-store bootstrap."""

import os

MPI_RANK = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
MPI_SIZE = int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1"))
PROVIDERS = ["shm", "tcp;ofi_rxm"]


def provider_iface(provider: str):
    """tcp stays on loopback in tests."""
    return "lo" if provider.startswith("tcp") else None


def ensure_distributed():
    """The jax.distributed KV client; initialises jax.distributed (Open MPI auto-detection) once."""
    import jax
    from jax_moe_a2a.runtime import kv_client
    if not jax.distributed.is_initialized():
        jax.distributed.initialize()
    return kv_client()


def connect(provider: str, name: str, **kwargs):
    """A Connection of every MPI rank, namespaced by `name` (the same on every rank)."""
    from jax_moe_a2a import transfer
    kv = ensure_distributed()
    return transfer.connect(provider, kv, rank=MPI_RANK, world_size=MPI_SIZE, name=name,
                            iface=provider_iface(provider), timeout_s=60, **kwargs)


def rank_bytes(rank: int, n: int, salt: int = 0):
    """Deterministic random bytes of `rank`: every rank can compute every other rank's data."""
    import numpy as np
    return np.random.default_rng([rank, salt, 12345]).integers(0, 256, n, dtype=np.uint8)
