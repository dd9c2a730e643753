"""The library stays apart from its test helpers and its benchmarks: no module of jax_moe_a2a
imports `jax_moe_a2a.testing` (a public helper for tests, never used by the library itself), the
benchmarks' native module `jax_moe_a2a_bench`, the benchmark programs or anything under tests/;
and test doubles live under tests/ (e.g. tests/ragged_emulation.py registers its backend through
the public registry instead of patching the library's modules). Static (the imports each source
spells) and at run time (what importing every module and running an op loads)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "jax_moe_a2a"
# Modules the library must never import (prefixes of dotted names).
APART = ("jax_moe_a2a.testing", "jax_moe_a2a_bench", "benchmarks", "benchlib", "halves", "layers",
         "ragged_emulation", "conftest", "tests")


def _imports(path: Path, root: Path = REPO) -> set[str]:
    """Dotted names a module imports, relative imports resolved against its package (its folder
    under `root`)."""
    tree = ast.parse(path.read_text(), str(path))
    pkg = ".".join(path.relative_to(root).with_suffix("").parts[:-1])
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = pkg.split(".")
                parts = parts[:len(parts) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            out.add(base)
            out |= {f"{base}.{a.name}" for a in node.names}
    return out


def _is_apart(name: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in APART)


def test_no_library_module_imports_test_or_benchmark_code():
    bad = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "testing.py" and path.parent == PACKAGE:
            continue
        hits = sorted(n for n in _imports(path) if _is_apart(n))
        if hits:
            bad[str(path.relative_to(REPO))] = hits
    assert not bad, f"library modules import test or benchmark code: {bad}"


def test_the_import_scan_sees_relative_imports(tmp_path):
    """The scan above resolves `from .. import testing` and `from ..testing import x`."""
    mod = tmp_path / "jax_moe_a2a" / "backends" / "probe.py"
    mod.parent.mkdir(parents=True)
    mod.write_text("from .. import testing\nfrom ..testing import run_ops\nimport jax_moe_a2a_bench\n")
    names = _imports(mod, tmp_path)
    assert {"jax_moe_a2a.testing", "jax_moe_a2a.testing.run_ops", "jax_moe_a2a_bench"} <= names
    assert all(_is_apart(n) for n in ("jax_moe_a2a.testing", "jax_moe_a2a_bench", "ragged_emulation"))
    assert not _is_apart("jax_moe_a2a.testing_other") and not _is_apart("jax_moe_a2a.oracle")


_RUNTIME_CHECK = r"""
import importlib, pkgutil, sys
import numpy as np
import jax, jax.numpy as jnp
import jax_moe_a2a as a2a
failed = []
for m in pkgutil.walk_packages(a2a.__path__, "jax_moe_a2a."):
    if m.name == "jax_moe_a2a.testing":
        continue
    try:
        importlib.import_module(m.name)
    except ImportError as e:  # an optional dependency (flax for nnx) missing here
        failed.append((m.name, str(e)))
from jax.sharding import Mesh
mesh = Mesh(np.array(jax.devices()[:2]), ("ep",))
spec = a2a.Spec(num_experts=4, experts_per_token=2, hidden=8, max_tokens_per_rank=2)
comm = a2a.init(spec, mesh, "ep", backend="reference")
loaded = sorted(n for n in sys.modules if n.startswith(APART))
print("LOADED", loaded, "IMPORT_FAILED", failed)
assert not loaded, loaded
"""


def test_importing_the_library_loads_no_test_or_benchmark_code(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2")
    env.pop("JAX_MOE_A2A_RAGGED_EMULATE", None)
    code = f"APART = {APART!r}\n" + _RUNTIME_CHECK
    # From outside the repository: the installed package, never tests/ or benchmarks/ on the path.
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
