"""examples/serve.py under `mpirun -n 2` on CPUs (host backend over the TransferEngine), with the
command line the README prints (read from README.md, so the two cannot drift): every process
checks its ranks against a dense single-device computation and exits non-zero on a mismatch.
Runs in the single-process suite (it launches mpirun itself)."""

import pathlib
import re
import shlex
import shutil
import subprocess
import sys

import pytest

import jax_moe_a2a as a2a
from conftest import subprocess_env

ROOT = pathlib.Path(__file__).resolve().parent.parent


def readme_serve_command() -> list:
    """The README's CPU command line for examples/serve.py (the one with `--backend host`)."""
    lines = [ln for ln in (ROOT / "README.md").read_text().splitlines()
             if ln.startswith("mpirun ") and "examples/serve.py" in ln and "--backend host" in ln]
    assert len(lines) == 1, f"README.md should print one CPU serve command line, found {lines}"
    return shlex.split(lines[0].split("#")[0])


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun not found")
@pytest.mark.skipif("host" not in a2a.available_backends(), reason="host backend not built")
def test_serve_example_mpirun_2():
    env = subprocess_env()   # without the harness's 8 devices: a user's shell has one CPU device per process
    cmd = readme_serve_command()
    # `python` is the activated environment's in the README; here, the one running the tests
    cmd = [sys.executable if a == "python" else a for a in cmd]
    steps = int(cmd[cmd.index("--steps") + 1])
    try:
        res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=150)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"serve.py under mpirun did not finish in 150 s:\n{e.stdout}\n{e.stderr}")
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-4000:]
    # two processes share the pipe: a line of one can land inside a line of the other
    assert len(re.findall(r"step \d+: tokens/rank", res.stdout)) == steps, res.stdout
    # every rank carried tokens, and each process says how many rows it compared: the tokens the
    # step lines give its rank (process p holds rank p)
    per_step = [list(map(int, m.split(","))) for m in re.findall(r"tokens/rank \[([\d, ]+)\]", res.stdout)]
    assert len(per_step) == steps, res.stdout
    tokens = int(cmd[cmd.index("--tokens") + 1])
    for p in (0, 1):
        m = re.search(rf"process {p}: ranks \[{p}\]: OK: compared (\d+) token rows \(and (\d+) padding rows\) "
                      rf"over {steps} steps", out)
        assert m, out[-4000:]
        want = sum(nt[p] for nt in per_step)
        assert int(m.group(1)) == want > 0, (p, m.group(0), per_step)
        assert int(m.group(2)) == steps * tokens - want, (p, m.group(0), per_step)
