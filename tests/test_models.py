"""The example MoE model: forward and backward of a 2-layer toy model on every backend match the
reference backend's."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_moe_a2a as a2a
from jax_moe_a2a import models
from jax_moe_a2a.backends import backend_class
from jax_moe_a2a import testing as T

from conftest import BACKENDS


# _run's results of _small_model's inputs, per (backend, ranks, score, remat): the model tests
# share some (the sigmoid model's plain run of a backend is compared with the reference and with
# its remat run), and each costs a compilation of a 2-layer forward and backward.
_RUNS = {}


def _run(backend, mesh, n, cfg, spec, params, x, remat=False):
    """(out, loss, grad x, grad layers, lowered HLO text) of mean(toy_model(x)^2) on every rank,
    for _small_model(n, cfg.score)'s inputs."""
    key = (backend, n, cfg.score, remat)
    if key not in _RUNS:
        _RUNS[key] = _run_uncached(backend, mesh, n, cfg, spec, params, x, remat)
    return _RUNS[key]


def _run_uncached(backend, mesh, n, cfg, spec, params, x, remat):
    comm = a2a.init(spec, mesh, "ep", backend=backend, collect_stats=False)
    specs = [models.moe_param_specs(cfg) for _ in params]

    def per_rank(x, layers):
        def loss(x, layers):
            out = models.toy_model(comm, cfg, layers, x, remat=remat)
            return jnp.mean(out.astype(jnp.float32) ** 2), out
        (l, out), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x, layers)
        # every rank's gradients (replicated parameters differ per rank: each sees its tokens)
        return out[None], l[None], jax.tree.map(lambda a: a[None], grads)

    f = jax.jit(T.shard_map(per_rank, mesh=mesh, in_specs=(P("ep"), specs), out_specs=P("ep"),
                            check_vma=False))
    out, loss, (gx, glayers) = f(x, params)
    return np.asarray(out, np.float32), np.asarray(loss), np.asarray(gx, np.float32), jax.tree.map(
        lambda a: np.asarray(a, np.float32), glayers), f.lower(x, params).as_text()


def _small_model(n, score="softmax"):
    cfg = models.MoEConfig(hidden=64, ffn=32, num_experts=2 * n, topk=2, shared_ffn=48, score=score)
    spec = a2a.Spec(num_experts=cfg.num_experts, experts_per_token=cfg.topk, hidden=cfg.hidden,
                    max_tokens_per_rank=8, dispatch_dtype=jnp.bfloat16, combine_dtype=jnp.float32)
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    params = [models.init_moe_params(keys[i], cfg) for i in range(2)]
    x = jax.random.normal(keys[2], (n * 8, cfg.hidden), jnp.float32)
    return cfg, spec, params, x


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_toy_model_matches_reference(score, mesh, num_ranks):
    n = num_ranks
    others = [b for b in BACKENDS if b != "reference"]
    if not others:
        pytest.skip("no other backend to compare")
    cfg, spec, params, x = _small_model(n, score)
    ref = _run("reference", mesh, n, cfg, spec, params, x)
    for b in others:
        got = _run(b, mesh, n, cfg, spec, params, x)
        np.testing.assert_allclose(got[0], ref[0], rtol=2e-2, atol=2e-2, err_msg=f"{b}: forward")
        np.testing.assert_allclose(got[2], ref[2], rtol=5e-2, atol=5e-3, err_msg=f"{b}: grad x")
        flat_g, flat_r = jax.tree.leaves(got[3]), jax.tree.leaves(ref[3])
        for a, r in zip(flat_g, flat_r):
            scale = np.abs(r).max() + 1e-6
            assert np.abs(a - r).max() <= 5e-2 * scale, f"{b}: parameter gradient differs ({np.abs(a - r).max()} vs scale {scale})"


def _comm_calls(hlo: str) -> tuple:
    """(exchange halves, EP = 1 local-path calls) among the FFI calls of `hlo`."""
    return (len(re.findall(r"custom_call @jax_moe_a2a_\w+_(?:dispatch|combine)_(?:send|recv)", hlo)),
            len(re.findall(r"custom_call @jax_moe_a2a_\w+_local_(?:dispatch|combine)", hlo)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_remat_matches_plain(backend, mesh, num_ranks):
    """jax.checkpoint around each layer: the same loss and gradients as without remat, and on the
    FFI backends no communication half is recomputed (the same number of comm calls)."""
    cfg, spec, params, x = _small_model(num_ranks, "sigmoid")
    plain = _run(backend, mesh, num_ranks, cfg, spec, params, x)
    rem = _run(backend, mesh, num_ranks, cfg, spec, params, x, remat=True)
    assert "optimization_barrier" in rem[4] and "optimization_barrier" not in plain[4], "remat did not apply"
    np.testing.assert_allclose(rem[0], plain[0], rtol=1e-5, atol=1e-5, err_msg="forward")
    np.testing.assert_allclose(rem[1], plain[1], rtol=1e-5, err_msg="loss")
    np.testing.assert_allclose(rem[2], plain[2], rtol=1e-4, atol=1e-6, err_msg="grad x")
    for a, r in zip(jax.tree.leaves(rem[3]), jax.tree.leaves(plain[3])):
        assert np.abs(a - r).max() <= 1e-4 * (np.abs(r).max() + 1e-6), "parameter gradient differs under remat"
    if backend != "reference":
        # 2 layers x (forward dispatch + combine, backward combine + dispatch) x 2 halves, or one
        # call per op where the backend takes the GPU backends' EP = 1 path
        local = getattr(backend_class(backend)(), "uses_local_path", lambda n: False)(num_ranks)
        expected = (0, 8) if local else (16, 0)
        assert _comm_calls(plain[4]) == _comm_calls(rem[4]) == expected, (_comm_calls(plain[4]), _comm_calls(rem[4]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_overlap_layer_matches_one_shot(backend, mesh, num_ranks):
    """moe_layer(overlap=True) (split halves, shared expert in flight) gives the one-shot forward
    and the dense computation (dense_moe_block)."""
    cfg, spec, params, x = _small_model(num_ranks)
    comm = a2a.init(spec, mesh, "ep", backend=backend, collect_stats=False)
    n = jnp.asarray(np.arange(num_ranks) % 9, jnp.int32)
    outs = [np.asarray(jax.jit(lambda p, x, n: models.moe_layer(comm, cfg, p, x, n, overlap=o))(params[0], x, n))
            for o in (False, True)]
    assert np.abs(outs[0]).max() > 0
    np.testing.assert_allclose(outs[1], outs[0], rtol=1e-5, atol=1e-5)
    t = spec.max_tokens_per_rank   # and the dense single-device computation (examples/serve.py's check)
    for r in range(num_ranks):
        want = np.asarray(models.dense_moe_block(cfg, spec, params[0], x[r * t:(r + 1) * t], n[r]))
        np.testing.assert_allclose(outs[1][r * t:(r + 1) * t], want, rtol=2e-2, atol=2e-2 * np.abs(want).max())
