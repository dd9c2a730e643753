"""Benchmark shapes: DeepSeek-V3's MoE layer at decode and prefill, scaled down on CPU."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    tokens: int          # T, tokens per rank
    hidden: int          # H
    experts: int = 256   # E
    topk: int = 8        # K
    ffn: int = 2048      # F, routed and shared expert FFN width (layer benchmark)
    scaled: bool = False  # smaller than DeepSeek-V3's (CPU, --quick)

    def spec(self, **overrides):
        import jax.numpy as jnp

        from jax_moe_a2a.spec import Spec
        kw = dict(num_experts=self.experts, experts_per_token=self.topk, hidden=self.hidden,
                  max_tokens_per_rank=self.tokens, dispatch_dtype=jnp.float8_e4m3fn, scale_block=128,
                  combine_dtype=jnp.bfloat16, layout="ragged")
        kw.update(overrides)
        return Spec(**kw)

    def units(self) -> float:
        """Relative cost of one step at this shape (progress bars weigh steps by it)."""
        return max(0.05, self.tokens * self.hidden / (128 * 1024))

    def describe(self) -> str:
        return (f"T={self.tokens} H={self.hidden} E={self.experts} K={self.topk}"
                + (" (scaled down)" if self.scaled else ""))


# The DeepSeek-V3 shapes: decode T=128, prefill T=4096; H=7168, K=8, E=256, fp8 dispatch, bf16 combine.
FULL = {"decode": Shape("decode", 128, 7168), "prefill": Shape("prefill", 4096, 7168)}
# CPU devices share a few cores: same E, K and dtypes, smaller T, H and F (the reference backend's
# worst-case padding makes its cost grow with ranks x T x K x H).
CPU = {"decode": Shape("decode", 64, 1024, ffn=256, scaled=True),
       "prefill": Shape("prefill", 256, 1024, ffn=256, scaled=True)}
QUICK = {"decode": Shape("decode", 16, 256, ffn=64, scaled=True),
         "prefill": Shape("prefill", 64, 256, ffn=64, scaled=True)}


def pick(platform: str, quick: bool) -> dict:
    if quick:
        return QUICK
    return FULL if platform in ("gpu", "cuda", "rocm") else CPU


def with_overrides(shape: Shape, tokens=None, hidden=None, ffn=None) -> Shape:
    """The shape with T, H or F replaced (CLI overrides); scaled when smaller than DeepSeek-V3's."""
    kw = {k: v for k, v in (("tokens", tokens), ("hidden", hidden), ("ffn", ffn)) if v}
    if not kw:
        return shape
    new = dataclasses.replace(shape, **kw)
    full = FULL.get(shape.name)
    small = full is None or new.tokens < full.tokens or new.hidden < full.hidden or new.ffn < full.ffn
    return dataclasses.replace(new, scaled=small)
