"""Redundant experts (EPLB): a logical -> physical expert map applied before dispatch.

`Spec.num_experts` is the number of PHYSICAL experts (what is spread over the ranks, L per
rank; physical expert p lives on rank p // L as local expert p % L). The router picks LOGICAL
experts; an `ExpertMap` says where each logical expert's replicas are. The map is a pytree of
two device arrays, so it can change between steps without recompiling (same shapes):

  physical: [E_logical, M] int32, replica j of logical expert e (M = max replicas; -1 = padding)
  counts:   [E_logical]    int32, replicas of e (entries past counts[e] are ignored)

Replica rule (deterministic, batch-invariant for a given (rank, token)): the pair (t, k) of the
rank `r` in DP group g = r // tp_size goes to

  replica = (g * T + t) mod counts[e],      physical id = physical[e, replica]

with T = Spec.max_tokens_per_rank. The rule does not depend on k, so a logical id repeated
within a token's row maps to one physical id twice and stays "repeated" (routed once, the rest
dropped and counted, as without a map); and tp members of one group (same tokens) pick the same
replicas. Consecutive tokens of a rank cycle through the replicas, which spreads a hot expert's
load evenly over them.

  -1                          stays -1 (not routed)
  logical id outside [0, E_logical)            -> physical E (out of range: dropped, counted)
  logical expert with counts 0                 -> physical E (dropped, counted)
  a chosen entry outside [0, E) (-1 padding within counts, bad ids) -> E (dropped, counted)

Rank mask (elastic EP, `rank_mask=` of dispatch): replica j of e is "dead" when its physical
expert lives on a masked rank (physical[e, j] // L with L = E / N). The pair then picks among
the entries of physical[e, :counts[e]] that are not dead (entries outside [0, E) count as not
dead, so an all-alive mask is exactly no mask):

  live = [physical[e, j] for j < counts[e] if not dead],  replica = live[(g * T + t) mod len(live)]

and when every replica is dead it takes the mask-free choice above, which lies on a masked rank:
the communicator then drops the pair and counts it as masked (`stats()['masked']`), not as a
bad id.

Replicas of different logical experts must be distinct physical experts (else two logical
experts of one token could land on one physical expert and one pair would be dropped as a
repeat, silently losing its contribution): `ExpertMap.from_replicas` refuses such maps. A map
built from device arrays directly is not checked on its values.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class ExpertMap:
    """Logical -> physical expert map (a pytree of two int32 arrays; see the module docstring).

    physical: [E_logical, M] int32 physical expert ids of each logical expert's replicas, -1 padded.
    counts:   [E_logical] int32 number of replicas of each logical expert (0 allowed: dropped).

    Pass it as an argument of the jitted step (shard_map in_spec `P()`, replicated), not as a
    closure constant, so that a new map of the same shapes reuses the compiled step.
    """

    physical: Any
    counts: Any

    @property
    def num_logical(self) -> int:
        return int(self.physical.shape[0])

    @property
    def max_replicas(self) -> int:
        return int(self.physical.shape[1])

    @classmethod
    def from_replicas(cls, replicas: Sequence[Sequence[int]], num_experts: Optional[int] = None,
                      max_replicas: Optional[int] = None) -> "ExpertMap":
        """replicas[e] = the physical expert ids of logical expert e (may be empty).

        num_experts: the physical expert count (Spec.num_experts), to check the ids' range.
        max_replicas: M, the padded width (default: the longest list). Keep it fixed across
          rebalances: a map of other shapes recompiles the step.
        Raises ValueError (naming `replicas` / `max_replicas`) for non-int or negative ids, ids
        >= num_experts, an id listed twice for one logical expert, or an id shared by two
        logical experts."""
        if isinstance(replicas, (str, bytes)) or not hasattr(replicas, "__len__"):
            raise ValueError(f"replicas: expected a list of lists of physical expert ids, got {type(replicas).__name__}")
        rows = []
        owner = {}
        for e, reps in enumerate(replicas):
            if isinstance(reps, (str, bytes)) or not hasattr(reps, "__iter__"):
                raise ValueError(f"replicas[{e}]: expected a list of physical expert ids, got {reps!r}")
            row = []
            for p in reps:
                if isinstance(p, bool) or not isinstance(p, (int, np.integer)) or p < 0:
                    raise ValueError(f"replicas[{e}]: physical expert ids must be ints >= 0, got {p!r}")
                p = int(p)
                if num_experts is not None and p >= num_experts:
                    raise ValueError(f"replicas[{e}]: physical expert {p} is out of range [0, {num_experts})")
                if p in owner:
                    other = owner[p]
                    what = "twice" if other == e else f"also by logical expert {other}"
                    raise ValueError(
                        f"replicas[{e}]: physical expert {p} is listed {what}; replicas of different logical "
                        f"experts must be distinct physical experts (a token routed to both would lose a pair)")
                owner[p] = e
                row.append(p)
            rows.append(row)
        if not rows:
            raise ValueError("replicas: expected at least one logical expert, got []")
        longest = max(len(r) for r in rows)
        m = max(longest, 1) if max_replicas is None else max_replicas
        if isinstance(m, bool) or not isinstance(m, (int, np.integer)) or m < max(longest, 1):
            raise ValueError(f"max_replicas: expected an int >= {max(longest, 1)} (the longest replica list), "
                             f"got {max_replicas!r}")
        phys = np.full((len(rows), int(m)), -1, np.int32)
        for e, row in enumerate(rows):
            phys[e, :len(row)] = row
        counts = np.array([len(r) for r in rows], np.int32)
        return cls(jnp.asarray(phys), jnp.asarray(counts))

    @classmethod
    def identity(cls, num_experts: int, max_replicas: int = 1) -> "ExpertMap":
        """Logical expert e is physical expert e (one replica): the same routing as no map."""
        if isinstance(num_experts, bool) or not isinstance(num_experts, (int, np.integer)) or num_experts <= 0:
            raise ValueError(f"num_experts: expected a positive int, got {num_experts!r}")
        return cls.from_replicas([[e] for e in range(int(num_experts))], num_experts, max_replicas)

    def to_replicas(self) -> list:
        """Host-side lists (the inverse of from_replicas); reads the arrays back."""
        phys, counts = np.asarray(self.physical), np.asarray(self.counts)
        return [[int(p) for p in phys[e, :max(0, min(int(counts[e]), phys.shape[1]))]] for e in range(phys.shape[0])]

    def logical_of(self, num_experts: int):
        """[num_experts] int32 (JAX): the logical expert of each physical expert, -1 where none.
        E.g. inside shard_map: `expert_map.logical_of(E)[rank * L + l]` is the logical expert
        whose weights local expert l must hold."""
        e_log, m = self.physical.shape
        phys = jnp.asarray(self.physical, jnp.int32)
        used = (jnp.arange(m)[None, :] < jnp.asarray(self.counts)[:, None]) & (phys >= 0) & (phys < num_experts)
        idx = jnp.where(used, phys, num_experts).reshape(-1)
        logical = jnp.broadcast_to(jnp.arange(e_log, dtype=jnp.int32)[:, None], (e_log, m)).reshape(-1)
        return jnp.full((num_experts,), -1, jnp.int32).at[idx].set(logical, mode="drop")


jax.tree_util.register_dataclass(ExpertMap, data_fields=["physical", "counts"], meta_fields=[])


def check_expert_map(expert_map) -> ExpertMap:
    """Trace-time checks of shapes and dtypes; ValueError naming the argument."""
    if not isinstance(expert_map, ExpertMap):
        raise ValueError(f"expert_map: expected a jax_moe_a2a.ExpertMap (ExpertMap.from_replicas / identity), "
                         f"got {type(expert_map).__name__}")
    phys, counts = expert_map.physical, expert_map.counts
    if getattr(phys, "ndim", None) != 2 or phys.shape[0] < 1 or phys.shape[1] < 1:
        raise ValueError(f"expert_map.physical: expected shape [E_logical, max_replicas] (both >= 1), got "
                         f"{list(getattr(phys, 'shape', ()))}")
    if np.dtype(phys.dtype) != np.int32:
        raise ValueError(f"expert_map.physical: expected dtype int32, got {phys.dtype}")
    if getattr(counts, "ndim", None) != 1 or tuple(counts.shape) != (phys.shape[0],):
        raise ValueError(f"expert_map.counts: expected shape [E_logical] = [{phys.shape[0]}], got "
                         f"{list(getattr(counts, 'shape', ()))}")
    if np.dtype(counts.dtype) != np.int32:
        raise ValueError(f"expert_map.counts: expected dtype int32, got {counts.dtype}")
    return expert_map


def map_ids(expert_map: ExpertMap, topk_ids, group, num_experts: int, alive=None, num_ranks: int = 0):
    """Logical topk_ids [T, K] -> physical [T, K] int32 by the module's rule. `group` is the DP
    group index (int32 scalar, rank // tp_size); num_experts the physical E. alive: optional
    [num_ranks] bool (the rank mask): replicas on masked ranks are skipped while a live one exists
    (the module docstring's rule)."""
    t_count = topk_ids.shape[0]
    phys = expert_map.physical
    e_log, m = phys.shape
    valid = (topk_ids >= 0) & (topk_ids < e_log)
    lid = jnp.where(valid, topk_ids, 0)
    cnt = jnp.clip(expert_map.counts[lid], 0, m)
    tok = jnp.arange(t_count, dtype=jnp.int32)[:, None]
    base = jnp.asarray(group, jnp.int32) * t_count + tok
    rep = base % jnp.maximum(cnt, 1)
    if alive is not None:
        local = num_experts // num_ranks
        row = phys[lid]                                                   # [T, K, M]
        in_range = (row >= 0) & (row < num_experts)
        dead = in_range & ~jnp.asarray(alive, bool)[jnp.clip(row, 0, num_experts - 1) // local]
        used = jnp.arange(m)[None, None, :] < cnt[..., None]
        live = used & ~dead
        n_live = jnp.sum(live, axis=-1, dtype=jnp.int32)
        want = base % jnp.maximum(n_live, 1)                              # index among the live entries
        order = jnp.cumsum(live, axis=-1, dtype=jnp.int32) - 1
        pick = jnp.argmax(live & (order == want[..., None]), axis=-1).astype(jnp.int32)
        rep = jnp.where(n_live > 0, pick, rep)
    p = phys[lid, rep]
    ok = valid & (cnt > 0) & (p >= 0) & (p < num_experts)
    out = jnp.where(ok, p, num_experts)
    return jnp.where(topk_ids == -1, -1, out).astype(jnp.int32)


__all__ = ["ExpertMap", "check_expert_map", "map_ids"]
