"""Which (token, k) pairs of one rank exist: the routing rule every backend and the oracle share
(jax_moe_a2a/oracle.py spells it in NumPy). No other module of ours."""

from __future__ import annotations

import jax.numpy as jnp


def routed_pairs(spec, topk_ids, num_tokens):
    """Which (token, k) pairs exist. Returns (routed [T,K] bool, bad [T,K] bool).

    routed: t < num_tokens, 0 <= id < E, and id not repeated earlier in the token's row.
    bad:    t < num_tokens, id != -1 and not routed (counted as dropped).
    """
    t_count, k = topk_ids.shape
    active = (jnp.arange(t_count) < num_tokens)[:, None]
    in_range = (topk_ids >= 0) & (topk_ids < spec.num_experts)
    earlier = jnp.tril(jnp.ones((k, k), bool), -1)  # [k, k'] k' < k
    dup = jnp.any((topk_ids[:, :, None] == topk_ids[:, None, :]) & earlier[None], axis=-1)
    routed = active & in_range & ~dup
    bad = active & (topk_ids != -1) & ~routed
    return routed, bad
