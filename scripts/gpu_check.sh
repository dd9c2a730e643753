#!/usr/bin/env bash
# Build and test on a GPU machine (the H200 machine of DESIGN.md section 12): the CUDA FFI
# handlers against the NumPy oracle, the op tests on the GPU, then the benchmark.
# Logs go to ${OUT:-gpu-out}. Uses the machine's Python and jax (no venv, no downloads).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
} 2>&1 | tee "$OUT/env.log"
python3 -m pip install -q --no-build-isolation --no-deps . 2>&1 | tail -20 | tee "$OUT/build.log"
python3 -c "import jax_moe_a2a._C as c; print('cuda:', c.built_with_cuda(), 'libfabric:', c.built_with_libfabric())" | tee -a "$OUT/build.log"
cd tests
JAX_PLATFORMS=cuda,cpu XLA_PYTHON_CLIENT_MEM_FRACTION=0.5 python3 -m pytest -q -p no:cacheprovider \
  test_quant.py test_ops.py test_errors.py test_grad.py 2>&1 | tee "$OUT/tests.log"
cd ..
JAX_PLATFORMS=cuda,cpu python3 -m jax_moe_a2a.bench --backend reference --out "$OUT/bench" ${BENCH_ARGS:-} 2>&1 \
  | grep -v "it/s\|step/s" | tee "$OUT/bench.log"
