"""pyproject.toml's promise: `pip install .` (build isolation) compiles the XLA FFI handlers
against the jaxlib that [build-system] requires pins, and that jaxlib is the floor of the
jax/jaxlib the package depends on. XLA registers handlers built with older FFI headers, never
newer ones (xla/ffi/api/c_api.h, "Version"), so the extension then loads on every jaxlib the
dependencies allow (scripts/pip_install_check.sh runs that route in a clean venv in CI)."""

import pathlib
import re
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
tomllib = pytest.importorskip("tomllib")


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def build_pins() -> dict:
    """{"jax": version, "jaxlib": version}: [build-system] requires' exact pins for this Python."""
    pins = {}
    for req in _pyproject()["build-system"]["requires"]:
        m = re.fullmatch(r"(jax|jaxlib)==([\w.]+)\s*(?:;\s*python_version\s*<\s*'([\d.]+)')?", req.strip())
        if m and (m.group(3) is None or sys.version_info[:2] < tuple(map(int, m.group(3).split(".")))):
            pins[m.group(1)] = m.group(2)
    return pins


def _floors() -> dict:
    out = {}
    for req in _pyproject()["project"]["dependencies"]:
        m = re.fullmatch(r"(jax|jaxlib)>=([\w.]+)", req.strip())
        if m:
            out[m.group(1)] = m.group(2)
    return out


def test_build_pins_the_jaxlib_floor():
    pins, floors = build_pins(), _floors()
    assert set(pins) == {"jax", "jaxlib"}, f"[build-system] requires should pin jax and jaxlib exactly: {pins}"
    assert set(floors) == {"jax", "jaxlib"}, f"dependencies should give jax and jaxlib a floor: {floors}"
    assert pins == floors, f"the build's jaxlib must be the oldest the package allows: pins {pins}, floors {floors}"


def test_python_floor_matches_the_pinned_jax():
    # jax 0.7 needs Python 3.11: a 3.10 user would get a build environment pip cannot make
    req = _pyproject()["project"]["requires-python"]
    assert re.fullmatch(r">=3\.(\d+)", req) and int(req[4:]) >= 11, req


def test_newer_pythons_than_the_pins_wheels_get_an_unpinned_jaxlib():
    reqs = [r.replace(" ", "") for r in _pyproject()["build-system"]["requires"]]
    marks = {re.search(r"python_version(<|>=)'([\d.]+)'", r).groups() for r in reqs if "python_version" in r}
    assert {op for op, _ in marks} == {"<", ">="} and len({v for _, v in marks}) == 1, reqs
