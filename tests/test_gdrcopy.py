"""GDRCopy selection for the proxy's host -> GPU flags (cc/proxy/gdrcopy.h), tested without a GPU.

Where /dev/gdrdrv and libgdrapi.so.2 exist the cuda backend's proxy writes the kernels' flags into
GPU memory through a GDRCopy BAR mapping; elsewhere they stay in mapped pinned host memory and
`proxy_stats()[rank]["flag_path"]` says why ("mapped-host: /dev/gdrdrv not found", ...). The probe
is reached through `_C.proxy.gdrcopy_status` / `gdrcopy_select` with fake driver nodes and
libraries (JAX_MOE_A2A_GDRCOPY_DEV / _LIB), and through the host backend's proxied mode, whose
proxy reports the same probe.

    pytest tests/test_gdrcopy.py
    mpirun -n 2 python -m pytest -m mpi tests/test_gdrcopy.py      (the host backend's stats over libfabric)
"""

import os
import shutil
import subprocess
import time

import jax
import pytest

import jax_moe_a2a as a2a
from jax_moe_a2a import _ffi
from jax_moe_a2a import testing as T

_C = _ffi._C
pytestmark = pytest.mark.skipif(_C is None or not hasattr(_C, "proxy") or not hasattr(_C.proxy, "gdrcopy_status"),
                                reason="built without libfabric (no proxy)")

HAVE_GDRDRV = os.path.exists("/dev/gdrdrv")

# A stand-in for libgdrapi with the entry points the loader needs: gdr_open succeeds unless
# FAKE_GDR_OPEN_FAIL is set. Only gdr_open / gdr_close are ever called by the probe.
FAKE_GDRAPI = r"""
#include <stdlib.h>
#include <stddef.h>
#include <stdint.h>
typedef struct { unsigned long h; } mh_t;
static int state;
void* gdr_open(void) { return getenv("FAKE_GDR_OPEN_FAIL") ? NULL : (void*)&state; }
int gdr_close(void* g) { (void)g; return 0; }
int gdr_pin_buffer(void* g, unsigned long a, size_t n, uint64_t t, uint32_t v, mh_t* h) { return -1; }
int gdr_unpin_buffer(void* g, mh_t h) { return 0; }
int gdr_get_info_v2(void* g, mh_t h, void* info) { return -1; }
int gdr_map(void* g, mh_t h, void** va, size_t n) { return -1; }
int gdr_unmap(void* g, mh_t h, void* va, size_t n) { return 0; }
int gdr_copy_to_mapping(mh_t h, void* d, const void* s, size_t n) { return 0; }
"""


@pytest.fixture
def fake_dev(tmp_path):
    p = tmp_path / "gdrdrv"
    p.write_text("")
    return str(p)


@pytest.fixture(scope="module")
def fake_lib(tmp_path_factory):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler for the fake libgdrapi")
    d = tmp_path_factory.mktemp("fakegdr")
    (d / "fake.c").write_text(FAKE_GDRAPI)
    out = d / "libfakegdrapi.so"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(out), str(d / "fake.c")], check=True)
    return str(out)


def status(**kw):
    return tuple(_C.proxy.gdrcopy_status(**kw))


def test_no_driver_node(tmp_path):
    missing = str(tmp_path / "nope" / "gdrdrv")
    assert status(mode="auto", device=missing) == (False, f"{missing} not found")
    assert _C.proxy.gdrcopy_select(mode="auto", device=missing) == f"mapped-host: {missing} not found"


@pytest.mark.skipif(HAVE_GDRDRV, reason="this machine has /dev/gdrdrv")
def test_default_paths_here(monkeypatch):
    """Defaults: /dev/gdrdrv is absent on our CPU and GPU machines."""
    for v in ("JAX_MOE_A2A_GDRCOPY", "JAX_MOE_A2A_GDRCOPY_DEV", "JAX_MOE_A2A_GDRCOPY_LIB"):
        monkeypatch.delenv(v, raising=False)
    assert status() == (False, "/dev/gdrdrv not found")
    assert _C.proxy.gdrcopy_select() == "mapped-host: /dev/gdrdrv not found"


def test_library_missing(fake_dev, tmp_path):
    lib = str(tmp_path / "libgdrapi.so.2")
    ok, why = status(mode="auto", device=fake_dev, library=lib)
    assert not ok and why.startswith(f"{lib} not found (")
    ok, why = status(mode="auto", device=fake_dev, library="libgdrapi-does-not-exist.so.2")
    assert not ok and why.startswith("libgdrapi-does-not-exist.so.2 not found")


