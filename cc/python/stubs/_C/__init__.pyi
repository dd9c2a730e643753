"""
jax_moe_a2a native extension: XLA FFI handlers (CPU and, when compiled, CUDA).
"""

import enum

from jax_moe_a2a._C import (
    cuda as cuda,
    gemm as gemm,
    host as host,
    nvshmem as nvshmem,
    proxy as proxy,
    transfer as transfer
)


def cpu_targets() -> dict:
    """FFI handlers for the 'cpu' platform: {target name: capsule}."""

def cuda_targets() -> dict:
    """
    FFI handlers for the 'CUDA' platform: {target name: capsule}; empty without nvcc at build time.
    """

class Dtype(enum.IntEnum):
    """Wire / storage element dtype (core/dtype.h ElemKind)."""

    F32 = 0

    BF16 = 1

    F16 = 2

    F8_E4M3FN = 3

class Layout(enum.IntEnum):
    """Receive layout (core/shape.h)."""

    RAGGED = 0

    EXPERT_MAJOR = 1

class Config:
    """
    One communicator's configuration (core/config.h), built by jax_moe_a2a.config.
    """

    def __init__(self) -> None: ...

    @property
    def num_ranks(self) -> int: ...

    @num_ranks.setter
    def num_ranks(self, arg: int, /) -> None: ...

    @property
    def num_experts(self) -> int: ...

    @num_experts.setter
    def num_experts(self, arg: int, /) -> None: ...

    @property
    def experts_per_token(self) -> int: ...

    @experts_per_token.setter
    def experts_per_token(self, arg: int, /) -> None: ...

    @property
    def hidden(self) -> int: ...

    @hidden.setter
    def hidden(self, arg: int, /) -> None: ...

    @property
    def max_tokens_per_rank(self) -> int: ...

    @max_tokens_per_rank.setter
    def max_tokens_per_rank(self, arg: int, /) -> None: ...

    @property
    def tp_size(self) -> int: ...

    @tp_size.setter
    def tp_size(self, arg: int, /) -> None: ...

    @property
    def num_scales(self) -> int: ...

    @num_scales.setter
    def num_scales(self, arg: int, /) -> None: ...

    @property
    def scale_block(self) -> int: ...

    @scale_block.setter
    def scale_block(self, arg: int, /) -> None: ...

    @property
    def dispatch_dtype(self) -> Dtype: ...

    @dispatch_dtype.setter
    def dispatch_dtype(self, arg: Dtype, /) -> None: ...

    @property
    def combine_dtype(self) -> Dtype: ...

    @combine_dtype.setter
    def combine_dtype(self, arg: Dtype, /) -> None: ...

    @property
    def layout(self) -> Layout: ...

    @layout.setter
    def layout(self, arg: Layout, /) -> None: ...

    @property
    def recv_rows(self) -> int: ...

    @recv_rows.setter
    def recv_rows(self, arg: int, /) -> None: ...

    @property
    def pow2_scale(self) -> bool: ...

    @pow2_scale.setter
    def pow2_scale(self, arg: bool, /) -> None: ...

    @property
    def slots(self) -> int: ...

    @slots.setter
    def slots(self, arg: int, /) -> None: ...

    @property
    def timeout_s(self) -> float: ...

    @timeout_s.setter
    def timeout_s(self, arg: float, /) -> None: ...

    @property
    def node_size(self) -> int: ...

    @node_size.setter
    def node_size(self, arg: int, /) -> None: ...

    @property
    def max_private_tokens(self) -> int: ...

    @max_private_tokens.setter
    def max_private_tokens(self, arg: int, /) -> None: ...

    @property
    def provider(self) -> str: ...

    @provider.setter
    def provider(self, arg: str, /) -> None: ...

    @property
    def engine(self) -> str: ...

    @engine.setter
    def engine(self, arg: str, /) -> None: ...

    @property
    def proxied(self) -> bool: ...

    @proxied.setter
    def proxied(self, arg: bool, /) -> None: ...

    def shape(self) -> dict:
        """
        The shape C++ derives from this config (core/shape.h MoeShape, shape_of), as a dict.
        """

def built_with_libfabric() -> bool: ...

def built_with_cuda() -> bool: ...

def built_with_nvshmem() -> bool: ...
