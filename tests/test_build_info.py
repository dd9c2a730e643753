"""The build records what it was built against (jax_moe_a2a/_build_info.py, written by CMake), and
the package warns when an older jaxlib than that one is running (XLA's FFI promises only the
other direction: newer runtimes accept handlers built with older headers)."""

import types

import jax
import jaxlib
import pytest

from jax_moe_a2a import _ffi
from test_packaging import build_pins


def test_build_info_names_the_running_jaxlib():
    info = _ffi.build_info()
    if info is None:
        pytest.skip("no _build_info.py (not an installed build)")
    # scripts/setup.sh builds with --no-build-isolation against the jaxlib that runs the tests;
    # `pip install .` (build isolation) against the floor pyproject.toml pins
    pinned = build_pins().get("jaxlib")
    assert info["jaxlib_version"] in (jaxlib.__version__, pinned), (info, pinned)
    assert info["jax_version"] in (jax.__version__, build_pins().get("jax")), info
    major, minor = info["xla_ffi_api_version"]
    assert major >= 0 and minor >= 0


@pytest.mark.parametrize("built,warns", [("0.1.0", False), (jaxlib.__version__, False), ("999.0.0", True)])
def test_older_running_jaxlib_is_named(monkeypatch, built, warns):
    fake = types.SimpleNamespace(JAXLIB_VERSION=built, JAX_VERSION=built, XLA_FFI_API_VERSION=(0, 1),
                                 CUDA_COMPILER_VERSION="")
    monkeypatch.setattr(_ffi, "_build_info", fake)
    msg = _ffi._jaxlib_mismatch()
    if warns:
        assert msg and f"built against jaxlib {built}" in msg and jaxlib.__version__ in msg
    else:
        assert msg is None
