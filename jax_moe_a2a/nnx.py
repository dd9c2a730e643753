"""Flax NNX wrapper of the DeepSeek-V3-shaped MoE block (`jax_moe_a2a.models.moe_block`).

Needs flax (`pip install flax`); the rest of jax_moe_a2a does not import this module.

    comm = a2a.init(spec, mesh, "ep")
    block = MoEBlock(comm, cfg, rngs=nnx.Rngs(0))
    y = block(x, num_tokens)     # x [N*T, H] global, rank r's tokens in rows r*T..r*T+T-1

The parameters are `nnx.Param`s holding global arrays: router [H, E] f32, the routed experts'
(w1 [E, H, F] and w2 [E, F, H], or with MoEConfig(experts="grouped") w_gate_up / w_down and their
fp8 scales: models.init_moe_params; placed split over the EP axis), shared w1s [H, Fs] and w2s [Fs, H] (replicated).
The call runs `models.moe_block` inside `jax.shard_map` over the communicator's mesh, so it
works under `nnx.jit`/`jax.jit`, `nnx.grad`, or `jax.grad` of `nnx.split`/`nnx.merge` state.
"""

from __future__ import annotations

try:
    from flax import nnx
except ImportError as e:  # pragma: no cover - exercised only without flax
    raise ImportError("jax_moe_a2a.nnx needs flax (pip install flax)") from e

import jax
from jax.sharding import NamedSharding

from . import models


class MoEBlock(nnx.Module):
    """MoE layer x [N*T, H] -> [N*T, H] in Spec.combine_dtype (see models.moe_block).

    Args:
      comm: the Communicator (its Spec must match cfg: hidden, num_experts, topk; ragged layout).
      cfg: models.MoEConfig.
      rngs: nnx.Rngs; parameters are drawn as in models.init_moe_params from `rngs.params()`.
      overlap: run the split halves with the shared expert in flight (inference; see
        models.moe_block).
    """

    def __init__(self, comm, cfg: models.MoEConfig, *, rngs: nnx.Rngs, overlap: bool = False):
        spec = comm.spec
        for field, want, got in (("hidden", cfg.hidden, spec.hidden), ("num_experts", cfg.num_experts, spec.num_experts),
                                 ("topk", cfg.topk, spec.experts_per_token)):
            if want != got:
                raise ValueError(f"cfg.{field}: {want} does not match the communicator's Spec ({got})")
        self.comm = comm
        self.cfg = cfg
        self.overlap = overlap
        specs = models.moe_param_specs(cfg, comm.axis)
        params = models.init_moe_params(rngs.params(), cfg)
        for name, value in params.items():
            setattr(self, name, nnx.Param(jax.device_put(value, NamedSharding(comm.mesh, specs[name]))))

    def params_dict(self) -> dict:
        """The parameters as models.init_moe_params' dict (arrays, or tracers under a transform)."""
        return {n: getattr(self, n)[...] for n in models.moe_param_specs(self.cfg)}

    def __call__(self, x, num_tokens=None):
        """x [N*T, H] bf16/f16/f32; num_tokens None or [N] int32 (valid rows per rank)."""
        return models.moe_layer(self.comm, self.cfg, self.params_dict(), x, num_tokens, overlap=self.overlap)
