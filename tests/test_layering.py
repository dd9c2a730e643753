"""The include graph of cc/ follows the layers declared in cc/LAYERS, and the import graph of the
Python package those of jax_moe_a2a/LAYERS (docs/architecture.md).

Every `#include "..."` under cc/ is resolved to a file and its layer; a file may include its own
layer and lower ones, peers only through cc/LAYERS's `allow` lines (the known exceptions). A new
include of a higher or peer layer fails here, naming the file, the line and both layers.
Every import of jax_moe_a2a's own modules (function-local ones too, parsed with ast) goes to a
strictly lower level of jax_moe_a2a/LAYERS; function-local ones only where a `lazy` line says why.
Pure Python: no build, no JAX."""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SOURCES = (".h", ".hpp", ".cuh", ".cc", ".cpp", ".cu", ".c")
_INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"')


@dataclass
class Layers:
    level: dict[str, int] = field(default_factory=dict)          # layer name -> level
    layer_of_dir: dict[str, str] = field(default_factory=dict)   # cc/<dir> -> layer name
    external: dict[str, set[str]] = field(default_factory=dict)  # include root -> layers
    allowed: set[tuple[str, str]] = field(default_factory=set)   # (layer, header under cc/)
    namespaces: dict[str, set[str]] = field(default_factory=dict)  # layer -> namespaces it may open


def table_lines(path: Path):
    """(line number, text, first word, other words) of every line of a LAYERS file with words on it
    before its comment (cc/LAYERS, jax_moe_a2a/LAYERS)."""
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        words = raw.split("#", 1)[0].split()
        if words:
            yield n, raw, words[0], words[1:]


def parse_layers(path: Path) -> Layers:
    t = Layers()
    for n, raw, kind, args in table_lines(path):
        if kind == "layer" and len(args) >= 3:
            name, dirs = args[1], args[2:]
            assert name not in t.level, f"{path}:{n}: layer {name} declared twice"
            t.level[name] = int(args[0])
            for d in dirs:
                assert d not in t.layer_of_dir, f"{path}:{n}: cc/{d} is in two layers"
                t.layer_of_dir[d] = name
        elif kind == "external" and len(args) >= 2:
            t.external[args[0]] = set(args[1:])
        elif kind == "allow" and len(args) == 2:
            t.allowed.add((args[0], args[1]))
        elif kind == "namespace" and len(args) >= 2:
            t.namespaces[args[0]] = set(args[1:])
        else:
            raise AssertionError(f"{path}:{n}: cannot parse {raw.strip()!r}")
    for layer, header in t.allowed:
        assert layer in t.level, f"{path}: allow names an unknown layer {layer}"
    for root, layers in t.external.items():
        assert layers <= set(t.level), f"{path}: external {root} names an unknown layer"
    assert set(t.namespaces) <= set(t.level), f"{path}: namespace names an unknown layer"
    return t


def violations(cc: Path, t: Layers) -> tuple[list[str], set[tuple[str, str]]]:
    """Messages for every include that breaks the order, and the `allow` lines that were used."""
    bad, used = [], set()
    for d in sorted(p.name for p in cc.iterdir() if p.is_dir()):
        if d not in t.layer_of_dir:
            bad.append(f"cc/{d}/ belongs to no layer: declare it in cc/LAYERS")
    for f in sorted(p for p in cc.rglob("*") if p.suffix in SOURCES and p.is_file()):
        rel = f.relative_to(cc)
        src = t.layer_of_dir.get(rel.parts[0]) if len(rel.parts) > 1 else None
        if src is None:
            continue  # reported above (or a file directly under cc/, which holds none today)
        for n, line in enumerate(f.read_text(errors="replace").splitlines(), 1):
            m = _INCLUDE.match(line)
            if not m:
                continue
            inc, where = m.group(1), f"cc/{rel}:{n}"
            local = (f.parent / inc).resolve()
            if local.is_file():  # the compiler looks next to the including file first
                target = local
            else:
                target = (cc / inc).resolve()
                if not target.is_file():
                    root = inc.split("/", 1)[0]
                    if root in t.external:
                        if src not in t.external[root]:
                            bad.append(f"{where}: layer {src} includes \"{inc}\" (external {root}/, "
                                       f"allowed only in {', '.join(sorted(t.external[root]))})")
                    else:
                        bad.append(f"{where}: \"{inc}\" is neither a file under cc/ nor under an "
                                   f"external root of cc/LAYERS")
                    continue
            try:
                trel = target.relative_to(cc.resolve())
            except ValueError:
                bad.append(f"{where}: \"{inc}\" resolves outside cc/")
                continue
            dst = t.layer_of_dir.get(trel.parts[0]) if len(trel.parts) > 1 else None
            if dst is None or dst == src:
                continue  # an undeclared directory is reported above
            if t.level[dst] < t.level[src]:
                continue
            if (src, trel.as_posix()) in t.allowed:
                used.add((src, trel.as_posix()))
                continue
            how = "a higher" if t.level[dst] > t.level[src] else "a peer"
            bad.append(f"{where}: layer {src} (level {t.level[src]}) includes \"{inc}\" of {how} "
                       f"layer {dst} (level {t.level[dst]})")
    return bad, used


