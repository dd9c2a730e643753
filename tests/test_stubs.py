"""The type stubs of the native module (cc/python/stubs/_C/*.pyi, installed as jax_moe_a2a/_C/)
match the module: every function, class and method it exports is in them and nothing else, and,
on a build with every part compiled, they are what nanobind's stubgen writes today. After changing
a binding (cc/python/bind_*.cc, cc/python/module.cc), rebuild, then run scripts/gen_stubs.sh."""

from __future__ import annotations

import ast
import difflib
import importlib.util
import subprocess
import sys
import types
from pathlib import Path

import pytest

from jax_moe_a2a import _ffi

STUBS = Path(__file__).resolve().parents[1] / "cc" / "python" / "stubs" / "_C"
# The build flag of each submodule: a stubbed submodule may be absent only where its part was not built.
BUILT_BY = {"cuda": "built_with_cuda", "nvshmem": "built_with_nvshmem", "host": "built_with_libfabric",
            "transfer": "built_with_libfabric", "proxy": "built_with_libfabric"}
REGEN = "rebuild and run scripts/gen_stubs.sh"


def _native():
    if _ffi._C is None:
        pytest.skip(f"native module not built: {_ffi._IMPORT_ERROR}")
    return _ffi._C


def _stub_names(path: Path) -> tuple[set[str], dict[str, set[str]], set[str]]:
    """(top-level functions and classes, {class: its members}, re-exported submodules) of a stub."""
    tree = ast.parse(path.read_text())
    names, classes, submodules = set(), {}, set()

    def members(cls: ast.ClassDef) -> set[str]:
        return {n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))} | {
            t.id for n in cls.body if isinstance(n, (ast.Assign, ast.AnnAssign))
            for t in (n.targets if isinstance(n, ast.Assign) else [n.target]) if isinstance(t, ast.Name)}

    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.ClassDef):
            names.add(node.name)
            classes[node.name] = members(node)
        elif isinstance(node, ast.ImportFrom) and node.module == "jax_moe_a2a._C":
            submodules |= {a.asname or a.name for a in node.names}
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(t, ast.Name):
                    names.add(t.id)
    return names, classes, submodules


def _public(names) -> set[str]:
    return {n for n in names if not n.startswith("_")}


def _compare(mod: types.ModuleType, stub: Path) -> list[str]:
    names, classes, _ = _stub_names(stub)
    runtime = {n for n in _public(dir(mod)) if not isinstance(getattr(mod, n), types.ModuleType)}
    where = f"{mod.__name__} vs {stub.name}"
    bad = [f"{where}: {n} is exported but not in the stub" for n in sorted(runtime - _public(names))]
    bad += [f"{where}: {n} is in the stub but not exported" for n in sorted(_public(names) - runtime)]
    for cls in sorted(runtime & set(classes)):
        have = _public(vars(getattr(mod, cls)))
        want = _public(classes[cls])
        bad += [f"{where}: {cls}.{n} exists but is not in the stub" for n in sorted(have - want)]
        bad += [f"{where}: {cls}.{n} is in the stub but does not exist" for n in sorted(want - have)]
    return bad


def test_stubs_list_every_export():
    c = _native()
    top_names, _, stub_subs = _stub_names(STUBS / "__init__.pyi")
    runtime_subs = {n for n in _public(dir(c)) if isinstance(getattr(c, n), types.ModuleType)}
    bad = _compare(c, STUBS / "__init__.pyi")
    bad += [f"submodule _C.{s} is not in the stubs" for s in sorted(runtime_subs - stub_subs)]
    for s in sorted(stub_subs):
        if s not in runtime_subs:
            if s not in BUILT_BY or getattr(c, BUILT_BY[s])():
                bad.append(f"the stubs have submodule _C.{s}, which this build does not")
            continue
        if not (STUBS / f"{s}.pyi").is_file():
            bad.append(f"no stub file for submodule _C.{s}")
            continue
        bad += _compare(getattr(c, s), STUBS / f"{s}.pyi")
    assert not bad, f"the stubs of _C are stale ({REGEN}):\n  " + "\n  ".join(bad)


def test_stubs_are_what_stubgen_writes(tmp_path):
    """Signatures and docstrings too (compared as syntax trees: layout does not matter)."""
    c = _native()
    missing = [f for f in sorted(set(BUILT_BY.values())) if not getattr(c, f)()]
    if missing:
        pytest.skip(f"a build without every part ({', '.join(missing)} false) writes fewer stubs")
    if importlib.util.find_spec("nanobind") is None:
        pytest.skip("nanobind (its stubgen) is not installed")
    import nanobind
    made_with = (STUBS.parent / "NANOBIND_VERSION").read_text().strip()
    if nanobind.__version__ != made_with:  # another stubgen may write the same API differently
        pytest.skip(f"the stubs were written by nanobind {made_with}, this is {nanobind.__version__}")
    # From tmp_path, so that the installed package (with its _C) is imported, not a source tree.
    out = subprocess.run([sys.executable, "-m", "nanobind.stubgen", "-q", "-m", "jax_moe_a2a._C", "-r",
                          "-O", str(tmp_path / "out")], cwd=tmp_path, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    fresh = {p.name: p.read_text() for p in (tmp_path / "out" / "_C").glob("*.pyi")}
    kept = {p.name: p.read_text() for p in STUBS.glob("*.pyi")}
    assert sorted(fresh) == sorted(kept), f"stub files differ ({REGEN}): {sorted(fresh)} vs {sorted(kept)}"
    stale = []
    for name in sorted(fresh):
        if ast.dump(ast.parse(fresh[name])) != ast.dump(ast.parse(kept[name])):
            diff = difflib.unified_diff(kept[name].splitlines(), fresh[name].splitlines(),
                                        f"cc/python/stubs/_C/{name}", "stubgen", lineterm="", n=1)
            stale.append("\n".join(list(diff)[:40]))
    assert not stale, f"stubs differ from the module ({REGEN}):\n" + "\n".join(stale)


def test_stubs_parse_and_name_their_module():
    for p in STUBS.glob("*.pyi"):
        ast.parse(p.read_text(), str(p))
    assert (STUBS / "__init__.pyi").is_file()
    assert (Path(__file__).resolve().parents[1] / "jax_moe_a2a" / "py.typed").is_file()


def test_a_stale_stub_is_caught(tmp_path):
    """A stub that lost a function and gained one that does not exist fails, naming both."""
    c = _native()
    text = (STUBS / "__init__.pyi").read_text()
    assert "def built_with_cuda() -> bool: ..." in text
    stub = tmp_path / "__init__.pyi"
    stub.write_text(text.replace("def built_with_cuda() -> bool: ...", "def built_with_rocm() -> bool: ..."))
    assert _compare(c, stub) == ["jax_moe_a2a._C vs __init__.pyi: built_with_cuda is exported but not in the stub",
                                 "jax_moe_a2a._C vs __init__.pyi: built_with_rocm is in the stub but not exported"]
    if hasattr(c, "transfer"):
        t = (STUBS / "transfer.pyi").read_text()
        stub = tmp_path / "transfer.pyi"
        stub.write_text(t.replace("    def descriptor(self) -> bytes:\n", "    def describe(self) -> bytes:\n", 1))
        assert _compare(c.transfer, stub) == [
            "jax_moe_a2a._C.transfer vs transfer.pyi: Region.descriptor exists but is not in the stub",
            "jax_moe_a2a._C.transfer vs transfer.pyi: Region.describe is in the stub but does not exist"]
