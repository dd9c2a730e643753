"""models.moe_layer on data split over the EP groups too: a (dp, ep) = 2x4 mesh, comm over "ep",
x and num_tokens sharded over ("dp", "ep") so every group has its own tokens. Each group's output
must equal the single-axis layer (a 1-D "ep" mesh of 4 devices) on that group's tokens, and the
dense one-device computation (models.dense_moe_block) of every rank. Outputs start poisoned."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_moe_a2a as a2a
from jax_moe_a2a import models
from jax_moe_a2a import testing as T

from conftest import BACKENDS

G, N, TOK = 2, 4, 8
CASES = [(b, ov) for b in BACKENDS if b in ("reference", "host") for ov in (False, True)]


def _setup():
    cfg = models.MoEConfig(hidden=64, ffn=32, num_experts=2 * N, topk=2, shared_ffn=48, score="sigmoid")
    spec = a2a.Spec(num_experts=cfg.num_experts, experts_per_token=cfg.topk, hidden=cfg.hidden,
                    max_tokens_per_rank=TOK, dispatch_dtype=jnp.bfloat16, combine_dtype=jnp.float32)
    k1, k2 = jax.random.split(jax.random.PRNGKey(3))
    params = models.init_moe_params(k1, cfg)
    x = np.asarray(jax.random.normal(k2, (G * N * TOK, cfg.hidden), jnp.float32))
    nt = np.array([TOK, 0, 3, 5, 1, TOK, 7, 2], np.int32)   # per (group, rank): full, empty, partial
    return cfg, spec, params, x, nt


def _put(mesh, spec, a):
    return jax.device_put(a, NamedSharding(mesh, spec))


@pytest.mark.parametrize("backend,overlap", CASES)
def test_moe_layer_over_dp_and_ep(backend, overlap):
    if jax.device_count() != G * N:
        pytest.skip(f"needs {G * N} devices")
    cfg, spec, params, x, nt = _setup()
    mesh2 = Mesh(np.array(jax.devices()).reshape(G, N), ("dp", "ep"))
    comm2 = a2a.init(spec, mesh2, "ep", backend=backend, collect_stats=False)
    assert comm2.num_groups == G
    data = P(("dp", "ep"))
    T.poison_devices(mesh2)
    f2 = jax.jit(lambda p, x, n: models.moe_layer(comm2, cfg, p, x, n, overlap=overlap, data_axes=("dp", "ep")))
    out2 = f2(params, _put(mesh2, data, x), _put(mesh2, data, nt))
    assert out2.shape == (G * N * TOK, cfg.hidden) and out2.sharding.spec == data, out2.sharding
    out2 = np.asarray(out2, np.float32)

    # the single-axis layer on each group's tokens, on the group's own devices
    for g in range(G):
        mesh1 = Mesh(np.array(jax.devices()).reshape(G, N)[g], ("ep",))
        comm1 = a2a.init(spec, mesh1, "ep", backend=backend, collect_stats=False)
        rows = slice(g * N * TOK, (g + 1) * N * TOK)
        f1 = jax.jit(lambda p, x, n: models.moe_layer(comm1, cfg, p, x, n, overlap=overlap))
        out1 = np.asarray(f1(params, _put(mesh1, P("ep"), x[rows]), _put(mesh1, P("ep"), nt[g * N:(g + 1) * N])),
                          np.float32)
        np.testing.assert_allclose(out2[rows], out1, rtol=1e-5, atol=1e-5, equal_nan=False, err_msg=f"group {g}")
        comm1.close()
    # and the dense oracle, rank by rank, every row (past num_tokens: the shared expert alone)
    assert np.isfinite(out2).all(), "rows left poisoned"
    for b in range(G * N):
        want = np.asarray(models.dense_moe_block(cfg, spec, params, jnp.asarray(x[b * TOK:(b + 1) * TOK]), nt[b]),
                          np.float32)
        got = out2[b * TOK:(b + 1) * TOK]
        np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2 * np.abs(want).max(), equal_nan=False,
                                   err_msg=f"block {b}")
    assert nt.sum() > 0
    comm2.close()


def test_data_axes_must_name_the_ep_axis():
    if jax.device_count() != G * N:
        pytest.skip(f"needs {G * N} devices")
    cfg, spec, params, x, nt = _setup()
    mesh2 = Mesh(np.array(jax.devices()).reshape(G, N), ("dp", "ep"))
    comm = a2a.init(spec, mesh2, "ep", backend="reference")
    for bad in ("dp", ("ep", "ep"), ("dp", "tp")):
        with pytest.raises(ValueError, match="data_axes"):
            models.moe_layer(comm, cfg, params, x, nt, data_axes=bad)
