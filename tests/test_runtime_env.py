"""JAX_MOE_A2A_LOCAL_DEVICE_IDS: which local devices each process gives jax.distributed."""

import pytest

from jax_moe_a2a.runtime import local_device_ids_from_env


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    for var in ("JAX_MOE_A2A_LOCAL_DEVICE_IDS", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)


def test_unset_lets_jax_decide():
    assert local_device_ids_from_env() is None


def test_explicit_ids(monkeypatch):
    monkeypatch.setenv("JAX_MOE_A2A_LOCAL_DEVICE_IDS", "0")
    assert local_device_ids_from_env() == [0]
    monkeypatch.setenv("JAX_MOE_A2A_LOCAL_DEVICE_IDS", "2,3")
    assert local_device_ids_from_env() == [2, 3]


@pytest.mark.parametrize("var", ["OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID", "LOCAL_RANK"])
def test_local_rank(monkeypatch, var):
    monkeypatch.setenv("JAX_MOE_A2A_LOCAL_DEVICE_IDS", "local_rank")
    monkeypatch.setenv(var, "5")
    assert local_device_ids_from_env() == [5]


def test_local_rank_without_launcher(monkeypatch):
    monkeypatch.setenv("JAX_MOE_A2A_LOCAL_DEVICE_IDS", "local_rank")
    with pytest.raises(RuntimeError, match="no local rank variable"):
        local_device_ids_from_env()
