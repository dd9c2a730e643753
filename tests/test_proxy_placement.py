"""Where a GPU's proxy thread runs (cc/proxy/topology.h): a CPU of the GPU's NUMA node, read from
Linux sysfs (`bus/pci/devices/<bus id>/local_cpulist`), within the process's affinity, a different
one per local rank. Tested against a fake sysfs tree; on a GPU machine `proxy_stats()["cpu"]`
says where each rank's thread went."""

import pytest

from jax_moe_a2a import _ffi

_C = _ffi._C
pytestmark = pytest.mark.skipif(_C is None or not hasattr(_C, "proxy"), reason="built without libfabric (no proxy)")

BUS = "0000:1b:00.0"


def fake_sysfs(tmp_path, cpulist, bus=BUS):
    d = tmp_path / "bus" / "pci" / "devices" / bus
    d.mkdir(parents=True)
    (d / "local_cpulist").write_text(cpulist)
    return str(tmp_path)


@pytest.mark.parametrize("text,want", [
    ("0-3,8,10-11\n", [0, 1, 2, 3, 8, 10, 11]),
    ("5", [5]),
    (" 0-1 , 4 ", [0, 1, 4]),
    ("", []),
    ("3-1", []),
    ("0-x", []),
    ("1,,2", []),
])
def test_parse_cpulist(text, want):
    assert _C.proxy.parse_cpulist(text) == want


def test_cpu_near_device_counts_down_from_the_highest_local_cpu(tmp_path):
    root = fake_sysfs(tmp_path, "0-7\n")
    picks = [_C.proxy.cpu_near_device(root, "0000:1B:00.0", i, []) for i in range(9)]  # bus id in any case
    assert picks == [7, 6, 5, 4, 3, 2, 1, 0, 7]


def test_cpu_near_device_stays_within_the_allowed_cpus(tmp_path):
    root = fake_sysfs(tmp_path, "0-3,8-11")
    assert [_C.proxy.cpu_near_device(root, BUS, i, [2, 3, 9, 20]) for i in range(4)] == [9, 3, 2, 9]
    assert _C.proxy.cpu_near_device(root, BUS, 0, [4, 5]) == -1  # none of the node's CPUs allowed


def test_cpu_near_device_unknown_topology(tmp_path):
    assert _C.proxy.cpu_near_device(str(tmp_path), BUS, 0, []) == -1  # no such device
    root = fake_sysfs(tmp_path, "garbage")
    assert _C.proxy.cpu_near_device(root, BUS, 0, []) == -1


def test_allowed_cpus_is_this_process_affinity():
    import os
    assert sorted(_C.proxy.allowed_cpus()) == sorted(os.sched_getaffinity(0))


def test_local_process_rank_from_the_launcher(monkeypatch):
    for var in ("OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    assert _C.proxy.local_process_rank() == 0
    monkeypatch.setenv("LOCAL_RANK", "5")
    assert _C.proxy.local_process_rank() == 5
    monkeypatch.setenv("SLURM_LOCALID", "2")
    assert _C.proxy.local_process_rank() == 2  # Slurm's before a generic LOCAL_RANK
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "junk")
    assert _C.proxy.local_process_rank() == 2  # unparsable: the next one
