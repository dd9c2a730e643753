"""The Flax NNX wrapper (jax_moe_a2a.nnx.MoEBlock): forward and gradients of a small NNX model on
every FFI backend equal the reference backend's. Skipped without flax."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

nnx = pytest.importorskip("flax.nnx")

import jax_moe_a2a as a2a  # noqa: E402
from jax_moe_a2a import models  # noqa: E402
from jax_moe_a2a.nnx import MoEBlock  # noqa: E402

from conftest import BACKENDS  # noqa: E402


class Tiny(nnx.Module):
    """Linear -> residual MoE block: x [N*T, H] -> [N*T, H]."""

    def __init__(self, comm, cfg, rngs):
        self.proj = nnx.Linear(cfg.hidden, cfg.hidden, rngs=rngs)
        self.moe = MoEBlock(comm, cfg, rngs=rngs)

    def __call__(self, x, num_tokens):
        h = self.proj(x)
        return h + self.moe(h, num_tokens).astype(h.dtype)


def _run(backend, mesh, cfg, spec, x, num_tokens):
    """(output, loss, {path: grad}) of mean(Tiny(x)^2), params from one seed."""
    comm = a2a.init(spec, mesh, "ep", backend=backend, collect_stats=False)
    graphdef, state = nnx.split(Tiny(comm, cfg, nnx.Rngs(0)))

    def loss(state, x, n):
        out = nnx.merge(graphdef, state)(x, n)
        return jnp.mean(out ** 2), out

    (l, out), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(state, x, num_tokens)
    flat = {"/".join(map(str, path)): np.asarray(v, np.float32) for path, v in nnx.to_flat_state(grads)}
    return np.asarray(out), float(l), flat


def test_nnx_moe_block_matches_reference(mesh, num_ranks):
    others = [b for b in BACKENDS if b != "reference"]
    if not others:
        pytest.skip("no other backend to compare")
    n, t = num_ranks, 8
    cfg = models.MoEConfig(hidden=32, ffn=16, num_experts=2 * n, topk=2, shared_ffn=24, score="sigmoid",
                           param_dtype=jnp.float32)
    spec = a2a.Spec(num_experts=cfg.num_experts, experts_per_token=cfg.topk, hidden=cfg.hidden,
                    max_tokens_per_rank=t, dispatch_dtype=jnp.float32, combine_dtype=jnp.float32)
    x = jax.random.normal(jax.random.PRNGKey(1), (n * t, cfg.hidden), jnp.float32)
    num_tokens = jnp.asarray(np.random.default_rng(0).integers(1, t + 1, n), jnp.int32)
    ref = _run("reference", mesh, cfg, spec, x, num_tokens)
    assert len(ref[2]) == 7, sorted(ref[2])   # proj kernel, bias; router, w1, w2, w1s, w2s
    for b in others:
        got = _run(b, mesh, cfg, spec, x, num_tokens)
        np.testing.assert_allclose(got[0], ref[0], rtol=1e-4, atol=1e-5, err_msg=f"{b}: forward")
        np.testing.assert_allclose(got[1], ref[1], rtol=1e-4, err_msg=f"{b}: loss")
        assert sorted(got[2]) == sorted(ref[2])
        for k, r in ref[2].items():
            assert np.abs(r).max() > 0, f"{k}: zero reference gradient"
            np.testing.assert_allclose(got[2][k], r, rtol=1e-3, atol=1e-4 * np.abs(r).max(), err_msg=f"{b}: grad {k}")
