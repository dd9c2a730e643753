"""The proxy's pipelining (JAX_MOE_A2A_PROXY_PIPELINE, cc/proxy/proxy.h), tested on CPUs through the
host backend's proxied mode. `peer` (the default): the packer raises d_packed_to[d] after each
destination's rows and the proxy posts that peer's PRIV write at once (still one write per peer),
each OVER write as soon as its offset is known, and raises d_placed then d_landed_from[src] per
source so that dispatch_recv unpacks each source's rows while the rest are in flight. `priv`: the
same with every OVER write after every COUNTS. `off`: the series behaviour (every write after
d_packed, the receiver after d_landed). All against the NumPy oracle (outputs poisoned), with several slots in
flight, under row staging and the GDRCopy-style flag mirror (which keep the receiver on d_landed);
the proxies' counters show that `peer` posts before the whole pack and unpacks before the last
source landed, and that `off` does neither.

    pytest tests/test_proxy_pipeline.py
    mpirun -n 2 python -m pytest -m mpi tests/test_proxy_pipeline.py
"""

import time

import jax
import pytest

import jax_moe_a2a as a2a
from jax_moe_a2a import testing as T

from test_protocol import check_two_slots
from test_proxy import proxied, proxied_three_steps, skip_unless_node_fits

pytestmark = [pytest.mark.mpi,
              pytest.mark.skipif("host" not in a2a.available_backends(), reason="host backend not built")]

MODES = ["peer", "priv", "off"]


def remote_peers(node_size, num_ranks):
    """Whether some rank has a peer through the engine."""
    return node_size == 0 or node_size < num_ranks


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("node_size, priv, tp", [(0, 0, 1), (0, None, 1), (2, 1, 1), (0, 1, 2)],
                         ids=["priv0", "privfull", "node2-priv1", "tp2-priv1"])
def test_pipeline_against_oracle(mode, node_size, priv, tp, monkeypatch, mesh, num_ranks):
    """Every op of three steps (random, skewed with fewer tokens, one hot) against the oracle in both
    modes; the counters say which mode ran, and `off` never posts a write before the whole pack
    nor unpacks before d_landed."""
    monkeypatch.setenv("JAX_MOE_A2A_PROXY_PIPELINE", mode)
    comm = proxied_three_steps(mesh, num_ranks, T.fresh_seed(), priv, node_size, tp)
    # Under peer, combine_recv reduces each source as it lands: the last step's receive can return
    # before the proxy counts that combine landed (it raises c_landed after the last source). Wait
    # (bounded) for the counters to catch up; they must all reach 3.
    deadline = time.monotonic() + 10
    while True:
        stats = comm.proxy_stats()
        assert stats, "no proxy on this process"
        if all(s["dispatches_landed"] >= 3 and s["combines_landed"] >= 3 for s in stats.values()) \
                or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    for r, s in stats.items():
        assert s["pipeline"] == (mode != "off"), (r, s)
        if mode == "off":
            assert s["priv_early"] == 0 and s["recv_early"] == 0, (r, s)
        assert s["dispatches_landed"] >= 3 and s["combines_landed"] >= 3, (r, s)
        # the packer's clocks (the breakdown of benchmarks/proxy.py): every op ran and waited <= its call
        for op in ("dispatch_send", "dispatch_recv", "combine_send", "combine_recv"):
            assert 0 < s[f"wait_ns_{op}"] <= s[f"call_ns_{op}"] or s[f"wait_ns_{op}"] == 0 < s[f"call_ns_{op}"], (op, s)
    comm.close()


@pytest.mark.parametrize("staged", [False, True], ids=["registered", "staged"])
def test_pipeline_posts_before_the_whole_pack(staged, monkeypatch, mesh, num_ranks):
    """`peer` with a spinning proxy and a packer that pauses 20 ms after publishing each remote
    destination's rows but the last (JAX_MOE_A2A_HOST_PACK_PAUSE_S; every rank through the
    engine): the proxies post PRIV writes before d_packed (priv_early, summed over every process;
    without the pause a 190 µs pack was overtaken in 0.01-0.5 of the dispatches, so the pause
    makes it certain but for a proxy thread not scheduled for 20 ms, 3 times over), and the results
    still match the oracle. Every process runs the same steps (a collective). Under row staging
    (JAX_MOE_A2A_HOST_STAGED) each destination's rows are copied once packed and its PRIV posted
    while the next destination is packed and copied (Proxy::post_sends)."""
    import numpy as np
    from jax.experimental import multihost_utils

    if staged:
        monkeypatch.setenv("JAX_MOE_A2A_HOST_STAGED", "1")
    monkeypatch.setenv("JAX_MOE_A2A_PROXY_PIPELINE", "peer")
    monkeypatch.setenv("JAX_MOE_A2A_PROXY", "spin")
    monkeypatch.setenv("JAX_MOE_A2A_HOST_PACK_PAUSE_S", "0.02")
    spec = a2a.Spec(num_experts=4 * num_ranks, experts_per_token=4, hidden=256, max_tokens_per_rank=32)
    comm = proxied(spec, mesh, None, node_size=0)
    steps = 3
    for step in range(steps):
        inputs = T.make_inputs(spec, num_ranks, T.fresh_seed())
        T.check_all(comm, inputs, T.run_ops(comm, inputs, poison=True))
    stats = comm.proxy_stats()
    mine = sum(s["priv_early"] for s in stats.values())
    comm.close()
    early = int(np.sum(multihost_utils.process_allgather(np.array([mine], np.int64))))
    assert early > 0, f"no PRIV write went out before the whole pack in {steps} steps on any process: {stats}"


