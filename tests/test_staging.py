"""The proxy's row staging (cc/proxy/staging.h), tested without a GPU.

Under JAX_MOE_A2A_STAGING=copy the cuda backend's kernels pack and unpack rows in GPU memory and the
proxy copies each step's rows to and from the registered host buffers with the copy engines
(cc/cuda/row_copies.h). The proxy's side of it (which bytes each step copies, and that no write goes
out and no flag is raised before its copy is done) is the same for every packer, so it is checked
here through the host backend's proxied mode with JAX_MOE_A2A_HOST_STAGED=1: the host packs and
unpacks in buffers of its own, and a memcpy stand-in (cc/host/staged_rows.h) makes each copy on the
first poll after its start, which still reports it pending. A range the proxy forgets or cuts short
leaves zero or stale rows (the registered buffers and ours start out apart and are never shared),
which the oracle catches. (A range outside its buffer throws in proxy::check_ranges; no test
reaches that, the Exchange's ranges being in bounds by construction.)

    pytest tests/test_staging.py
    mpirun -n 2 python -m pytest -m mpi tests/test_staging.py
"""

import pytest

import jax_moe_a2a as a2a
from jax_moe_a2a import testing as T

from test_protocol import check_two_slots
from test_proxy import check_fresh_steps, proxied, proxied_three_steps

pytestmark = [pytest.mark.mpi,
              pytest.mark.skipif("host" not in a2a.available_backends(), reason="host backend not built")]


@pytest.mark.parametrize("pieces", [False, True], ids=["whole", "pieces"])
@pytest.mark.parametrize("node_size, priv, tp", [(0, 0, 1), (0, None, 1), (2, 1, 1), (0, 1, 2)],
                         ids=["priv0", "privfull", "node2-priv1", "tp2-priv1"])
def test_staged_rows_against_oracle(node_size, priv, tp, pieces, monkeypatch, mesh, num_ranks):
    """Every op of several steps (random, skewed and one-hot routing; fewer tokens; a fresh seed)
    against the oracle, outputs poisoned, with the proxy staging every row; its counters show the
    copies happened. `pieces`: PRIV / OVER in 128-byte pieces and every COMB in three, the pieces
    copied back to back and each posted as its copy ends (Proxy::pump_pieces; a tp group's COMB rows
    copied once for all its members), landed pieces copied as they land."""
    monkeypatch.setenv("JAX_MOE_A2A_HOST_STAGED", "1")
    if pieces:
        monkeypatch.setenv("JAX_MOE_A2A_WRITE_CHUNK_KIB", "0.125")
        monkeypatch.setenv("JAX_MOE_A2A_COMB_PIECES", "3")
    seed = T.fresh_seed()
    try:
        comm = proxied_three_steps(mesh, num_ranks, seed, priv, node_size, tp)
    except AssertionError as e:
        raise AssertionError(f"seed {seed}: {e}") from e
    stats = comm.proxy_stats()
    assert stats, "no proxy on this process"
    for r, s in stats.items():
        assert s["dispatches"] >= 1 and s["combines"] >= 1, (r, s)  # the last step's counters may lag
        # every rank sends and receives rows through the engine in these routings (a remote peer exists)
        assert s["staged_bytes"] > 0 and s["staging_ns"] > 0, (r, s)
        # the copies' wall time: some, and never more than their summed durations
        assert 0 < s["staging_busy_ns"] <= s["staging_ns"], (r, s)
    if pieces:  # pieces went out while the next was copied, summed over every process (a rank may have no rows)
        import numpy as np
        from jax.experimental import multihost_utils
        mine = np.array([sum(s[k] for s in stats.values()) for k in ("comb_pieces", "pieces_behind_copy")], np.int64)
        total = np.sum(multihost_utils.process_allgather(mine).reshape(-1, 2), axis=0)
        assert (total > 0).all(), (total, stats)
    comm.close()


def test_staged_rows_two_slots(monkeypatch, mesh, num_ranks):
    """Two dispatches in flight on slots 0 and 1, then both combines: each slot's copies are its own."""
    monkeypatch.setenv("JAX_MOE_A2A_HOST_STAGED", "1")
    spec = a2a.Spec(num_experts=2 * num_ranks, experts_per_token=2, hidden=32, max_tokens_per_rank=8, slots=2)
    check_two_slots(proxied(spec, mesh, priv=0), mesh)


