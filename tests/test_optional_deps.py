"""A build without libfabric never reaches libfabric's headers (pure Python: no build, no JAX).

CMakeLists.txt compiles cc/transfer, cc/protocol, cc/proxy and cc/host (and a few bindings) only
when pkg-config finds libfabric. Every other source is compiled on every machine, so neither it nor
any header it includes outside a `#ifdef JAX_MOE_A2A_WITH_LIBFABRIC` block may reach cc/transfer/,
cc/protocol/ or `<rdma/...>`. The machine CI runs on has libfabric, so a build there cannot show such
an include; on the GPU machine, which has none, one stopped the whole build (3b1c282: bind_cuda.cc
included the proxy's stats helper, and through it <rdma/fabric.h>, unconditionally)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GUARD = "JAX_MOE_A2A_WITH_LIBFABRIC"
FABRIC_DIRS = ("transfer", "protocol")  # cc/<dir>: headers that include <rdma/...>
_SOURCE = re.compile(r"\bcc/[\w/]+\.(?:cc|cu|cpp)\b")
_INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]')
_IF = re.compile(r"^\s*#\s*(if|ifdef|ifndef|elif|else|endif)\b(.*)")


def cmake_sources(cmake: Path) -> tuple[set[str], set[str]]:
    """(sources built on every machine, sources built only with libfabric) named in `cmake`."""
    always, fabric = set(), set()
    stack: list[bool] = []  # per open if(): is this branch one that needs libfabric?
    for raw in cmake.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        low = line.lower()
        if low.startswith("if("):
            stack.append("libfabric_found" in low and "not libfabric_found" not in low)
        elif low.startswith(("else(", "elseif(")) and stack:
            stack[-1] = False
        elif low.startswith("endif(") and stack:
            stack.pop()
        for src in _SOURCE.findall(line):
            (fabric if any(stack) else always).add(src)
    return always - fabric, fabric


def includes_without_libfabric(path: Path) -> list[tuple[int, str, str]]:
    """(line, '<' or '"', name) of every include of `path` that a build without libfabric sees:
    not inside the positive branch of an #if / #ifdef on JAX_MOE_A2A_WITH_LIBFABRIC."""
    out: list[tuple[int, str, str]] = []
    stack: list[bool] = []  # per open #if: does its current branch need libfabric?
    for n, raw in enumerate(path.read_text(errors="replace").splitlines(), 1):
        m = _IF.match(raw)
        if m:
            kind, cond = m.group(1), m.group(2)
            if kind in ("if", "ifdef"):
                stack.append(GUARD in cond and "!" not in cond)
            elif kind == "ifndef":
                stack.append(False)
            elif kind in ("elif", "else") and stack:
                stack[-1] = False  # the other branch of a guard: what a build without it sees
            elif kind == "endif" and stack:
                stack.pop()
            continue
        m = _INCLUDE.match(raw)
        if m and not any(stack):
            out.append((n, m.group(1), m.group(2)))
    return out


def fabric_reach(cc: Path, sources: set[str]) -> list[str]:
    """Chains (source -> ... -> the offending include) from `sources` (paths like 'cc/x/y.cc',
    relative to cc's parent) to libfabric's headers, seen by a build without libfabric."""
    bad: list[str] = []
    seen: set[Path] = set()
    todo = [(cc.parent / s, [s]) for s in sorted(sources)]
    while todo:
        path, chain = todo.pop()
        if path in seen or not path.exists():
            continue
        seen.add(path)
        for n, kind, name in includes_without_libfabric(path):
            where = f"{chain[-1]}:{n}"
            if kind == "<" and name.startswith("rdma/"):
                bad.append(" -> ".join(chain[:-1] + [where, f"<{name}>"]))
                continue
            if kind != '"':
                continue
            target = cc / name
            if not target.exists():
                continue  # a system or third-party header in quotes
            if name.split("/", 1)[0] in FABRIC_DIRS:
                bad.append(" -> ".join(chain[:-1] + [where, f"cc/{name}"]))
                continue
            todo.append((target, chain[:-1] + [where, f"cc/{name}"]))
    return sorted(set(bad))


def test_cmake_lists_both_kinds_of_source():
    always, fabric = cmake_sources(REPO / "CMakeLists.txt")
    assert "cc/python/bind_cuda.cc" in always and "cc/core/config.cc" in always
    assert "cc/transfer/engine.cc" in fabric and "cc/host/host_comm.cc" in fabric
    assert "cc/cuda/remote_path.cc" in fabric


def test_sources_built_without_libfabric_never_reach_it():
    always, _ = cmake_sources(REPO / "CMakeLists.txt")
    bad = fabric_reach(REPO / "cc", always)
    assert not bad, ("a build without libfabric would fail (guard these includes with "
                     f"#ifdef {GUARD}):\n  " + "\n  ".join(bad))


def test_an_unguarded_include_is_caught(tmp_path):
    cc = tmp_path / "cc"
    for d in ("python", "proxy", "transfer"):
        (cc / d).mkdir(parents=True)
    (cc / "transfer" / "engine.h").write_text("#include <rdma/fabric.h>\n")
    (cc / "proxy" / "stats.h").write_text('#include "transfer/engine.h"\n')
    (cc / "python" / "guarded.cc").write_text(
        f'#include <string>\n#ifdef {GUARD}\n#include "proxy/stats.h"\n#else\n#include <vector>\n#endif\n')
    (cc / "python" / "unguarded.cc").write_text(f'#ifdef {GUARD}\n#include <map>\n#endif\n#include "proxy/stats.h"\n')
    assert fabric_reach(cc, {"cc/python/guarded.cc"}) == []
    bad = fabric_reach(cc, {"cc/python/unguarded.cc"})
    assert bad == ["cc/python/unguarded.cc:4 -> cc/proxy/stats.h:1 -> cc/transfer/engine.h"]