def test_cc_includes_follow_the_layers():
    t = parse_layers(REPO / "cc" / "LAYERS")
    bad, _ = violations(REPO / "cc", t)
    assert not bad, ("includes against the layers of cc/LAYERS (see docs/architecture.md):\n  "
                     + "\n  ".join(bad))


def test_every_known_exception_is_still_needed():
    """An `allow` line nobody uses any more goes, so that the exceptions only shrink."""
    t = parse_layers(REPO / "cc" / "LAYERS")
    _, used = violations(REPO / "cc", t)
    stale = sorted(t.allowed - used)
    assert not stale, f"cc/LAYERS allows includes no file makes any more; remove: {stale}"


def test_cmake_targets_follow_the_layers():
    """CMakeLists.txt builds every layer of cc/LAYERS through a2a_layer(TARGET LAYER), which gives
    the target its layer's include root only (so a higher include does not compile) and checks its
    sources at configure time; no target may add cc/ itself as an include directory."""
    t = parse_layers(REPO / "cc" / "LAYERS")
    text = (REPO / "CMakeLists.txt").read_text()
    code = "\n".join(line.split("#", 1)[0] for line in text.splitlines())
    layered = dict(re.findall(r"^\s*a2a_layer\((\w+)\s+(\w+)\)", code, re.M))
    targets = set(re.findall(r"^\s*(?:add_library|nanobind_add_module)\((\w+)", code, re.M))
    assert targets and targets == set(layered), f"targets without a2a_layer: {sorted(targets - set(layered))}"
    unknown = sorted(f"{tg} -> {ly}" for tg, ly in layered.items() if ly not in t.level)
    assert not unknown, f"a2a_layer names layers cc/LAYERS lacks: {unknown}"
    compiled = {t.layer_of_dir[p.relative_to(REPO / "cc").parts[0]]
                for p in (REPO / "cc").rglob("*") if p.suffix in (".cc", ".cu") and p.is_file()}
    missing = sorted(compiled - set(layered.values()))
    assert not missing, f"layers with sources but no CMake target: {missing}"
    escapes = re.findall(r"target_include_directories\([^)]*\bcc\b[^)]*\)", code)
    assert not escapes, f"include directories that bypass the layer roots: {escapes}"


_NAMESPACE = re.compile(r"^\s*namespace\s+([A-Za-z_][\w:]*)\s*\{")


def _forward_declarations_only(lines: list[str], n: int) -> bool:
    """Whether the namespace block opened on line n (1-based) only declares names (`struct X;`,
    `class X;`): naming another layer's types is not adding to its namespace."""
    for line in lines[n:]:
        code = line.split("//", 1)[0].strip()
        if code.startswith("}"):
            return True
        if code and not re.fullmatch(r"(struct|class)\s+\w+;", code):
            return False
    return False


def namespace_owner(t: Layers, name: str) -> str | None:
    """The layer whose declared namespace is the longest one equal to `name` or enclosing it
    (a2a::gpu::ptx is gpu's, a2a::ctrl core's: a2a), or None."""
    best, owner = -1, None
    for layer, spaces in t.namespaces.items():
        for ns in spaces:
            if (name == ns or name.startswith(ns + "::")) and len(ns) > best:
                best, owner = len(ns), layer
    return owner