def test_unstaged_counts_nothing(monkeypatch, mesh, num_ranks):
    """Without staging the packer writes the registered buffers itself: the proxy copies nothing."""
    monkeypatch.delenv("JAX_MOE_A2A_HOST_STAGED", raising=False)
    spec = a2a.Spec(num_experts=16, experts_per_token=2, hidden=32, max_tokens_per_rank=8)
    comm = proxied(spec, mesh)
    inputs = T.make_inputs(spec, num_ranks, 42)
    T.check_all(comm, inputs, T.run_ops(comm, inputs, poison=True))
    for r, s in comm.proxy_stats().items():
        assert s["staged_bytes"] == 0 and s["staging_ns"] == 0 and s["staging_busy_ns"] == 0, (r, s)
    comm.close()


# Each side of test_landed_pieces_copied_as_they_land: (WRITE_CHUNK_KIB, COMB_PIECES, tokens of
# rank 0, the counter of copies started while some write had not landed).
_EARLY_SIDES = {"dispatch": ("1", "1", 16, "staged_early"), "combine": ("0", "16", 64, "comb_staged_early")}


@pytest.mark.parametrize("side", list(_EARLY_SIDES))
def test_landed_pieces_copied_as_they_land(side, monkeypatch, mesh, num_ranks):
    """Row staging with each copy taking 20 ms (JAX_MOE_A2A_HOST_COPY_PAUSE_S: a sender's pieces
    go out 20 ms apart): a receiving proxy copies the pieces that landed while the rest of the same
    write is still coming (proxy_stats' pieces_copied_early > 0, summed over every process; each
    piece's immediate names its index), the sender starts a write's piece copies back to back
    (copies_in_flight_max > 1), and the results match the oracle, outputs poisoned, in both steps.
    A proxy looks at landed rows only once its own sends of that op are posted (step_dispatch /
    step_combine): with every rank sending alike a peer's last piece may already be in when it
    looks (the race that once left the counter at 0 in the full suite). So only rank 0 has tokens,
    every row private, and each side is made one-sided:
      dispatch: rank 0's PRIV writes in 1 KiB pieces; the other ranks send nothing, look at once
        and watch rank 0's pieces land;
      combine: rank 0's PRIV in one write a peer, every COMB in 16 pieces (~16 rows a peer at 64
        tokens); rank 0's tokens go to other ranks' experts only, so its own COMB writes (itself
        included: with node_size 0 every rank's rows go through the engine) are empty: it looks
        at once and watches the others' pieces land, ~16 x 20 ms a peer."""
    import numpy as np
    from jax.experimental import multihost_utils

    chunk_kib, comb_pieces, tokens, early = _EARLY_SIDES[side]
    monkeypatch.setenv("JAX_MOE_A2A_HOST_STAGED", "1")
    monkeypatch.setenv("JAX_MOE_A2A_HOST_COPY_PAUSE_S", "0.02")
    monkeypatch.setenv("JAX_MOE_A2A_WRITE_CHUNK_KIB", chunk_kib)
    monkeypatch.setenv("JAX_MOE_A2A_COMB_PIECES", comb_pieces)
    spec = a2a.Spec(num_experts=2 * num_ranks, experts_per_token=2, hidden=128, max_tokens_per_rank=tokens)
    comm = proxied(spec, mesh, None)
    others = np.arange(spec.local_experts(num_ranks), spec.num_experts)

    def remote_only(inputs, seed):
        # rank 0's tokens to other ranks' experts only (distinct per token): nothing of its own
        # comes back to it through the engine, so its combine sends are all empty
        rng = np.random.default_rng(seed)
        inputs[0].topk_ids[:] = [rng.choice(others, 2, replace=False) for _ in range(tokens)]
    check_fresh_steps(comm, spec, num_ranks, 2, adjust=remote_only, num_tokens=[tokens] + [0] * (num_ranks - 1))
    stats = comm.proxy_stats()
    comm.close()
    mine = np.array([sum(s["pieces_copied_early"] for s in stats.values()), sum(s[early] for s in stats.values()),
                     max(s["copies_in_flight_max"] for s in stats.values())], np.int64)
    every = multihost_utils.process_allgather(mine).reshape(-1, 3)
    assert every[:, 0].sum() > 0, f"{side}: no landed piece copied before the rest of its write in 2 steps: {stats}"
    assert every[:, 1].sum() > 0, f"{side}: no {early} in 2 steps: {stats}"
    # a write's pieces are copied back to back, not one copy at a time
    assert every[:, 2].max() > 1, f"{side}: never more than one copy of a buffer in flight: {stats}"


