"""What the Python snippets of README.md and docs/*.md may assume.

tests/test_docs.py runs every ```python block of those files in a fresh process, this file's code
first. A snippet may use these names without defining them (a snippet that defines its own, e.g.
a mesh with two axes, simply rebinds them):

    jax, jnp, np, P (PartitionSpec), Mesh, a2a (jax_moe_a2a)
    mesh      a 1-D mesh ("ep",) over the 8 CPU devices; N = mesh.size ranks
    E, K, H, T, F    experts (4 per rank), top-K (2), hidden (256), max tokens per rank (16),
                     shared-expert width (128)
    spec      a2a.Spec of those sizes, bf16 dispatch and combine
    comm      a2a.init(spec, mesh, axis="ep")
    x, ids, w every rank's tokens stacked: x [N*T, H] bf16, ids [N*T, K] int32, w [N*T, K] f32
    w1s, w2s  the shared expert's weights: [H, F], [F, H] bf16
    expert(got), experts(got)   identity experts: the received rows are the outputs
    shared_up(x, w1s) -> [T, F], shared_down(h, w2s) -> [T, H]   the shared expert's halves
    step(x, ids, w)   a jitted shard_map of one MoE layer (dispatch, expert, combine) on `comm`
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, PartitionSpec as P  # noqa: E402

import jax_moe_a2a as a2a  # noqa: E402

mesh = Mesh(jax.devices(), ("ep",))
N = mesh.size
E, K, H, T, F = 4 * N, 2, 256, 16, 128
spec = a2a.Spec(num_experts=E, experts_per_token=K, hidden=H, max_tokens_per_rank=T,
                dispatch_dtype=jnp.bfloat16, combine_dtype=jnp.bfloat16)
comm = a2a.init(spec, mesh, axis="ep")

_k = jax.random.split(jax.random.key(0), 4)
x = jax.random.normal(_k[0], (N * T, H), jnp.bfloat16)
w, ids = jax.lax.top_k(jax.nn.softmax(x.astype(jnp.float32) @ jax.random.normal(_k[1], (H, E))), K)
ids = ids.astype(jnp.int32)
w1s = (jax.random.normal(_k[2], (H, F), jnp.float32) / H ** 0.5).astype(jnp.bfloat16)
w2s = (jax.random.normal(_k[3], (F, H), jnp.float32) / F ** 0.5).astype(jnp.bfloat16)


def expert(got):
    """Identity experts: y in got.x's layout and dtype."""
    return got.x


experts = expert


def shared_up(x, w1s):
    return jax.nn.silu(x @ w1s)


def shared_down(h, w2s):
    return h @ w2s


def _layer(x, ids, w):
    got = comm.dispatch(x, ids, w)
    return comm.combine(expert(got), got)


step = jax.jit(jax.shard_map(_layer, mesh=mesh, in_specs=(P("ep"),) * 3, out_specs=P("ep")))