def namespace_violations(cc: Path, t: Layers) -> list[str]:
    """Every named namespace a file opens must be its layer's: the longest namespace of cc/LAYERS
    (`namespace` lines) equal to it or enclosing it is the layer's own. A layer with files but no
    `namespace` line is reported."""
    bad = []
    for f in sorted(p for p in cc.rglob("*") if p.suffix in SOURCES and p.is_file()):
        rel = f.relative_to(cc)
        layer = t.layer_of_dir.get(rel.parts[0]) if len(rel.parts) > 1 else None
        if layer is None:
            continue
        own = t.namespaces.get(layer)
        if own is None:
            bad.append(f"cc/{rel}: layer {layer} has no `namespace` line in cc/LAYERS")
            continue
        lines = f.read_text(errors="replace").splitlines()
        for n, line in enumerate(lines, 1):
            m = _NAMESPACE.match(line)
            if not m or namespace_owner(t, m.group(1)) == layer:
                continue
            if _forward_declarations_only(lines, n):  # e.g. host/host_comm.h: struct proxy::Ctrl;
                continue
            bad.append(f"cc/{rel}:{n}: layer {layer} opens namespace {m.group(1)} "
                           f"(its own: {', '.join(sorted(own))})")
    return bad


def test_each_layer_has_its_own_namespace():
    t = parse_layers(REPO / "cc" / "LAYERS")
    bad = namespace_violations(REPO / "cc", t)
    assert not bad, "namespaces against cc/LAYERS:\n  " + "\n  ".join(bad)
    nested = {ns for layer, spaces in t.namespaces.items() if layer != "core" for ns in spaces}
    assert len(nested) == sum(len(v) for k, v in t.namespaces.items() if k != "core"), \
        "two layers share a namespace"


def test_namespace_check_catches_a_foreign_namespace(tmp_path):
    cc = _tree(tmp_path, dict(_GOOD, **{"mid/n.h": "namespace a2a::top {\nint x;\n}\n"}))
    (cc / "LAYERS").write_text(_TABLE + "namespace top a2a::top\nnamespace mid a2a::mid\n"
                               "namespace peer a2a::peer\nnamespace base a2a\n")
    assert namespace_violations(cc, parse_layers(cc / "LAYERS")) == [
        "cc/mid/n.h:1: layer mid opens namespace a2a::top (its own: a2a::mid)"]


# Element kinds, layouts and halves travel as the typed enums of cc/core (ElemKind, Layout, Half):
# none of them compared with, or switched on, a bare number.
_LITERAL_KIND = re.compile(
    r"\b(\w*_kind|kind|layout|op|which)\s*(==|!=|<=|>=|<|>)\s*-?\d+\b"
    r"|\b\d+\s*(==|!=)\s*[\w.>-]*_kind\b"
    r"|\b(QuantChunks|ReduceShape|load_raw8|load_raw8_ro|raw8_to_f32|reduce_combine_vec)<\d")


def test_no_kind_or_op_compared_with_a_number():
    bad = []
    for f in sorted(p for p in (REPO / "cc").rglob("*") if p.suffix in SOURCES and p.is_file()):
        for n, line in enumerate(f.read_text(errors="replace").splitlines(), 1):
            code = line.split("//", 1)[0]
            if _LITERAL_KIND.search(code):
                bad.append(f"cc/{f.relative_to(REPO / 'cc')}:{n}: {line.strip()}")
    assert not bad, "a kind, layout or op against a number (use ElemKind, Layout, Half):\n  " + "\n  ".join(bad)


# --- the check itself, on small trees ------------------------------------------------------------

_TABLE = """\
layer 2 top    top
layer 1 mid    mid other
layer 1 peer   peer
layer 0 base   base
external xla top
allow peer mid/ok.h
"""


def _tree(root: Path, files: dict[str, str]) -> Path:
    cc = root / "cc"
    for name, text in files.items():
        (cc / name).parent.mkdir(parents=True, exist_ok=True)
        (cc / name).write_text(text)
    (cc / "LAYERS").write_text(_TABLE)
    return cc


_GOOD = {
    "top/a.cc": '#include "mid/m.h"\n#include "base/b.h"\n#include "xla/ffi/api/ffi.h"\n',
    "mid/m.h": '#include "base/b.h"\n#include "../other/o.h"\n',
    "mid/ok.h": "",
    "other/o.h": '#include "mid/m.h"\n',
    "peer/p.cc": '#include "mid/ok.h"\n#include "p.h"\n',
    "peer/p.h": "",
    "base/b.h": "#include <vector>\n",
}


def _check(cc: Path):
    return violations(cc, parse_layers(cc / "LAYERS"))