def test_library_without_the_api(fake_dev):
    ok, why = status(mode="auto", device=fake_dev, library="libm.so.6")
    assert not ok and why.startswith("libm.so.6 lacks gdr_open, gdr_close, gdr_pin_buffer"), why


def test_disabled(fake_dev, fake_lib):
    assert status(mode="0", device=fake_dev, library=fake_lib) == (False, "disabled by JAX_MOE_A2A_GDRCOPY=0")
    assert status(mode="off", device=fake_dev, library=fake_lib)[0] is False
    assert _C.proxy.gdrcopy_select(mode="0", device=fake_dev) == "mapped-host: disabled by JAX_MOE_A2A_GDRCOPY=0"


def test_fake_library(fake_dev, fake_lib, monkeypatch):
    """A library with every entry point and a driver node: available; gdr_open failing: not."""
    monkeypatch.delenv("FAKE_GDR_OPEN_FAIL", raising=False)
    assert status(mode="auto", device=fake_dev, library=fake_lib) == (True, "gdrcopy")
    assert _C.proxy.gdrcopy_select(mode="1", device=fake_dev, library=fake_lib) == "gdrcopy"
    monkeypatch.setenv("FAKE_GDR_OPEN_FAIL", "1")
    assert status(mode="auto", device=fake_dev, library=fake_lib) == (False, "gdr_open failed")
    assert _C.proxy.gdrcopy_select(mode="auto", device=fake_dev, library=fake_lib) == "mapped-host: gdr_open failed"


def test_require_fails_clearly(tmp_path):
    missing = str(tmp_path / "gdrdrv")
    with pytest.raises(RuntimeError, match=r"JAX_MOE_A2A_GDRCOPY=1 requires GDRCopy .* but .*gdrdrv not found"):
        _C.proxy.gdrcopy_select(mode="1", device=missing)
    # status only reports: no exception
    assert status(mode="1", device=missing) == (False, f"{missing} not found")


def test_bad_mode():
    with pytest.raises(ValueError, match="JAX_MOE_A2A_GDRCOPY must be 0, 1 or auto"):
        status(mode="maybe")


def test_environment(monkeypatch, tmp_path, fake_dev, fake_lib):
    """None arguments read JAX_MOE_A2A_GDRCOPY / _DEV / _LIB at call time."""
    missing = str(tmp_path / "gdrdrv-missing")
    monkeypatch.setenv("JAX_MOE_A2A_GDRCOPY_DEV", missing)
    monkeypatch.delenv("JAX_MOE_A2A_GDRCOPY", raising=False)
    assert status() == (False, f"{missing} not found")
    monkeypatch.setenv("JAX_MOE_A2A_GDRCOPY", "0")
    assert status() == (False, "disabled by JAX_MOE_A2A_GDRCOPY=0")
    monkeypatch.setenv("JAX_MOE_A2A_GDRCOPY", "1")
    with pytest.raises(RuntimeError, match="requires GDRCopy"):
        _C.proxy.gdrcopy_select()
    monkeypatch.setenv("JAX_MOE_A2A_GDRCOPY", "auto")
    monkeypatch.setenv("JAX_MOE_A2A_GDRCOPY_DEV", fake_dev)
    monkeypatch.setenv("JAX_MOE_A2A_GDRCOPY_LIB", fake_lib)
    monkeypatch.delenv("FAKE_GDR_OPEN_FAIL", raising=False)
    assert status() == (True, "gdrcopy")


