"""`Config`: one communicator's configuration, built once from the Spec, the EP group's rank count
and the backend's options, and the only thing a backend is opened with (with the mesh and axis).

It is passed to C++ as one named struct (`Config.native()` -> `_C.Config`, cc/core/config.h);
every native backend's `create` takes it, C++ derives its one shape struct from it (MoeShape,
cc/core/shape.h) and computes the buffer sizes from it (`buffer_regions`), which Python reports
and never recomputes.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from . import _ffi
from .dtypes import Dtype, Layout
from .spec import Spec


# Transport fields a backend may set from its options (Backend.transport); the rest come from the Spec.
TRANSPORT_FIELDS = ("node_size", "max_private_tokens", "provider", "engine", "proxied")


@dataclasses.dataclass(frozen=True)
class Config:
    """Everything a backend is configured by (frozen, hashable). Build it with `Config.build`.

    Shape (from the Spec on an EP group of `num_ranks` ranks): num_ranks, num_experts,
    experts_per_token, hidden, max_tokens_per_rank, tp_size, num_scales (fp8:
    ceil(hidden / scale_block), else 0), scale_block, dispatch_dtype and combine_dtype (`Dtype`), layout
    (`Layout`), recv_rows (R ragged, C per local expert expert_major; capacity applied),
    pow2_scale, slots; timeout_s (bound of every wait for a peer).

    Transport (resolved from the backend's options and environment; each backend reads its own):
      node_size: ranks r, s share a node iff r // node_size == s // node_size (cuda: resolved,
        num_ranks when every rank is node-local; host proxied: 0 = none share one).
      max_private_tokens: rows each remote sender writes before the counts arrive (-1: all).
      provider: libfabric provider ("" where unused); engine: host "local" or "fabric";
      proxied: host, the protocol on a proxy thread per rank.
    """

    backend: str
    num_ranks: int
    num_experts: int
    experts_per_token: int
    hidden: int
    max_tokens_per_rank: int
    tp_size: int
    num_scales: int
    scale_block: int
    dispatch_dtype: Dtype
    combine_dtype: Dtype
    layout: Layout
    recv_rows: int
    pow2_scale: bool
    slots: int
    timeout_s: float = 60.0
    node_size: int = 0
    max_private_tokens: int = -1
    provider: str = ""
    engine: str = ""
    proxied: bool = False

    @classmethod
    def build(cls, spec: Spec, num_ranks: int, backend, *, timeout_s: float = 60.0,
              options: Optional[dict] = None) -> "Config":
        """The config of `spec` on an EP group of `num_ranks` ranks for `backend`: a Backend class
        or instance (its `name`, `OPTIONS` and `transport`; by name:
        `jax_moe_a2a.backends.backend_class(name)`). `options`: the backend options of
        `jax_moe_a2a.init`; a name the backend does not declare (Backend.OPTIONS) raises ValueError
        listing the valid ones; the backend resolves the others (defaults, environment) in
        `Backend.transport`. This module imports no backend: the caller resolves the name."""
        if not isinstance(spec, Spec):
            raise ValueError(f"spec: expected a jax_moe_a2a.Spec, got {type(spec).__name__}")
        if isinstance(backend, str):
            raise ValueError(f"backend: expected a Backend class or instance, got the name {backend!r}; "
                             f"use jax_moe_a2a.backends.backend_class({backend!r})")
        impl = backend if isinstance(backend, type) else type(backend)
        spec.check_ranks(num_ranks)
        if timeout_s <= 0:
            raise ValueError(f"timeout_s: expected > 0, got {timeout_s}")
        transport = impl.transport(check_options(impl, dict(options or {})), num_ranks)
        unknown = set(transport) - set(TRANSPORT_FIELDS)
        if unknown:  # a backend's bug, checked also under python -O
            raise RuntimeError(f"{impl.name}.transport returned fields Config does not know: {sorted(unknown)}")
        return cls(backend=impl.name, num_ranks=int(num_ranks), num_experts=spec.num_experts,
                   experts_per_token=spec.experts_per_token, hidden=spec.hidden,
                   max_tokens_per_rank=spec.max_tokens_per_rank, tp_size=spec.tp_size, num_scales=spec.num_scales,
                   scale_block=spec.scale_block, dispatch_dtype=Dtype.of(spec.dispatch_dtype),
                   combine_dtype=Dtype.of(spec.combine_dtype), layout=Layout.of(spec.layout),
                   recv_rows=spec.recv_rows(num_ranks), pow2_scale=spec.pow2_scale, slots=spec.slots,
                   timeout_s=float(timeout_s), **transport)

    @property
    def local_experts(self) -> int:
        return self.num_experts // self.num_ranks

    def native(self):
        """This config as the C++ struct `_C.Config` (cc/core/config.h), fields by name."""
        c = _ffi.require_native()
        out = c.Config()
        for f in dataclasses.fields(self):
            if f.name == "backend":
                continue
            v = getattr(self, f.name)
            if isinstance(v, Dtype):
                v = c.Dtype(int(v))
            elif isinstance(v, Layout):
                v = c.Layout(int(v))
            setattr(out, f.name, v)
        return out


COMMON_OPTIONS = ("debug", "timeout_s", "collect_stats")


def check_options(backend, options: dict) -> dict:
    """`options` if every name is one `backend` declares (Backend.OPTIONS), else ValueError
    listing the valid names for it."""
    valid = dict(getattr(backend, "OPTIONS", {}))
    unknown = sorted(set(options) - set(valid))
    if unknown:
        names = ", ".join(sorted(valid)) or "none"
        raise ValueError(f"{backend.name} backend: unknown option(s) {', '.join(unknown)}; its options: {names} "
                         f"(every backend also takes {', '.join(COMMON_OPTIONS)})")
    return dict(options)


__all__ = ["Config", "Dtype", "Layout", "check_options"]
