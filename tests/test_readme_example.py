"""The README's example, exactly as printed there (extracted from README.md, so the two cannot
drift): once as a script in a fresh process, as a user runs it, and once in this process on every
backend, checked against a dense NumPy computation of the same layer."""

import pathlib
import re
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_moe_a2a as a2a
from jax_moe_a2a import oracle

from conftest import BACKENDS, subprocess_env

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"
MARKER = "<!-- tests/test_readme_example.py runs the next python block as printed -->"


def readme_example() -> str:
    text = README.read_text()
    assert MARKER in text, f"{README} lost the marker line before its example"
    m = re.search(r"```python\n(.*?)```", text[text.index(MARKER):], re.S)
    assert m, "no python block after the marker"
    return m.group(1)


def test_readme_example_as_a_script(tmp_path):
    script = tmp_path / "example.py"
    script.write_text(readme_example())
    # a fresh process as a user has it: no test harness flags (the example sets its own device
    # count), CPUs, the jax_moe_a2a under test importable
    env = subprocess_env()
    res = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=300)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-4000:]
    assert re.search(r"^\w+ \(128, 256\) bfloat16 \d", res.stdout, re.M), out[-4000:]
    assert "Traceback" not in out and "Exception ignored" not in out, out[-4000:]


@pytest.mark.parametrize("backend", BACKENDS)
def test_readme_example_against_numpy(backend, monkeypatch, capsys):
    real_init = a2a.init
    monkeypatch.setattr(a2a, "init", lambda *a, **kw: real_init(*a, **{**kw, "backend": backend}))
    ns: dict = {}
    exec(compile(readme_example(), str(README), "exec"), ns)   # noqa: S102 - the README's own code
    assert ns["comm"].backend_name == backend
    assert f"{backend} " in capsys.readouterr().out

    n, T, H, K = ns["n"], ns["T"], ns["H"], ns["K"]
    f32 = lambda a: np.asarray(jnp.asarray(a).astype(jnp.float32))   # noqa: E731
    bf16 = lambda a: np.array(jnp.asarray(a, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32))  # noqa: E731
    x, ids, w = f32(ns["x"]), np.asarray(ns["topk_ids"]), np.asarray(ns["topk_weights"])
    ws = f32(ns["w_shared"])
    w8, w_scale = (np.asarray(a, np.float32) for a in ns["w_experts"])
    we = w8 * np.repeat(np.repeat(w_scale, 128, axis=1), 128, axis=2)   # the fp8 experts [E, out, in]
    q, s = oracle.quantize_fp8(x, 128)
    xd = oracle.dequantize_fp8(q, s, 128)                # what the experts see: the fp8 rows
    want = bf16(x @ ws)                                  # the shared expert
    for t in range(n * T):
        for k in range(K):
            want[t] += w[t, k] * bf16(xd[t] @ we[ids[t, k]].T)
    got = f32(ns["out"])
    assert got.shape == (n * T, H)
    np.testing.assert_allclose(got, want, rtol=3e-2, atol=3e-2)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_process_that_never_reads_its_result_ends_promptly_and_quietly(backend, tmp_path):
    """Issue 33.1: the README example changed only to print out.shape (which does not wait for the
    step). Before, the host backend's communicator was closed by its finalizer at exit while the
    step was still running: 4 of 5 runs took 65 s, printing `no host communicator with id 1` and
    `DEADLINE_EXCEEDED ... did not arrive within 60.0 s`. Now the pending step finishes first."""
    code = readme_example()
    assert 'a2a.init(spec, mesh, axis="ep")' in code and "print(comm.backend_name" in code
    code = code.replace('a2a.init(spec, mesh, axis="ep")', f'a2a.init(spec, mesh, axis="ep", backend={backend!r})')
    code = re.sub(r"^print\(comm\.backend_name.*$", "print(out.shape)", code, flags=re.M)
    code += "import time\nprint('done at', time.monotonic(), flush=True)\n"
    script = tmp_path / "no_read.py"
    script.write_text(code)
    env = subprocess_env()
    res = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=200)
    end = time.monotonic()
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-4000:]
    assert "(128, 256)" in res.stdout, out[-4000:]
    m = re.search(r"^done at ([\d.]+)$", res.stdout, re.M)
    assert m, out[-4000:]
    # from the last line of the script to the end of the process: the step's remaining work and
    # the close; the stall was 60 s (the host backend's timeout_s)
    exit_s = end - float(m.group(1))
    assert exit_s < 20, f"the process took {exit_s:.1f} s to exit:\n{out[-4000:]}"
    for bad in ("Traceback", "Exception ignored", "Error", "DEADLINE_EXCEEDED", "communicator"):
        assert bad not in out, out[-4000:]