@pytest.mark.mpi
@pytest.mark.skipif("host" not in a2a.available_backends(), reason="host backend not built")
@pytest.mark.parametrize("env, want", [
    ({}, None),  # the machine's own answer (/dev/gdrdrv not found here)
    ({"JAX_MOE_A2A_GDRCOPY_DEV": "/nonexistent/gdrdrv"}, "mapped-host: /nonexistent/gdrdrv not found"),
    ({"JAX_MOE_A2A_GDRCOPY": "0"}, "mapped-host: disabled by JAX_MOE_A2A_GDRCOPY=0"),
    ({"JAX_MOE_A2A_GDRCOPY": "1", "JAX_MOE_A2A_GDRCOPY_DEV": "/nonexistent/gdrdrv"},
     "mapped-host: /nonexistent/gdrdrv not found"),  # the host backend never needs GPU memory
], ids=["default", "no-node", "disabled", "required-but-host"])
def test_host_proxy_reports_flag_path(env, want, monkeypatch, mesh, num_ranks):
    """The host backend's proxied mode runs the proxy on CPUs; its stats name the flag path and
    the probe's reason, read when the proxy starts (at init)."""
    for v in ("JAX_MOE_A2A_GDRCOPY", "JAX_MOE_A2A_GDRCOPY_DEV", "JAX_MOE_A2A_GDRCOPY_LIB"):
        monkeypatch.delenv(v, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    if want is None:
        if HAVE_GDRDRV:
            pytest.skip("this machine has /dev/gdrdrv")
        want = "mapped-host: /dev/gdrdrv not found"
    spec = a2a.Spec(num_experts=2 * num_ranks, experts_per_token=2, hidden=32, max_tokens_per_rank=4)
    comm = a2a.init(spec, mesh, "ep", backend="host", proxied=True, timeout_s=60.0)
    inputs = T.make_inputs(spec, num_ranks, 7)
    T.check_all(comm, inputs, T.run_ops(comm, inputs))
    deadline = time.monotonic() + 10  # the proxy counts a combine after its last flag, on its own thread
    while True:
        stats = comm.proxy_stats()
        if all(s["combines"] >= 1 for s in stats.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    local = [r for r, d in enumerate(mesh.devices.flat) if d.process_index == jax.process_index()]
    assert sorted(stats) == local
    for r, s in stats.items():
        assert s["flag_path"] == want, (r, s)
        assert s["dispatches"] >= 1 and s["combines"] >= 1, (r, s)
    comm.close()


# ---- the proxy's mirror stores (the gdrcopy path's proxy half), checked on CPUs ---------------------
# JAX_MOE_A2A_HOST_FLAG_MIRROR=1: the host backend's proxy stores its flags into a second Ctrl block
# the way it stores into GPU memory under GDRCopy (FlagPath::mirror), and the host backend reads
# d_send_ok, d_landed, over_base, c_send_ok, c_landed and the error code only there, as the kernels
# read RemotePtrs::in. A flag or overflow base the proxy forgot to mirror hangs a wait or misplaces
# overflow rows, which the oracle catches.
MIRROR = "host-mirror: the proxy's flags read from a second block (JAX_MOE_A2A_HOST_FLAG_MIRROR=1)"


@pytest.mark.mpi
@pytest.mark.skipif("host" not in a2a.available_backends(), reason="host backend not built")
@pytest.mark.parametrize("node_size, priv", [(0, 0), (0, None), (2, 1)], ids=["priv0", "privfull", "node2-priv1"])
def test_mirrored_flags_against_oracle(node_size, priv, monkeypatch, mesh, num_ranks):
    from test_proxy import proxied_three_steps
    monkeypatch.setenv("JAX_MOE_A2A_HOST_FLAG_MIRROR", "1")
    comm = proxied_three_steps(mesh, num_ranks, 900, priv, node_size)
    assert {s["flag_path"] for s in comm.proxy_stats().values()} == {MIRROR}
    comm.close()


@pytest.mark.mpi
@pytest.mark.skipif("host" not in a2a.available_backends(), reason="host backend not built")
def test_mirrored_flags_two_slots(monkeypatch, mesh, num_ranks):
    from test_protocol import check_two_slots
    monkeypatch.setenv("JAX_MOE_A2A_HOST_FLAG_MIRROR", "1")
    spec = a2a.Spec(num_experts=2 * num_ranks, experts_per_token=2, hidden=32, max_tokens_per_rank=8, slots=2)
    check_two_slots(a2a.init(spec, mesh, "ep", backend="host", proxied=True, max_private_tokens=0), mesh)


@pytest.mark.mpi
@pytest.mark.skipif("host" not in a2a.available_backends(), reason="host backend not built")
def test_mirrored_error_record(monkeypatch, mesh, num_ranks):
    """The proxy's failure reaches the reader through the mirror's error code (several processes)."""
    from test_protocol import check_never_calls
    if jax.process_count() < 2:
        pytest.skip("needs several processes (a rank that never calls cannot be made in one program)")
    monkeypatch.setenv("JAX_MOE_A2A_HOST_FLAG_MIRROR", "1")
    spec = a2a.Spec(num_experts=2 * num_ranks, experts_per_token=2, hidden=32, max_tokens_per_rank=4)
    check_never_calls(a2a.init(spec, mesh, "ep", backend="host", proxied=True, max_private_tokens=1, timeout_s=2.0),
                      mesh, "host")
