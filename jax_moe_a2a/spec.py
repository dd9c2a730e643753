"""`Spec`: the static description of one MoE all-to-all (frozen, validated, hashable)."""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax.numpy as jnp
import numpy as np

from .dtypes import COMBINE_DTYPES, FP8_DTYPES, LAYOUTS, WIRE_DTYPES


def _pos_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise ValueError(f"Spec.{name} must be a positive int, got {value!r}")
    return int(value)


def _dtype_field(name: str, value, allowed, also: str = "") -> np.dtype:
    """Spec.<name> as a numpy dtype, or a ValueError naming the field and the dtypes it takes."""
    try:
        d = np.dtype(value)
    except TypeError as e:
        raise ValueError(f"Spec.{name}: not a dtype: {value!r}") from e
    if d not in allowed:
        raise ValueError(f"Spec.{name} must be {also}one of {[str(a) for a in allowed]}, got {d}")
    return d


@dataclasses.dataclass(frozen=True)
class Spec:
    """Static shape of one MoE all-to-all, shared by every rank.

    Attributes:
      num_experts: E, total routed experts over the EP axis (E % num_ranks == 0).
      experts_per_token: K, experts chosen per token (top-K).
      hidden: H, features per token.
      max_tokens_per_rank: T, static token capacity of one rank; `num_tokens <= T` is dynamic.
      dispatch_dtype: what travels on the wire and what `Dispatched.x` holds: bf16, f16, f32 or
        float8_e4m3fn (then one f32 scale per `scale_block` values travels with it).
      scale_block: values per fp8 scale: S = ceil(H / scale_block) scales per token; when it does
        not divide H the last block is partial (its scale comes from its own H % scale_block
        values). Ignored for 16/32-bit dispatch.
      pow2_scale: fp8 scales rounded up to powers of two (exact rescaling downstream).
      recv_dtype: with fp8 dispatch, the dtype `Dispatched.x` arrives in: None keeps the fp8 rows
        and their scales (for experts with fp8 matmuls); bf16, f16 or f32 dequantises them on
        receive (`Dispatched.scale` is then None), the values `dequantize_fp8(x, scale)` cast to
        that dtype, bit for bit. The wire stays fp8; the GPU kernels write the dequantised rows
        where they would have written the fp8 ones, so experts that compute in bf16 skip a pass
        over the rows. Only with fp8 dispatch_dtype.
      combine_dtype: dtype of `combine_recv`'s [T, H] output (accumulation is always f32).
      layout: "ragged" (rows sorted by local expert, [R, H] + group_sizes [L], what
        `jax.lax.ragged_dot` takes) or "expert_major" ([L, C, H] + counts [L]).
      recv_capacity: ragged: rows R of the receive buffer; expert_major: rows C per local expert.
        None means the worst case (no row can ever be dropped). Smaller values save memory;
        rows beyond it are dropped (deterministically, see `docs/api.md`) and counted.
      tp_size: consecutive ranks holding the same tokens (tensor-parallel attention); each token
        is dispatched once per DP group and every member receives the combined output.
      slots: independent sets of communication buffers (micro-batches in flight at once).
    """

    num_experts: int
    experts_per_token: int
    hidden: int
    max_tokens_per_rank: int
    dispatch_dtype: object = jnp.bfloat16
    scale_block: int = 128
    pow2_scale: bool = False
    combine_dtype: object = jnp.bfloat16
    layout: str = "ragged"
    recv_capacity: Optional[int] = None
    tp_size: int = 1
    slots: int = 2
    recv_dtype: object = None

    def __post_init__(self):
        for name in ("num_experts", "experts_per_token", "hidden", "max_tokens_per_rank", "tp_size", "slots"):
            object.__setattr__(self, name, _pos_int(name, getattr(self, name)))
        dd = _dtype_field("dispatch_dtype", self.dispatch_dtype, WIRE_DTYPES)
        object.__setattr__(self, "dispatch_dtype", dd)
        object.__setattr__(self, "combine_dtype", _dtype_field("combine_dtype", self.combine_dtype, COMBINE_DTYPES))
        if self.recv_dtype is not None:
            rd = _dtype_field("recv_dtype", self.recv_dtype, COMBINE_DTYPES, "None or ")
            if dd not in FP8_DTYPES:
                raise ValueError(f"Spec.recv_dtype dequantises fp8 rows on receive: it needs an fp8 dispatch_dtype, "
                                 f"got {dd} (16/32-bit rows arrive in dispatch_dtype)")
            object.__setattr__(self, "recv_dtype", rd)
        if self.layout not in LAYOUTS:
            raise ValueError(f"Spec.layout must be one of {LAYOUTS}, got {self.layout!r}")
        if self.experts_per_token > self.num_experts:
            raise ValueError(
                f"Spec.experts_per_token ({self.experts_per_token}) must be <= num_experts ({self.num_experts})")
        if self.is_fp8:
            object.__setattr__(self, "scale_block", _pos_int("scale_block", self.scale_block))
        if self.recv_capacity is not None:
            object.__setattr__(self, "recv_capacity", _pos_int("recv_capacity", self.recv_capacity))
        object.__setattr__(self, "pow2_scale", bool(self.pow2_scale))

    # ---- derived quantities ------------------------------------------------------------------
    @property
    def is_fp8(self) -> bool:
        return self.dispatch_dtype in FP8_DTYPES

    @property
    def recv_is_fp8(self) -> bool:
        """`Dispatched.x` holds fp8 rows with `Dispatched.scale` (fp8 dispatch, no recv_dtype)."""
        return self.is_fp8 and self.recv_dtype is None

    @property
    def num_scales(self) -> int:
        """f32 scales per token (ceil(H / scale_block) for fp8, else 0)."""
        return -(-self.hidden // self.scale_block) if self.is_fp8 else 0

    def check_ranks(self, num_ranks: int) -> None:
        """Raises ValueError unless this spec fits an EP axis of `num_ranks` ranks."""
        if num_ranks <= 0:
            raise ValueError(f"the EP axis must have at least one rank, got {num_ranks}")
        if self.num_experts % num_ranks:
            raise ValueError(
                f"Spec.num_experts ({self.num_experts}) must be divisible by the number of ranks ({num_ranks})")
        if num_ranks % self.tp_size:
            raise ValueError(f"the number of ranks ({num_ranks}) must be divisible by Spec.tp_size ({self.tp_size})")

    def local_experts(self, num_ranks: int) -> int:
        """L = E / N."""
        self.check_ranks(num_ranks)
        return self.num_experts // num_ranks

    def tokens_per_member(self) -> int:
        """Tokens one tp member sends at most: ceil(T / tp_size) (token t is sent by member t % tp_size)."""
        return -(-self.max_tokens_per_rank // self.tp_size)

    def rows_per_peer(self, num_ranks: int) -> int:
        """Worst-case rows one rank sends to one peer: ceil(T / tp) * min(K, L)."""
        return self.tokens_per_member() * min(self.experts_per_token, self.local_experts(num_ranks))

    def worst_case_rows(self, num_ranks: int) -> int:
        """Ragged worst case R = N * ceil(T / tp) * min(K, L) (= T * N * min(K, L) for tp 1)."""
        return num_ranks * self.rows_per_peer(num_ranks)

    def worst_case_per_expert(self, num_ranks: int) -> int:
        """expert_major worst case C = N * ceil(T / tp): every token of every group to one expert."""
        return num_ranks * self.tokens_per_member()

    def recv_rows(self, num_ranks: int) -> int:
        """Rows of the ragged receive buffer (R) or per local expert (C), capacity applied."""
        worst = (self.worst_case_rows(num_ranks) if self.layout == "ragged"
                 else self.worst_case_per_expert(num_ranks))
        return worst if self.recv_capacity is None else min(self.recv_capacity, worst)

    def recv_shape(self, num_ranks: int) -> tuple:
        """Shape of `Dispatched.x` without H: (R,) ragged or (L, C) expert_major."""
        if self.layout == "ragged":
            return (self.recv_rows(num_ranks),)
        return (self.local_experts(num_ranks), self.recv_rows(num_ranks))

    def combine_wire_dtype(self, y_dtype) -> np.dtype:
        """The dtype combine_send's y travels in: its own when no wider than combine_dtype, else
        combine_dtype (the combine buffers hold rows of combine_dtype; accumulation is f32)."""
        y_dtype = np.dtype(y_dtype)
        return y_dtype if y_dtype.itemsize <= self.combine_dtype.itemsize else self.combine_dtype

    def token_bytes(self) -> int:
        """Bytes one dispatched row carries on the wire (payload + fp8 scales)."""
        return self.hidden * self.dispatch_dtype.itemsize + 4 * self.num_scales

    def describe(self) -> str:
        return (f"E={self.num_experts} K={self.experts_per_token} H={self.hidden} T={self.max_tokens_per_rank} "
                f"{self.dispatch_dtype}{'' if self.recv_dtype is None else '(recv ' + str(self.recv_dtype) + ')'}"
                f"->{self.combine_dtype} {self.layout} tp={self.tp_size}")

    def replace(self, **changes) -> "Spec":
        return dataclasses.replace(self, **changes)


__all__ = ["Spec", "LAYOUTS"]