def test_fixture_tree_passes(tmp_path):
    bad, used = _check(_tree(tmp_path, _GOOD))
    assert bad == [] and used == {("peer", "mid/ok.h")}


@pytest.mark.parametrize("file,text,expect", [
    ("base/b.h", '#include "mid/m.h"\n', 'cc/base/b.h:1: layer base (level 0) includes "mid/m.h" of a higher layer mid (level 1)'),
    ("mid/m.h", '\n#include "top/t.h"\n', 'cc/mid/m.h:2: layer mid (level 1) includes "top/t.h" of a higher layer top (level 2)'),
    ("mid/m.h", '#include "../peer/p.h"\n', 'cc/mid/m.h:1: layer mid (level 1) includes "../peer/p.h" of a peer layer peer (level 1)'),
    ("peer/p.cc", '#include "mid/m.h"\n', 'cc/peer/p.cc:1: layer peer (level 1) includes "mid/m.h" of a peer layer mid (level 1)'),
    ("mid/m.h", '#include "xla/ffi/api/ffi.h"\n', 'cc/mid/m.h:1: layer mid includes "xla/ffi/api/ffi.h" (external xla/, allowed only in top)'),
    ("mid/m.h", '#include "nowhere/x.h"\n', 'cc/mid/m.h:1: "nowhere/x.h" is neither a file under cc/ nor under an external root of cc/LAYERS'),
    ("newdir/x.h", "", "cc/newdir/ belongs to no layer: declare it in cc/LAYERS"),
])
def test_fixture_tree_catches_a_bad_include(tmp_path, file, text, expect):
    files = dict(_GOOD, **{"top/t.h": ""})
    files[file] = text
    bad, _ = _check(_tree(tmp_path, files))
    assert bad == [expect]


def test_a_bad_include_in_a_copy_of_cc_fails(tmp_path):
    """The real table on a copy of the real tree, with one new upward include: core -> cuda."""
    import shutil
    cc = tmp_path / "cc"
    shutil.copytree(REPO / "cc", cc)
    header = cc / "core" / "align.h"
    header.write_text(header.read_text() + '\n#include "cuda/comm.h"\n')
    bad, _ = violations(cc, parse_layers(cc / "LAYERS"))
    n = len(header.read_text().splitlines())
    assert bad == [f'cc/core/align.h:{n}: layer core (level 0) includes "cuda/comm.h" of a higher '
                   f'layer cuda (level 4)']


def test_architecture_doc_cites_existing_paths():
    """docs/architecture.md stands alone: every path it cites is in the repository."""
    text = (REPO / "docs" / "architecture.md").read_text()
    cited = set(re.findall(r"`((?:cc|jax_moe_a2a|tests|docs|scripts|benchmarks)/[^`\s]*|CMakeLists\.txt)`", text))
    missing = sorted(p for p in cited if "NAME" not in p and not
                     (any(REPO.glob(p.rstrip("/"))) if "*" in p else (REPO / p.rstrip("/")).exists()))
    assert len(cited) > 40 and not missing, f"docs/architecture.md cites missing paths: {missing}"


# --- the Python package: jax_moe_a2a/LAYERS ---------------------------------------------------------

PACKAGE = "jax_moe_a2a"


@dataclass
class PyLayers:
    level: dict[str, int] = field(default_factory=dict)      # module (dotted, under the package) -> level
    layer: dict[str, str] = field(default_factory=dict)      # module -> layer name
    lazy: set[tuple[str, str]] = field(default_factory=set)  # (module, target) allowed inside functions


def parse_py_layers(path: Path) -> PyLayers:
    t = PyLayers()
    for n, raw, kind, args in table_lines(path):
        if kind == "layer" and len(args) >= 3:
            for m in args[2:]:
                assert m not in t.level, f"{path}:{n}: module {m} is in two layers"
                t.level[m], t.layer[m] = int(args[0]), args[1]
        elif kind == "lazy" and len(args) == 2:
            t.lazy.add((args[0], args[1]))
        else:
            raise AssertionError(f"{path}:{n}: cannot parse {raw.strip()!r}")
    for mod, target in t.lazy:
        assert mod in t.level and target in t.level, f"{path}: lazy names an unknown module ({mod} {target})"
    return t


def _module_name(pkg_dir: Path, f: Path) -> str:
    parts = list(f.relative_to(pkg_dir).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts) or PACKAGE


