"""Run from the checkout's root, `import jax_moe_a2a` finds the source folder (no compiled _C)
before the installed package: the import warns, naming both, and asking for a native backend says
why it is missing (not "the extension is not built")."""

import pathlib
import subprocess
import sys

import pytest

import jax_moe_a2a as a2a
from jax_moe_a2a import _ffi
from conftest import subprocess_env

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _fake_checkout(tmp_path, with_c: bool):
    root = tmp_path / "checkout"
    (root / "cc").mkdir(parents=True)
    (root / "pyproject.toml").write_text("")
    (root / "jax_moe_a2a").mkdir()
    (root / "jax_moe_a2a" / "__init__.py").write_text("")
    site = tmp_path / "site"
    (site / "jax_moe_a2a").mkdir(parents=True)
    (site / "jax_moe_a2a" / "__init__.py").write_text("")
    if with_c:
        (site / "jax_moe_a2a" / "_C.cpython-311-x86_64-linux-gnu.so").write_text("")
    return root, site


@pytest.mark.parametrize("with_c", [True, False])
def test_shadowing_names_the_installed_package(tmp_path, with_c):
    root, site = _fake_checkout(tmp_path, with_c)
    msg = _ffi.shadowing(str(root / "jax_moe_a2a"), path=[str(root), str(site)])
    assert msg and f"source checkout {root / 'jax_moe_a2a'}" in msg, msg
    if with_c:
        assert f"installed jax_moe_a2a at {site / 'jax_moe_a2a'}" in msg, msg
    else:
        assert "no installed jax_moe_a2a" in msg and "pip install ." in msg, msg


def test_no_shadowing_outside_a_checkout(tmp_path):
    _, site = _fake_checkout(tmp_path, True)
    assert _ffi.shadowing(str(site / "jax_moe_a2a"), path=[str(site)]) is None


def test_run_from_the_repository_root_says_so():
    if not _ffi.native_available() or not (ROOT / "pyproject.toml").is_file():
        pytest.skip("needs the installed package with _C and the checkout it was built from")
    installed = pathlib.Path(a2a.__file__).resolve().parent
    if installed == ROOT / "jax_moe_a2a":
        pytest.skip("the extension lives in the source folder (an in-place build)")
    code = ("import jax, jax_moe_a2a as a2a\n"
            "print('backends', a2a.available_backends())\n"
            "spec = a2a.Spec(num_experts=8, experts_per_token=2, hidden=128, max_tokens_per_rank=4)\n"
            "mesh = jax.sharding.Mesh(jax.devices(), ('ep',))\n"
            "try:\n"
            "    a2a.init(spec, mesh, axis='ep', backend='host')\n"
            "except ValueError as e:\n"
            "    print('init:', e)\n")
    env = subprocess_env(PYTHONPATH=str(installed.parent))   # the installed package stays importable, after ''
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-3000:]
    assert "backends ['reference']" in res.stdout, out[-3000:]
    assert "RuntimeWarning: jax_moe_a2a was imported from the source checkout" in res.stderr, out[-3000:]
    assert f"installed jax_moe_a2a at {installed}" in res.stderr, out[-3000:]
    init_line = next(line for line in res.stdout.splitlines() if line.startswith("init:"))
    assert "source checkout" in init_line and "not built" not in init_line, init_line
