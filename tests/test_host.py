"""host backend specifics: private region sizes (0 rows: everything through the exact-offset
overflow path; full: nothing). The soak and the never-calls test live in test_protocol.py."""

import jax.numpy as jnp
import pytest

import jax_moe_a2a as a2a
from jax_moe_a2a import testing as T

pytestmark = pytest.mark.skipif("host" not in a2a.available_backends(), reason="host backend not built")

FP8 = jnp.float8_e4m3fn


@pytest.mark.mpi
@pytest.mark.parametrize("priv", [0, 1, 5, None], ids=["priv0-all-overflow", "priv1", "priv5", "priv-full"])
@pytest.mark.parametrize("layout", ["ragged", "expert_major"])
def test_private_region_sizes(priv, layout, num_ranks, mesh):
    """Tiny private regions push every row through the exact-offset overflow path."""
    spec = a2a.Spec(num_experts=4 * num_ranks, experts_per_token=3, hidden=64, max_tokens_per_rank=16,
                    dispatch_dtype=FP8, scale_block=32, layout=layout)
    comm = a2a.init(spec, mesh, "ep", backend="host", max_private_tokens=priv, timeout_s=20)
    for step in range(3):
        inputs = T.make_inputs(spec, num_ranks, 40 + step, routing=["random", "one_hot", "skewed"][step],
                               num_tokens=16, minus_one_frac=0.1)
        T.check_all(comm, inputs, T.run_ops(comm, inputs))


def test_proxy_stats_per_group_and_inline():
    """proxy_stats() keys every local rank of every EP group as (group, rank) on a mesh with several
    groups (it listed group 0's ranks only), and is {} inline, where no proxy thread runs."""
    import jax
    import numpy as np
    from jax.sharding import Mesh
    if jax.process_count() > 1 or len(jax.devices()) < 4:
        pytest.skip("one process with at least 4 devices")
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("dp", "ep"))
    spec = a2a.Spec(num_experts=4, experts_per_token=2, hidden=32, max_tokens_per_rank=4)
    comm = a2a.init(spec, mesh, "ep", backend="host", proxied=True, timeout_s=60.0)
    try:
        stats = comm.proxy_stats()
        assert sorted(stats) == [(0, 0), (0, 1), (1, 0), (1, 1)], sorted(stats)
        assert all(s["flag_path"] for s in stats.values()), stats
    finally:
        comm.close()
    inline = a2a.init(spec, mesh, "ep", backend="host")
    try:
        assert inline.proxy_stats() == {}
    finally:
        inline.close()


@pytest.mark.parametrize("combine_dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("hidden", [1024, 40], ids=["h1024", "h40"])
def test_combine_sum_is_the_oracles_bit_for_bit(num_ranks, mesh, combine_dtype, hidden):
    """The host combine sums each token's rows in f32 in (token, k) order, w * y then +, no fused
    multiply-add, as the NumPy oracle does, then rounds once: its output equals the oracle's bit for
    bit (check_combine's tolerance is for backends that sum in another order). Guards the host row
    loops' machine-specific code (core/cpu_clones.h: AVX2 or baseline, the same bits by design),
    whichever the machine running this picks; an odd hidden size covers the vector loops' tails."""
    import numpy as np
    from jax_moe_a2a import oracle
    spec = a2a.Spec(num_experts=2 * num_ranks, experts_per_token=4, hidden=hidden, max_tokens_per_rank=12,
                    dispatch_dtype=jnp.bfloat16, combine_dtype=combine_dtype)
    comm = a2a.init(spec, mesh, "ep", backend="host", timeout_s=60.0)
    seed = T.fresh_seed()
    inputs = T.make_inputs(spec, num_ranks, seed, num_tokens=12)
    got = T.run_ops(comm, inputs)
    want = oracle.combine(spec, inputs, T.expert_fn_np, np.dtype(jnp.bfloat16))
    for r, res in got.items():
        g, w = np.asarray(res["out"]), np.asarray(want[r])
        assert g.dtype == w.dtype and np.array_equal(g.view(np.uint8), w.view(np.uint8)), (
            f"seed {seed}, rank {r}: {int((g != w).sum())} of {g.size} values differ")
    comm.close()
