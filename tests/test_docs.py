"""The user docs (README.md and docs/*.md) as a newcomer reads them.

- Every ```python block runs, each in a fresh process on 8 CPU devices, after
  tests/docs_prelude.py (the names a snippet may assume are listed there). A block that cannot
  run in one CPU process says so right before it, visibly in the source:
  `<!-- snippet: skip (needs mpirun) -->`; the skips are counted and printed. The README's example
  is run by tests/test_readme_example.py (its marker line says so) and is not run twice.
- No git commit ids, no talk of work sessions, and no line over 300 characters. docs/performance.md
  may name commits: each of its tables says which commit it measured.

The lab notebook (notes/) is not checked: it is a dated record, commits and all.
"""

import pathlib
import re
import subprocess
import sys

import pytest

from conftest import subprocess_env

ROOT = pathlib.Path(__file__).resolve().parent.parent
PRELUDE = pathlib.Path(__file__).resolve().parent / "docs_prelude.py"
USER_DOCS = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))

SKIP = re.compile(r"^<!-- snippet: skip \((?P<why>[^)]+)\) -->$")
RUN_ELSEWHERE = "<!-- tests/test_readme_example.py runs the next python block as printed -->"
MAX_LINE = 300
COMMIT_ID_ALLOWED = {"docs/performance.md"}   # its tables name the commit they measured
# a word of 7-40 hex digits with a letter and a digit in it: how git abbreviates a commit
COMMIT_ID = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")
# the lab notebook's vocabulary: who did what when, which calls of the GPU machine, what is owed
SESSION_TALK = [
    re.compile(r"\bsessions?\b", re.I),
    re.compile(r"\b(ninth|tenth|eleventh|twelfth|thirteenth)\b", re.I),
    re.compile(r"\bPending\b"),
    re.compile(r"\bcalls? [A-F1-9]\b"),              # "call 4", "call D": one device call of a session
    re.compile(r"\bthe lead\b", re.I),
    re.compile(r"\bVM\b"),
]


def rel(path: pathlib.Path) -> str:
    return path.relative_to(ROOT).as_posix()


def python_blocks(path: pathlib.Path):
    """(line, code, skip reason or None, run elsewhere) of every ```python block of `path`."""
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            start = i
            j = i + 1
            while j < len(lines) and lines[j].strip() != "```":
                j += 1
            before = next((ln.strip() for ln in reversed(lines[:start]) if ln.strip()), "")
            m = SKIP.match(before)
            yield (start + 1, "\n".join(lines[start + 1:j]) + "\n", m.group("why") if m else None,
                   before == RUN_ELSEWHERE)
            i = j
        i += 1


SNIPPETS = [(rel(p), *b) for p in USER_DOCS for b in python_blocks(p)]
TO_RUN = [s for s in SNIPPETS if s[3] is None and not s[4]]


def test_some_snippets_run_and_skips_are_few():
    skipped = [s for s in SNIPPETS if s[3] is not None]
    print(f"\n{len(SNIPPETS)} python snippets in README.md and docs/: {len(TO_RUN)} run here, "
          f"{sum(s[4] for s in SNIPPETS)} by test_readme_example.py, {len(skipped)} skipped:")
    for path, line, _, why, _ in skipped:
        print(f"  skipped {path}:{line} ({why})")
    assert TO_RUN, "no python snippet found to run"
    assert len(skipped) <= len(SNIPPETS) // 3, "most snippets should run: mark only those that cannot"


@pytest.mark.parametrize("path,line,code", [s[:3] for s in TO_RUN], ids=[f"{s[0]}:{s[1]}" for s in TO_RUN])
def test_snippet_runs(path, line, code, tmp_path):
    script = tmp_path / "snippet.py"
    script.write_text(PRELUDE.read_text() + f"\n# ---- {path}:{line}\n" + code)
    env = subprocess_env()
    res = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=300)
    out = res.stdout + res.stderr
    assert res.returncode == 0, f"{path}:{line} failed:\n{code}\n{out[-4000:]}"
    assert "Traceback" not in out, f"{path}:{line}:\n{out[-4000:]}"


def offending_lines(check):
    bad = []
    for path in USER_DOCS:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            what = check(rel(path), line)
            if what:
                bad.append(f"{rel(path)}:{n}: {what}")
    return bad


def test_no_commit_ids():
    def check(path, line):
        if path in COMMIT_ID_ALLOWED:
            return None
        return ", ".join(COMMIT_ID.findall(line)) or None
    bad = offending_lines(check)
    assert not bad, "commit ids belong in notes/, not in the user docs:\n" + "\n".join(bad)


def test_no_session_talk():
    def check(path, line):
        return ", ".join(m.group(0) for r in SESSION_TALK for m in r.finditer(line)) or None
    bad = offending_lines(check)
    assert not bad, "the history of the work belongs in notes/:\n" + "\n".join(bad)


def test_no_long_lines():
    bad = offending_lines(lambda path, line: f"{len(line)} characters" if len(line) > MAX_LINE else None)
    assert not bad, f"lines over {MAX_LINE} characters (break tables into prose or shorter cells):\n" + "\n".join(bad)


def test_checks_can_fail():
    """The patterns catch what they are for."""
    assert COMMIT_ID.search("at commit ad6c266,") and COMMIT_ID.search("(b22e7cc)")
    assert not COMMIT_ID.search("float8_e4m3fn deadbeef 1234567 e4m3")
    assert any(r.search("the eleventh session's run") for r in SESSION_TALK)
    assert any(r.search("in call D the kernels") for r in SESSION_TALK)
    assert not any(r.search("the next call raises; pending() counts writes") for r in SESSION_TALK)
    blocks = list(python_blocks(ROOT / "README.md"))
    assert any(b[3] for b in blocks), "the README's example marker was not found"