@pytest.mark.parametrize("mode", MODES)
def test_pipeline_unpacks_before_the_last_source(mode, monkeypatch, mesh, num_ranks):
    """The receiver's side of `peer`: the last rank's dispatch starts 0.3 s late (run_ops' `late`)
    and every packer pauses 30 ms after each remote destination but the last
    (JAX_MOE_A2A_HOST_PACK_PAUSE_S), so on every other rank the late rank's PRIV and OVER rows land
    (N - 1) * 30 ms after those of the others, whose OVER writes wait only for its count matrix.
    Receivers count the sources they unpacked before d_landed (proxy_stats' recv_early): > 0 under
    `peer` and `priv`, summed over ranks, three steps and processes (missing it would take every receiver
    thread unscheduled for the whole window in every step); 0 under `off`, which waits for
    d_landed. The results match the oracle either way. Every process runs the same steps."""
    import numpy as np
    from jax.experimental import multihost_utils

    if num_ranks < 2:
        pytest.skip("needs a late rank and another")
    monkeypatch.setenv("JAX_MOE_A2A_PROXY_PIPELINE", mode)
    monkeypatch.setenv("JAX_MOE_A2A_HOST_PACK_PAUSE_S", "0.03")
    spec = a2a.Spec(num_experts=4 * num_ranks, experts_per_token=4, hidden=64, max_tokens_per_rank=32)
    comm = proxied(spec, mesh, None, node_size=0)
    for step in range(3):
        inputs = T.make_inputs(spec, num_ranks, T.fresh_seed())
        T.check_all(comm, inputs, T.run_ops(comm, inputs, poison=True, late=(num_ranks - 1, 0.3)))
    stats = comm.proxy_stats()
    mine = sum(s["recv_early"] for s in stats.values())
    comm.close()
    early = int(np.sum(multihost_utils.process_allgather(np.array([mine], np.int64))))
    if mode != "off":
        assert early > 0, f"no source unpacked before d_landed in 3 steps with a late rank on any process: {stats}"
    else:
        assert early == 0, stats


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("priv", [0, 1], ids=["over-only", "priv1"])
@pytest.mark.parametrize("staged", [False, True], ids=["registered", "staged"])
def test_overflow_posted_once_its_offset_is_known(mode, priv, staged, monkeypatch, mesh, num_ranks):
    """`peer` posts a destination's OVER write while COUNTS are still coming once the COUNTS of the
    sources below us remote to it are in (Exchange::overflow_offset_known): with the last rank 0.3 s
    late (run_ops' `late`), rank 0 (no source below it) posts every OVER before the late rank's
    COUNTS, so proxy_stats' over_early > 0 summed over ranks and processes; `priv` and `off` post
    OVER after every COUNTS (0). The offsets so computed match the receivers' (the oracle, outputs
    poisoned, every row through OVER or one row through PRIV; under row staging too)."""
    import numpy as np
    from jax.experimental import multihost_utils

    if num_ranks < 2:
        pytest.skip("needs a late rank and another")
    monkeypatch.setenv("JAX_MOE_A2A_PROXY_PIPELINE", mode)
    if staged:
        monkeypatch.setenv("JAX_MOE_A2A_HOST_STAGED", "1")
    spec = a2a.Spec(num_experts=4 * num_ranks, experts_per_token=4, hidden=64, max_tokens_per_rank=24)
    comm = proxied(spec, mesh, priv, node_size=0)
    seed = T.fresh_seed()
    for step in range(2):
        inputs = T.make_inputs(spec, num_ranks, seed + step, routing=["random", "skewed"][step])
        try:
            T.check_all(comm, inputs, T.run_ops(comm, inputs, poison=True, late=(num_ranks - 1, 0.3)))
        except AssertionError as e:
            raise AssertionError(f"seed {seed + step}: {e}") from e
    stats = comm.proxy_stats()
    mine = sum(s["over_early"] for s in stats.values())
    comm.close()
    early = int(np.sum(multihost_utils.process_allgather(np.array([mine], np.int64))))
    if mode == "peer":
        assert early > 0, f"no OVER write before every COUNTS with a late rank: {stats}"
    else:
        assert early == 0, stats


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("node_size", [0, 2], ids=["all-via-engine", "node2-hybrid"])
def test_pipeline_two_slots(mode, node_size, monkeypatch, mesh, num_ranks):
    """Two dispatches in flight on slots 0 and 1, then both combines: the per-peer and per-source
    flags of one slot never stand for the other's."""
    skip_unless_node_fits(node_size, num_ranks)
    monkeypatch.setenv("JAX_MOE_A2A_PROXY_PIPELINE", mode)
    spec = a2a.Spec(num_experts=2 * num_ranks, experts_per_token=2, hidden=32, max_tokens_per_rank=8, slots=2)
    check_two_slots(proxied(spec, mesh, priv=0, node_size=node_size), mesh)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("extra", ["JAX_MOE_A2A_HOST_STAGED", "JAX_MOE_A2A_HOST_FLAG_MIRROR"],
                         ids=["staged", "flag-mirror"])
