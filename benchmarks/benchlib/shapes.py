"""Benchmark shapes: DeepSeek-V3's MoE layer at decode and prefill, scaled down on CPU."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from ..spec import Spec


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    tokens: int          # T, tokens per rank
    hidden: int          # H
    experts: int = 256   # E
    topk: int = 8        # K

    def spec(self, **overrides) -> Spec:
        kw = dict(num_experts=self.experts, experts_per_token=self.topk, hidden=self.hidden,
                  max_tokens_per_rank=self.tokens, dispatch_dtype=jnp.float8_e4m3fn, scale_block=128,
                  combine_dtype=jnp.bfloat16, layout="ragged")
        kw.update(overrides)
        return Spec(**kw)


# DESIGN.md section 9: decode T=128, prefill T=4096; H=7168, K=8, E=256, fp8 dispatch, bf16 combine.
FULL = {"decode": Shape("decode", 128, 7168), "prefill": Shape("prefill", 4096, 7168)}
# CPU devices share two cores here: same E, K and dtypes, smaller T and H.
CPU = {"decode": Shape("decode", 128, 2048), "prefill": Shape("prefill", 512, 2048)}
QUICK = {"decode": Shape("decode", 32, 512), "prefill": Shape("prefill", 128, 512)}


def pick(platform: str, quick: bool) -> dict:
    if quick:
        return QUICK
    return FULL if platform in ("gpu", "cuda", "rocm") else CPU
