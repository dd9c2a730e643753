"""jax_moe_a2a: expert-parallel all-to-all (MoE dispatch / combine) for JAX.

    spec = a2a.Spec(num_experts=256, experts_per_token=8, hidden=7168, max_tokens_per_rank=128)
    comm = a2a.init(spec, mesh, axis="ep")
    # inside jax.shard_map over "ep":
    got = comm.dispatch(x, topk_ids, topk_weights, num_tokens=n)
    out = comm.combine(experts(got), got)
"""

from . import backends as _backends
from .comm import Communicator, init
from .config import Config
from .eplb import ExpertMap
from .errors import DroppedRowsError, PeerFailure
from .experts import expert_mlp, grouped_matmul, quantize_weights_fp8
from .overlap import overlap
from .quant import dequantize_fp8, quantize_fp8, quantize_fp8_jax
from .spec import Spec
from .types import CombineHandle, DispatchHandle, Dispatched, Route

__version__ = "0.1.0"


def available_backends() -> list:
    """Backends usable in this process, best first."""
    return _backends.available()


__all__ = [
    "Spec", "Config", "init", "Communicator", "DroppedRowsError", "PeerFailure", "Dispatched", "DispatchHandle",
    "CombineHandle",
    "Route", "ExpertMap", "available_backends", "overlap", "quantize_fp8", "quantize_fp8_jax", "dequantize_fp8",
    "grouped_matmul", "expert_mlp", "quantize_weights_fp8",
]
