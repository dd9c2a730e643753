#!/usr/bin/env bash
# The plain pip route, as a new user takes it: a clean virtual environment (no system site
# packages), `pip install <checkout>` with build isolation (the build brings the jax/jaxlib that
# pyproject.toml's [build-system] requires pins: its XLA FFI headers), then the README's example
# run from outside the checkout. The checkout is copied first (without build/, .venv/, bench-out/
# and .git/), so the build starts clean, as `pip install git+<url>` does, and leaves the
# checkout's own build/ (scripts/setup.sh's incremental build) alone.
# Env: JAX_MOE_A2A_PIP_CHECK_DIR  where the venv and the copy go (default: a fresh temp folder,
#      removed at the end).
# --with-cuda: compile the CUDA kernels too where nvcc exists. Without it the check builds the CPU
# parts only (-C cmake.define.JAX_MOE_A2A_CUDA=OFF), as on a machine without nvcc: the route under
# test is the packaging, and CI's 2 cores already compile the kernels once in scripts/setup.sh.
set -euo pipefail
cuda_args=(-C cmake.define.JAX_MOE_A2A_CUDA=OFF)
[ "${1:-}" = --with-cuda ] && cuda_args=()
cd "$(dirname "$0")/.."
checkout=$PWD
work=${JAX_MOE_A2A_PIP_CHECK_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/a2a-pip-check.XXXXXX")}
[ -n "${JAX_MOE_A2A_PIP_CHECK_DIR:-}" ] || trap 'rm -rf "$work"' EXIT
mkdir -p "$work/src" "$work/run"
t0=$SECONDS
tar -C "$checkout" --exclude=./build --exclude=./.venv --exclude=./bench-out --exclude=./.git -cf - . \
  | tar -C "$work/src" -xf -
python3 -m venv "$work/venv"
"$work/venv/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
echo "pip-check: pip install <checkout> into a clean venv (build isolation${cuda_args[*]:+, CUDA kernels off})"
if ! "$work/venv/bin/python" -m pip install "${cuda_args[@]}" "$work/src" > "$work/pip.log" 2>&1; then
  tail -n 40 "$work/pip.log"; echo "pip-check: FAILED: pip install <checkout> ($((SECONDS - t0)) s)"; exit 1
fi
t1=$SECONDS
python3 - "$checkout/README.md" > "$work/run/example.py" <<'PY'
import re, sys
text = open(sys.argv[1]).read()
marker = "<!-- tests/test_readme_example.py runs the next python block as printed -->"
print(re.search(r"```python\n(.*?)```", text[text.index(marker):], re.S).group(1))
PY
cd "$work/run"
"$work/venv/bin/python" -c "import jax, jaxlib, jax_moe_a2a as a2a, jax_moe_a2a._ffi as f; print('pip-check: jax', jax.__version__, 'jaxlib', jaxlib.__version__, '| built against', f.build_info(), '| backends', a2a.available_backends())"
JAX_PLATFORMS=cpu "$work/venv/bin/python" example.py 2>&1 | tee example.log
grep -qE '^host \(128, 256\) bfloat16 [0-9]' example.log || { echo "pip-check: FAILED: the README example did not run on the host backend"; exit 1; }
echo "pip-check: OK (install $((t1 - t0)) s, example $((SECONDS - t1)) s)"
