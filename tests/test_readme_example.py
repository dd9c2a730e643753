"""The README's example, at a small size, against a dense NumPy computation of the same layer."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_moe_a2a as a2a
from jax_moe_a2a import testing as T

from test_ops import BACKENDS


@pytest.mark.parametrize("backend", BACKENDS)
def test_readme_moe_layer(backend, mesh, num_ranks):
    n = num_ranks
    E, K, H, Tt = 4 * n, 2, 128, 8
    spec = a2a.Spec(num_experts=E, experts_per_token=K, hidden=H, max_tokens_per_rank=Tt,
                    dispatch_dtype=jnp.float8_e4m3fn, combine_dtype=jnp.bfloat16)
    comm = a2a.init(spec, mesh, axis="ep", backend=backend)
    rng = np.random.default_rng(0)
    w_shared = (rng.standard_normal((H, H)) / np.sqrt(H)).astype(np.float32)

    def shared_expert(x):
        return (x.astype(jnp.float32) @ w_shared).astype(jnp.bfloat16)

    def moe(x, topk_ids, topk_weights, n_tok, w_experts):   # one rank's shard, as in the README
        sent = comm.dispatch_send(x, topk_ids, topk_weights, num_tokens=n_tok[0], slot=0)
        sent, shared = a2a.overlap(sent, shared_expert, x)
        got = comm.dispatch_recv(sent)
        x_in = a2a.dequantize_fp8(got.x, got.scale)
        y = jax.lax.ragged_dot(x_in.astype(jnp.bfloat16), w_experts, got.group_sizes)
        back = comm.combine_send(y, got)
        return comm.combine_recv(back, out=shared)

    inputs = T.make_inputs(spec, n, 5, num_tokens=Tt)
    w_experts = (rng.standard_normal((E, H, H)) / np.sqrt(H)).astype(jnp.bfloat16)
    args = [T.stack_global(mesh, "ep", [getattr(i, f) for i in inputs]) for f in ("x", "topk_ids", "topk_weights")]
    args.append(T.stack_global(mesh, "ep", [np.array([i.num_tokens], np.int32) for i in inputs]))
    args.append(jax.device_put(w_experts, jax.sharding.NamedSharding(mesh, P("ep"))))
    out = jax.jit(T.shard_map(moe, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))(*args)
    got = dict(enumerate(np.asarray(out).reshape(n, Tt, H)))   # single process: every rank is local

    from jax_moe_a2a import oracle
    we = np.asarray(w_experts.astype(np.float32))
    for r, res in got.items():
        inp = inputs[r]
        q, s = oracle.quantize_fp8(inp.x, 128)
        xd = oracle.dequantize_fp8(q, s, 128).astype(jnp.bfloat16).astype(np.float32)
        want = (np.asarray(jnp.asarray(inp.x).astype(jnp.float32) @ w_shared).astype(jnp.bfloat16)).astype(np.float32)
        for t in range(Tt):
            for k in range(K):
                e = int(inp.topk_ids[t, k])
                y = (xd[t] @ we[e]).astype(jnp.bfloat16).astype(np.float32)
                want[t] += inp.topk_weights[t, k] * y
        np.testing.assert_allclose(np.asarray(res, np.float32), want, rtol=3e-2, atol=3e-2)