def test_combine_copies_landed_pieces_while_sending(monkeypatch, mesh, num_ranks):
    """Row staging with every rank sending alike (every token present, random routing), each COMB
    in four pieces and each copy taking 20 ms: while a proxy's own COMB pieces are still going out
    (step_combine's kCSendCopy), it copies the peers' COMB pieces that landed meanwhile, so every
    rank, not only the one whose sends ended first, starts a copy before every COMB is in
    (comb_staged_early > 0 on every rank), and the results match the oracle, outputs poisoned."""
    import numpy as np
    from jax.experimental import multihost_utils

    monkeypatch.setenv("JAX_MOE_A2A_HOST_STAGED", "1")
    monkeypatch.setenv("JAX_MOE_A2A_HOST_COPY_PAUSE_S", "0.02")
    monkeypatch.setenv("JAX_MOE_A2A_WRITE_CHUNK_KIB", "0")
    monkeypatch.setenv("JAX_MOE_A2A_COMB_PIECES", "4")
    spec = a2a.Spec(num_experts=2 * num_ranks, experts_per_token=2, hidden=128, max_tokens_per_rank=16)
    comm = proxied(spec, mesh, None)
    check_fresh_steps(comm, spec, num_ranks, 2, num_tokens=spec.max_tokens_per_rank)
    stats = comm.proxy_stats()
    comm.close()
    mine = np.array([min(s["comb_staged_early"] for s in stats.values())], np.int64)
    fewest = multihost_utils.process_allgather(mine).min()
    assert fewest > 0, f"a rank copied no COMB rows before every COMB landed in 2 steps: {stats}"


@pytest.mark.mpi
@pytest.mark.parametrize("depth", [1, 2])
def test_copy_depth_bounds_the_copies_in_flight(depth, monkeypatch, mesh, num_ranks):
    """JAX_MOE_A2A_COPY_DEPTH caps row staging's copies of one buffer in flight (Proxy::can_stage):
    with slowed host copies and writes in pieces (each COMB in 4, PRIV in 1 KiB pieces) the copies
    queue up to the cap and never past it (proxy_stats' copies_in_flight_max: at most `depth` on
    every rank, `depth` on some), and every op still matches the oracle, outputs poisoned."""
    import numpy as np
    from jax.experimental import multihost_utils

    monkeypatch.setenv("JAX_MOE_A2A_HOST_STAGED", "1")
    monkeypatch.setenv("JAX_MOE_A2A_HOST_COPY_PAUSE_S", "0.01")
    monkeypatch.setenv("JAX_MOE_A2A_WRITE_CHUNK_KIB", "1")
    monkeypatch.setenv("JAX_MOE_A2A_COMB_PIECES", "4")
    monkeypatch.setenv("JAX_MOE_A2A_COPY_DEPTH", str(depth))
    spec = a2a.Spec(num_experts=2 * num_ranks, experts_per_token=2, hidden=128, max_tokens_per_rank=16)
    comm = proxied(spec, mesh, 0)
    check_fresh_steps(comm, spec, num_ranks, 2)
    stats = comm.proxy_stats()
    comm.close()
    deepest = multihost_utils.process_allgather(
        np.array([max(s["copies_in_flight_max"] for s in stats.values())], np.int64)).max()
    assert deepest == depth, f"copies in flight at most {deepest} with JAX_MOE_A2A_COPY_DEPTH={depth}: {stats}"


def test_copy_depth_must_be_1_to_16(monkeypatch, mesh, num_ranks):
    """JAX_MOE_A2A_COPY_DEPTH outside the integers 1..16 is refused when the communicator is
    created, naming the variable."""
    spec = a2a.Spec(num_experts=2 * num_ranks, experts_per_token=2, hidden=32, max_tokens_per_rank=4)
    for bad in ("0", "17", "1.5", "deep"):
        monkeypatch.setenv("JAX_MOE_A2A_COPY_DEPTH", bad)
        with pytest.raises(ValueError, match="JAX_MOE_A2A_COPY_DEPTH"):
            proxied(spec, mesh, 0).close()
