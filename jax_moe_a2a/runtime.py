"""Process-level runtime helpers: bootstrap data exchange through the JAX key-value store."""

from __future__ import annotations

import base64
import os
import pickle
from typing import Any, Dict, List, Optional

import jax

from . import env


def local_device_ids_from_env() -> Optional[List[int]]:
    """Local device ids for `jax.distributed.initialize` from JAX_MOE_A2A_LOCAL_DEVICE_IDS.

    "0" or "0,1": every process takes those devices (several processes sharing one GPU).
    "local_rank": one GPU per process, the process's node-local rank under Open MPI or Slurm.
    Unset: None (JAX decides)."""
    ids = env.get_str("LOCAL_DEVICE_IDS")
    if not ids:
        return None
    if ids == "local_rank":
        for var in ("OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID", "LOCAL_RANK"):
            if var in os.environ:
                return [int(os.environ[var])]
        raise RuntimeError("JAX_MOE_A2A_LOCAL_DEVICE_IDS=local_rank, but no local rank variable is set "
                           "(OMPI_COMM_WORLD_LOCAL_RANK, SLURM_LOCALID or LOCAL_RANK)")
    return [int(i) for i in ids.split(",")]


def kv_client():
    """The jax.distributed key-value store client (RuntimeError if not initialised).

    JAX has no public accessor for the client (jax 0.10, 0.11: `jax.distributed` exports
    initialize, is_initialized and shutdown only), so this is the one place that reads
    `jax._src.distributed`; everything else asks here."""
    if not jax.distributed.is_initialized():
        raise RuntimeError("jax_moe_a2a across processes needs jax.distributed.initialize() first")
    from jax._src import distributed
    return distributed.global_state.client


def forget_failed_effects():
    """Drops JAX's record of the runtime tokens of computations with effects (a host callback,
    e.g. `debug=True`'s check), as after a step that failed: JAX keeps the failed step's token and raises its
    error again from `jax.effects_barrier()` and at interpreter exit. No public API does this
    (jax.effects_barrier re-raises and keeps the token); a no-op if the internals moved."""
    try:
        from jax._src import dispatch
        dispatch.runtime_tokens.clear()
    except (ImportError, AttributeError):  # pragma: no cover - other JAX versions
        pass


def exchange(prefix: str, local: Dict[int, Any], num_ranks: int, timeout_s: float) -> Dict[int, Any]:
    """Every process publishes {rank: picklable value} for its ranks; returns all ranks' values.

    In one process nothing travels. Keys live under `prefix` (unique per communicator)."""
    if jax.process_count() == 1:
        missing = [r for r in range(num_ranks) if r not in local]
        if missing:
            raise ValueError(f"ranks {missing} have no bootstrap data in this single process")
        return dict(local)
    client = kv_client()
    for r, v in local.items():
        client.key_value_set(f"{prefix}/{r}", base64.b64encode(pickle.dumps(v)).decode())
    out = {}
    for r in range(num_ranks):
        blob = client.blocking_key_value_get(f"{prefix}/{r}", int(timeout_s * 1000))
        out[r] = pickle.loads(base64.b64decode(blob))
    return out


def connect_engines(prefix: str, info: Dict[int, Any], num_ranks: int, timeout_s: float, connect, provider: str) -> str:
    """Connects this process's ranks' TransferEngines to every rank (collective).

    info: {local rank: (engine address, [region descriptors], provider)} from the native side;
    connect(rank, peers) is called per local rank with [(rank, address, [descriptors])] of all
    ranks. Returns the provider the engines opened (`provider` when this process has no rank)."""
    mine = {r: (bytes(addr), [bytes(d) for d in descs]) for r, (addr, descs, _) in info.items()}
    table = exchange(prefix, mine, num_ranks, timeout_s)
    peers = [(r, table[r][0], list(table[r][1])) for r in range(num_ranks)]
    for r in sorted(info):  # ascending: the engines' connect_in_order waits only on lower ranks
        connect(r, peers)
    return next(iter(info.values()))[2] if info else provider