def test_pipeline_with_staging_or_mirror(extra, mode, monkeypatch, mesh, num_ranks):
    """Both modes under row staging (the sends wait for the whole pack's copy, the per-source flags
    for the landed rows' copy) and under the flag mirror (the receiver reads the mirror's d_landed
    only): the oracle still holds; under the mirror nothing is unpacked before d_landed."""
    monkeypatch.setenv("JAX_MOE_A2A_PROXY_PIPELINE", mode)
    monkeypatch.setenv(extra, "1")
    comm = proxied_three_steps(mesh, num_ranks, T.fresh_seed(), priv=0)
    stats = comm.proxy_stats()
    assert stats, "no proxy on this process"
    for r, s in stats.items():
        assert s["pipeline"] == (mode != "off"), (r, s)
        if mode == "off" or extra == "JAX_MOE_A2A_HOST_FLAG_MIRROR":
            assert s["recv_early"] == 0, (r, s)
    comm.close()


@pytest.mark.parametrize("var, value, match", [
    ("JAX_MOE_A2A_PROXY_PIPELINE", "chunk", "JAX_MOE_A2A_PROXY_PIPELINE=chunk: expected `peer`, `priv` or `off`"),
    ("JAX_MOE_A2A_PROXY_SPIN_US", "20us", "JAX_MOE_A2A_PROXY_SPIN_US='20us': expected a non-negative number"),
], ids=["pipeline-mode", "spin-us"])
def test_proxy_bad_value(var, value, match, monkeypatch, mesh, num_ranks):
    """An unknown pipelining mode, or a proxy number that is not one (cc/core/env.h get_double, which
    strtod alone read as 20), is refused at init, naming the variable. One process only: each
    process's proxies refuse it once their engines connected, so another process may wait at a
    later rendezvous for ranks that already failed (a timeout, not this message)."""
    if jax.process_count() > 1:
        pytest.skip("one process only (see the docstring)")
    monkeypatch.setenv(var, value)
    spec = a2a.Spec(num_experts=2 * num_ranks, experts_per_token=2, hidden=32, max_tokens_per_rank=4)
    with pytest.raises(Exception, match=match):
        proxied(spec, mesh)


@pytest.mark.parametrize("mode", MODES)
def test_staged_rows_copied_source_by_source(mode, monkeypatch, mesh, num_ranks):
    """Row staging (JAX_MOE_A2A_HOST_STAGED: the host backend's memcpy stand-in for the cuda path's
    copy-engine copies) copies the landed dispatch rows source by source, each as soon as its PRIV
    and OVER rows are all here, while later sources' are still in flight: with the last rank's
    dispatch 0.3 s late (run_ops' `late`), the others copy their early sources' rows before the late
    one's land (proxy_stats' staged_early > 0, summed over ranks, steps and processes), the same
    for the combine's landed rows (comb_staged_early: the late rank's COMB rows come last too), and
    under `peer` raise each source's flag after its copy. The results match the oracle (outputs
    poisoned), three steps."""
    import numpy as np
    from jax.experimental import multihost_utils

    if num_ranks < 3:
        pytest.skip("needs a late rank and two others")
    monkeypatch.setenv("JAX_MOE_A2A_PROXY_PIPELINE", mode)
    monkeypatch.setenv("JAX_MOE_A2A_HOST_STAGED", "1")
    # The late rank's COUNTS go out before it packs, its rows 30 ms apart per destination: under
    # `peer` the others' OVER rows land before its COUNTS (they need no offset of it), so only rows
    # landing after every COUNTS leave a window to copy the early sources in.
    monkeypatch.setenv("JAX_MOE_A2A_HOST_PACK_PAUSE_S", "0.03")
    spec = a2a.Spec(num_experts=4 * num_ranks, experts_per_token=4, hidden=64, max_tokens_per_rank=32)
    comm = proxied(spec, mesh, 0, node_size=0)
    for step in range(3):
        inputs = T.make_inputs(spec, num_ranks, T.fresh_seed())
        T.check_all(comm, inputs, T.run_ops(comm, inputs, poison=True, late=(num_ranks - 1, 0.3)))
    stats = comm.proxy_stats()
    mine = [sum(s[k] for s in stats.values()) for k in ("staged_early", "comb_staged_early")]
    comm.close()
    early = np.sum(multihost_utils.process_allgather(np.array(mine, np.int64)).reshape(-1, 2), axis=0)
    assert early[0] > 0, f"no source's dispatch rows copied before the late rank's landed in 3 steps: {stats}"
    assert early[1] > 0, f"no expert rank's COMB rows copied before the late rank's landed in 3 steps: {stats}"