@dataclass(frozen=True)
class PyImport:
    source: str     # importing module (dotted under the package, or "jax_moe_a2a")
    target: str     # imported module of ours
    line: int
    local: bool     # inside a function


def py_imports(pkg_dir: Path, known: set[str]) -> list[PyImport]:
    """Every import of our own modules in every .py under `pkg_dir`, at any depth of the code.
    `from . import x` counts as importing module x when x is one (else the package); `from .a
    import b` as importing a (and a.b when that is a module)."""
    out = []
    for f in sorted(pkg_dir.rglob("*.py")):
        src = _module_name(pkg_dir, f)
        pkg = src if f.name == "__init__.py" else src.rpartition(".")[0]
        pkg_parts = [] if pkg in ("", PACKAGE) else pkg.split(".")
        tree = ast.parse(f.read_text(), str(f))

        def resolve(name: str) -> str | None:
            if name == PACKAGE:
                return PACKAGE
            if name.startswith(PACKAGE + "."):
                name = name[len(PACKAGE) + 1:]
            elif not name:
                return PACKAGE
            else:
                return None
            while name and name not in known and "." in name:
                name = name.rpartition(".")[0]
            return name

        def visit(node, local):
            for child in ast.iter_child_nodes(node):
                inner = local or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                if isinstance(child, ast.Import):
                    for a in child.names:
                        t = resolve(a.name)
                        if t is not None:
                            out.append(PyImport(src, t, child.lineno, local))
                elif isinstance(child, ast.ImportFrom):
                    if child.level:
                        base_parts = pkg_parts[:len(pkg_parts) - child.level + 1] if child.level > 1 else pkg_parts
                        if child.level - 1 > len(pkg_parts):
                            raise AssertionError(f"{f}:{child.lineno}: relative import beyond the package")
                        base = ".".join(base_parts + ([child.module] if child.module else []))
                        full = f"{PACKAGE}.{base}" if base else PACKAGE
                    else:
                        full = child.module or ""
                        if full != PACKAGE and not full.startswith(PACKAGE + "."):
                            continue
                    for a in child.names:
                        sub = f"{full}.{a.name}"
                        t = resolve(sub) if sub[len(PACKAGE) + 1:] in known else resolve(full)
                        out.append(PyImport(src, t, child.lineno, local))
                visit(child, inner)

        visit(tree, False)
    return out


def py_violations(pkg_dir: Path, t: PyLayers) -> tuple[list[str], set[tuple[str, str]]]:
    """Messages for every module without a layer and every import against jax_moe_a2a/LAYERS, and
    the `lazy` lines that were used."""
    modules = {_module_name(pkg_dir, f) for f in pkg_dir.rglob("*.py")}
    known = modules | set(t.level)
    bad, used = [], set()
    for m in sorted(modules - set(t.level)):
        bad.append(f"{PACKAGE}/{m.replace('.', '/') if m != PACKAGE else '__init__'}.py: module {m} belongs to no "
                   f"layer: declare it in {PACKAGE}/LAYERS")
    for imp in py_imports(pkg_dir, known):
        where = f"{imp.source}:{imp.line}"
        if imp.target == imp.source:
            continue
        if imp.local:
            if (imp.source, imp.target) in t.lazy:
                used.add((imp.source, imp.target))
            else:
                bad.append(f"{where}: imports {imp.target} inside a function (import it at the top, or add a "
                           f"`lazy {imp.source} {imp.target}` line saying why)")
        if imp.source not in t.level or imp.target not in t.level:
            if imp.target not in t.level and imp.target in modules:
                bad.append(f"{where}: imports {imp.target}, which belongs to no layer")
            continue
        ls, lt = t.level[imp.source], t.level[imp.target]
        if lt >= ls:
            how = "a higher" if lt > ls else "a same-level"
            bad.append(f"{where}: layer {t.layer[imp.source]} (level {ls}) imports {imp.target} of {how} layer "
                       f"{t.layer[imp.target]} (level {lt})")
    return bad, used


def test_python_imports_follow_the_layers():
    """No import circle inside jax_moe_a2a, and no function-local import of our modules without a
    reason: every import (function-local ones included) goes down jax_moe_a2a/LAYERS."""
    t = parse_py_layers(REPO / PACKAGE / "LAYERS")
    bad, _ = py_violations(REPO / PACKAGE, t)
    assert not bad, (f"imports against the layers of {PACKAGE}/LAYERS (see docs/architecture.md):\n  "
                     + "\n  ".join(bad))


