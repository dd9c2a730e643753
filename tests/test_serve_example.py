"""examples/serve.py under `mpirun -n 2` on CPUs (host backend over the TransferEngine): every
process checks its ranks against a dense single-device computation and exits non-zero on a
mismatch. Runs in the single-process suite (it launches mpirun itself)."""

import os
import pathlib
import re
import shutil
import subprocess

import pytest

import jax_moe_a2a as a2a

SERVE = pathlib.Path(__file__).resolve().parent.parent / "examples" / "serve.py"


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun not found")
@pytest.mark.skipif("host" not in a2a.available_backends(), reason="host backend not built")
def test_serve_example_mpirun_2():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PMI_"))}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1")
    pkg = str(pathlib.Path(a2a.__file__).resolve().parent.parent)   # the jax_moe_a2a under test
    env["PYTHONPATH"] = os.pathsep.join([pkg] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-n", "2",
           "python", str(SERVE), "--steps", "4", "--tokens", "8", "--hidden", "128", "--backend", "host"]
    try:
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=150)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"serve.py under mpirun did not finish in 150 s:\n{e.stdout}\n{e.stderr}")
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-4000:]
    assert "process 0: ranks [0]: OK" in out and "process 1: ranks [1]: OK" in out, out[-4000:]
    # two processes share the pipe: a line of one can land inside a line of the other
    assert len(re.findall(r"step \d+: tokens/rank", res.stdout)) == 4, res.stdout
