"""The nvshmem backend's per-peer path (docs/api.md, "NVSHMEM across nodes"): which ranks take the
remote path (bounce rows, blocking puts) after init. On one machine every peer is reachable by
loads and stores, so none is remote unless JAX_MOE_A2A_NVSHMEM_REMOTE=all makes every other rank
remote; scripts/gpu_check.sh runs the nvshmem oracle suites both ways. GPU only (nvshmem)."""

import os

import jax
import pytest

import jax_moe_a2a as a2a

from conftest import BACKENDS

pytestmark = pytest.mark.skipif("nvshmem" not in BACKENDS, reason="nvshmem backend not selected or not available")


@pytest.mark.mpi
def test_remote_peers_follow_the_switch(mesh, num_ranks):
    spec = a2a.Spec(num_experts=2 * num_ranks, experts_per_token=2, hidden=64, max_tokens_per_rank=8)
    comm = a2a.init(spec, mesh, "ep", backend="nvshmem", timeout_s=30)
    peers = comm.diagnostics()["remote_peers"]
    me = jax.process_index()  # one rank per process on this backend
    forced = os.environ.get("JAX_MOE_A2A_NVSHMEM_REMOTE", "auto") == "all"
    assert peers == ([r for r in range(num_ranks) if r != me] if forced else []), peers
    regions = comm.buffer_regions()  # what a communicator may take: with a remote peer
    taken = comm.diagnostics()["bounce_bytes"]  # what this one took at init
    if num_ranks > 1:  # a bounce row per warp of combine_send, 1,024 a slot, of H bf16 values
        assert regions["private_combine_bounce"] >= spec.slots * 1024 * 64 * 2, regions
    else:  # nothing to bounce to
        assert regions["private_combine_bounce"] == 0, regions
    # taken only with a remote peer: none on one machine unless forced
    assert taken == (regions["private_combine_bounce"] if peers else 0), (taken, peers, regions)
    comm.close()


def test_bad_switch_value_is_refused(monkeypatch, mesh):
    monkeypatch.setenv("JAX_MOE_A2A_NVSHMEM_REMOTE", "some")
    spec = a2a.Spec(num_experts=2 * mesh.size, experts_per_token=2, hidden=64, max_tokens_per_rank=8)
    with pytest.raises(ValueError, match="JAX_MOE_A2A_NVSHMEM_REMOTE"):
        a2a.init(spec, mesh, "ep", backend="nvshmem")
