"""Small shims over JAX versions."""

import jax

shard_map = getattr(jax, "shard_map", None)
if shard_map is None:  # pragma: no cover - older jax
    from jax.experimental.shard_map import shard_map