def test_every_lazy_import_is_still_needed():
    t = parse_py_layers(REPO / PACKAGE / "LAYERS")
    _, used = py_violations(REPO / PACKAGE, t)
    stale = sorted(t.lazy - used)
    assert not stale, f"{PACKAGE}/LAYERS allows function-local imports no module makes any more; remove: {stale}"


def test_tests_share_backends_through_conftest():
    """The backend list lives in tests/conftest.py; no test file imports another test file for it."""
    offenders = sorted(p.name for p in (REPO / "tests").glob("test_*.py")
                       if re.search(r"^from test_ops import (BACKENDS|PURE_JAX)", p.read_text(), re.M))
    assert not offenders, f"import BACKENDS / PURE_JAX from conftest instead: {offenders}"


# --- the Python check itself, on small packages ------------------------------------------------------

_PY_TABLE = """\
layer 0 floor  low other
layer 1 mid    sub sub.leaf
layer 2 top    jax_moe_a2a
"""

_PY_GOOD = {
    "__init__.py": "from . import sub\nfrom .low import x\n",
    "low.py": "import numpy\n",
    "other.py": "",
    "sub/__init__.py": "from .. import low\nfrom ..other import y\n",
    "sub/leaf.py": "from jax_moe_a2a import low\n\ndef f():\n    import os\n",
}


def _py_tree(root: Path, files: dict[str, str], table: str = _PY_TABLE) -> Path:
    pkg = root / PACKAGE
    for name, text in files.items():
        (pkg / name).parent.mkdir(parents=True, exist_ok=True)
        (pkg / name).write_text(text)
    (pkg / "LAYERS").write_text(table)
    return pkg


def _py_check(pkg: Path):
    return py_violations(pkg, parse_py_layers(pkg / "LAYERS"))


def test_py_fixture_passes(tmp_path):
    bad, used = _py_check(_py_tree(tmp_path, _PY_GOOD, _PY_TABLE))
    assert bad == [] and used == set()


def test_py_lazy_line_allows_a_local_import(tmp_path):
    files = dict(_PY_GOOD, **{"sub/leaf.py": "def f():\n    from .. import low\n"})
    bad, used = _py_check(_py_tree(tmp_path, files, _PY_TABLE + "lazy sub.leaf low\n"))
    assert bad == [] and used == {("sub.leaf", "low")}


@pytest.mark.parametrize("file,text,expect", [
    ("low.py", "from . import sub\n", "low:1: layer floor (level 0) imports sub of a higher layer mid (level 1)"),
    ("low.py", "from .other import y\n", "low:1: layer floor (level 0) imports other of a same-level layer floor (level 0)"),
    ("sub/leaf.py", "def f():\n    from .. import low\n",
     "sub.leaf:2: imports low inside a function (import it at the top, or add a `lazy sub.leaf low` line saying why)"),
    ("low.py", "class A:\n    def m(self):\n        import jax_moe_a2a.sub.leaf\n",
     "low:3: imports sub.leaf inside a function (import it at the top, or add a `lazy low sub.leaf` line saying why)"),
    ("new.py", "", "jax_moe_a2a/new.py: module new belongs to no layer: declare it in jax_moe_a2a/LAYERS"),
])
def test_py_fixture_catches_a_bad_import(tmp_path, file, text, expect):
    files = dict(_PY_GOOD)
    files[file] = text
    bad, _ = _py_check(_py_tree(tmp_path, files, _PY_TABLE))
    assert expect in bad, bad


def test_a_circle_in_a_copy_of_the_package_fails(tmp_path):
    """The real table on a copy of the real package, with the circle issue 34 found: errors (the
    floor) importing the communicator, inside a function."""
    import shutil
    pkg = tmp_path / PACKAGE
    shutil.copytree(REPO / PACKAGE, pkg, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    f = pkg / "errors.py"
    f.write_text(f.read_text() + "\n\ndef _late():\n    from .comm import Communicator\n    return Communicator\n")
    bad, _ = py_violations(pkg, parse_py_layers(pkg / "LAYERS"))
    n = len(f.read_text().splitlines()) - 1
    assert bad == [f"errors:{n}: imports comm inside a function (import it at the top, or add a `lazy errors comm` "
                   f"line saying why)",
                   f"errors:{n}: layer floor (level 0) imports comm of a higher layer comm (level 8)"], bad
