#!/usr/bin/env bash
# One GPU call for the grouped expert GEMMs (issue 31): build with the CUTLASS headers, check the
# kernels' SASS, run the GPU tests against the NumPy oracle, run benchmarks/gemm.py.
# Env: OUT (logs), WHEELS (folder holding the nvidia-cutlass wheel, installed with --no-deps),
#      GEMM_BENCH_ARGS (extra arguments of benchmarks/gemm.py), GEMM_SKIP_TESTS=1,
#      GEMM_SKIP_BENCH=1 (no full benchmark), GEMM_TESTS (pytest files, default the two GEMM ones),
#      GEMM_SWEEP: ';'-separated JAX_MOE_A2A_GEMM_TILE_M values (gemm_ffi.parse_tuning) timed in one
#      process by `benchmarks/gemm.py --variants` (the fp8 MLP per configuration; GEMM_SWEEP_CASES,
#      default decode,prefill; GEMM_SWEEP_ARGS more arguments) into $OUT/sweep.log and sweep.json;
#      GEMM_SWEEP_FIRST=1 runs it before the tests.
set -uo pipefail
OUT=${OUT:-results/gpu_gemm}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ -n "${WHEELS:-}" ]; then python3 -m pip install -q --no-deps --no-index "$WHEELS"/nvidia_cutlass-*.whl 2>&1 | tail -2; fi
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv > "$OUT/nvidia_smi.txt" 2>&1
t0=$(date +%s)
python3 -m pip install --no-build-isolation --no-deps -v . > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
echo "build: $(( $(date +%s) - t0 )) s; $(grep -m1 'grouped GEMMs' "$OUT/build.log")"
so=$(python3 -c "import jax_moe_a2a._C as c; print(c.__file__)" 2>/dev/null)
if command -v cuobjdump >/dev/null && [ -n "$so" ]; then
  cuobjdump --dump-sass "$so" > /tmp/sass.txt 2>/dev/null
  echo "sass: HGMMA $(grep -c HGMMA /tmp/sass.txt) QGMMA $(grep -c QGMMA /tmp/sass.txt) LDL/STL $(grep -cE 'LDL|STL' /tmp/sass.txt)" | tee "$OUT/sass_summary.txt"
fi
sweep() {
  [ -n "${GEMM_SWEEP:-}" ] || return 0
  timeout ${GEMM_SWEEP_TIMEOUT:-300} python3 benchmarks/gemm.py --variants "$GEMM_SWEEP" --cases "${GEMM_SWEEP_CASES:-decode,prefill}" \
    --trials 3 --out "$OUT/sweep.json" ${GEMM_SWEEP_ARGS:-} 2>&1 | tee "$OUT/sweep.log" | grep -E "variant|native fp8 ragged|parts|native_fp8_ragged|dense_dot_fp8|/ dense"
}
[ "${GEMM_SWEEP_FIRST:-0}" = 1 ] && sweep
cd tests
if [ "${GEMM_SKIP_TESTS:-0}" != 1 ]; then
  JAX_PLATFORMS=cuda timeout ${GEMM_TEST_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider --color=no ${GEMM_TESTS:-test_gemm_gpu.py test_gemm_ffi.py} 2>&1 | tee "$OUT/tests.log" | tail -15
fi
cd ..
[ "${GEMM_SWEEP_FIRST:-0}" = 1 ] || sweep
if [ "${GEMM_SKIP_BENCH:-0}" != 1 ]; then
  timeout 400 python3 benchmarks/gemm.py --out "$OUT/gemm.json" ${GEMM_BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" | tail -60
fi
if [ -n "${GEMM_COMPARE_TILE_M:-}" ]; then  # the same decode shapes with the other tile forced
  JAX_MOE_A2A_GEMM_TILE_M=$GEMM_COMPARE_TILE_M timeout 200 python3 benchmarks/gemm.py --cases decode --native-only --trials 5 \
    --out "$OUT/gemm_tile$GEMM_COMPARE_TILE_M.json" 2>&1 | tee "$OUT/bench_tile$GEMM_COMPARE_TILE_M.log" | sed -n '/=====/,$p'
fi
