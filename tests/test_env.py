"""Every JAX_MOE_A2A_* variable is in jax_moe_a2a.env's table and docs/api.md's, and the Python
library reads them only through jax_moe_a2a.env."""

import os
import re
import subprocess

import pytest

from jax_moe_a2a import env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# CMake options and the preprocessor macros they define: build switches, not environment variables.
BUILD_MACROS = {"JAX_MOE_A2A_" + n for n in ("CUDA", "NVSHMEM", "WITH_CUDA", "WITH_LIBFABRIC", "WITH_NVSHMEM",
                                              "HAVE_CUDA", "HAVE_NVSHMEM", "GEMM", "WITH_GEMM", "HAVE_GEMM",
                                              "GEMM_REASON")}


def _repo_files():
    try:
        out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [f for f in out.split() if f.endswith((".py", ".cc", ".h", ".cu", ".cuh", ".sh", ".md", ".txt", ".toml"))]


def _names(text):
    return {m.rstrip("_") for m in re.findall(r"JAX_MOE_A2A_[A-Z0-9_]+", text)}


def test_every_variable_in_the_repo_is_in_the_table():
    missing = {}
    for f in _repo_files():
        with open(os.path.join(ROOT, f), errors="replace") as fh:
            for name in _names(fh.read()) - BUILD_MACROS - set(env.TABLE):
                missing.setdefault(name, f)
    assert not missing, f"JAX_MOE_A2A_ variables missing from jax_moe_a2a/env.py VARS: {missing}"


def test_docs_table_is_the_env_table():
    with open(os.path.join(ROOT, "docs", "api.md")) as fh:
        doc = fh.read()
    assert env.markdown_table() in doc, "docs/api.md: paste jax_moe_a2a.env.markdown_table() in place of its table"


def test_library_reads_variables_only_through_env():
    lib = os.path.join(ROOT, "jax_moe_a2a")
    offenders = []
    for dirpath, _, files in os.walk(lib):
        if os.sep + "bench" in dirpath:  # benchmarks may read their own (listed in the table)
            continue
        for fn in files:
            path = os.path.join(dirpath, fn)
            if not fn.endswith(".py") or fn == "env.py":
                continue
            with open(path) as fh:
                for i, line in enumerate(fh, 1):
                    if re.search(r"(environ|getenv).*JAX_MOE_A2A_", line):
                        offenders.append(f"{os.path.relpath(path, ROOT)}:{i}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


def test_accessors(monkeypatch):
    monkeypatch.setenv("JAX_MOE_A2A_NODE_SIZE", "4")
    assert env.get_int("NODE_SIZE") == 4 and env.get_int("JAX_MOE_A2A_NODE_SIZE") == 4
    monkeypatch.setenv("JAX_MOE_A2A_NODE_SIZE", "four")
    with pytest.raises(ValueError, match="JAX_MOE_A2A_NODE_SIZE='four': expected an integer"):
        env.get_int("NODE_SIZE")
    monkeypatch.setenv("JAX_MOE_A2A_NODE_SIZE", "")
    assert env.get_int("NODE_SIZE", 7) == 7
    for v, want in (("1", True), ("0", False), ("off", False), ("yes", True)):
        monkeypatch.setenv("JAX_MOE_A2A_HOST_PROXIED", v)
        assert env.get_bool("HOST_PROXIED") is want
    monkeypatch.delenv("JAX_MOE_A2A_HOST_PROXIED")
    assert env.get_bool("HOST_PROXIED") is False
    monkeypatch.delenv("JAX_MOE_A2A_PROVIDER", raising=False)
    assert env.get_str("PROVIDER", "shm") == "shm"
    bogus = "NOT_A_" + "VARIABLE"  # spelled in two parts: the repository scan above must not see it
    with pytest.raises(KeyError, match=env.PREFIX + bogus + " is not in"):
        env.get(bogus)


def test_cuda_options_read_the_environment_through_env(monkeypatch):
    from jax_moe_a2a.backends.cuda import CudaBackend
    monkeypatch.setenv("JAX_MOE_A2A_NODE_SIZE", "2")
    monkeypatch.setenv("JAX_MOE_A2A_MAX_PRIVATE_TOKENS", "3")
    monkeypatch.setenv("JAX_MOE_A2A_PROVIDER", "tcp;ofi_rxm")
    assert CudaBackend.transport({}, 4) == dict(node_size=2, max_private_tokens=3, provider="tcp;ofi_rxm")


def test_library_prints_nothing():
    """Messages go through the `jax_moe_a2a` logger; benchmarks and examples may print."""
    lib = os.path.join(ROOT, "jax_moe_a2a")
    offenders = []
    for dirpath, _, files in os.walk(lib):
        if os.sep + "bench" in dirpath:
            continue
        for fn in files:
            if fn.endswith(".py"):
                with open(os.path.join(dirpath, fn)) as fh:
                    for i, line in enumerate(fh, 1):
                        if re.search(r"(^|[^\w.])print\(|sys\.std(out|err)\.write", line):
                            offenders.append(f"{fn}:{i}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


def test_logger_reports_init(mesh, caplog):
    import logging

    import jax.numpy as jnp

    import jax_moe_a2a as a2a
    spec = a2a.Spec(num_experts=2 * mesh.size, experts_per_token=2, hidden=32, max_tokens_per_rank=4)
    with caplog.at_level(logging.INFO, logger="jax_moe_a2a"):
        a2a.init(spec, mesh, "ep", backend="reference")
    assert any(r.name == "jax_moe_a2a" and "reference" in r.getMessage() for r in caplog.records)


# --- the C++ side: cc/core/env.{h,cc} is its one getenv, over the rows of the table above ---------

def _cc_files():
    for dirpath, _, files in os.walk(os.path.join(ROOT, "cc")):
        for fn in files:
            if fn.endswith((".h", ".cc", ".cu", ".cuh")):
                yield os.path.join(dirpath, fn)


def test_cpp_reads_variables_only_through_core_env():
    offenders = []
    for path in _cc_files():
        if path.endswith(os.path.join("core", "env.cc")):
            continue
        with open(path) as fh:
            for i, line in enumerate(fh, 1):
                if re.search(r"\bgetenv\s*\(", line.split("//", 1)[0]):
                    offenders.append(f"{os.path.relpath(path, ROOT)}:{i}: {line.strip()}")
    assert not offenders, "getenv outside cc/core/env.cc (use env::get):\n" + "\n".join(offenders)


def test_cpp_variables_are_the_tables():
    with open(os.path.join(ROOT, "cc", "core", "env.cc")) as fh:
        src = fh.read()
    body = src[src.index("kNative[] = {"):src.index("};", src.index("kNative[] = {"))]
    native = re.findall(r'"([A-Z0-9_]+)"', re.sub(r"//[^\n]*", "", body))
    want = [v.name for v in env.VARS if "cc/" in v.read_by]
    assert sorted(native) == sorted(want), "cc/core/env.cc kNative != the rows of env.py that cc/ reads"
    used = set()
    for path in _cc_files():
        with open(path) as fh:
            used |= set(re.findall(r'env::get(?:_or)?\(\s*"(?:JAX_MOE_A2A_)?([A-Z0-9_]+)"', fh.read()))
    assert used <= set(native), f"read in cc/ but not in kNative: {sorted(used - set(native))}"
