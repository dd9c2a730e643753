#!/usr/bin/env bash
# Nsight Compute profile of the cuda backend's four kernels at the decode shape, one process and
# one rank (every peer wait is satisfied in-process, so ncu's kernel replay is safe), plus the
# kernel-time bench with 1 and N processes on the GPU. Run on the GPU machine after the build
# (scripts/gpu_check.sh STAGES=build). Env: OUT (logs), PROFILE_NPROCS (default "2 4"),
# NCU_SET (default full) or NCU_SECTIONS (a list of ncu sections), NCU_KERNELS (regex, default the four halves, the block-routed dispatch_send included), NCU=0 (no profile),
# KT_ITERS (timed iterations, default 50), NCU_SKIP / NCU_COUNT (matching launches skipped / profiled,
# default 8 / 4: one of each half after the first iteration; set them when NCU_KERNELS names one kernel),
# HALVES_ARGS (more halves.py options for every run, e.g. "--x-dtype bf16": the layer benchmark's x).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
BENCH=$PWD/benchmarks; RUNDIR=$(mktemp -d); cd "$RUNDIR"
export PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda,cpu CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
MPIRUN=(mpirun --allow-run-as-root --oversubscribe --bind-to none)
NOBUF=(XLA_FLAGS="--xla_gpu_enable_command_buffer=")
# 1 process: kernel times of each half (CUDA events around the launch)
env "${NOBUF[@]}" JAX_MOE_A2A_KERNEL_TIMING=1 timeout 200 python3 "$BENCH/halves.py" --backend cuda --shape decode \
  --iters ${KT_ITERS:-50} --out "$OUT/kt1" ${HALVES_ARGS:-} 2>&1 | grep -vE "step/s|^\s*$" > "$OUT/kt1.log"
for n in ${PROFILE_NPROCS-2 4}; do  # PROFILE_NPROCS="" : none
  env "${NOBUF[@]}" JAX_MOE_A2A_KERNEL_TIMING=1 JAX_MOE_A2A_LOCAL_DEVICE_IDS=0 \
    XLA_PYTHON_CLIENT_MEM_FRACTION=$(python3 -c "print(round(0.3/$n, 3))") timeout 240 "${MPIRUN[@]}" -n "$n" \
    python3 "$BENCH/halves.py" --backend cuda --shape decode --iters ${KT_ITERS:-50} --out "$OUT/kt$n" ${HALVES_ARGS:-} 2>&1 \
    | grep -vE "step/s|^\s*$|grpc|external/xla" > "$OUT/kt$n.log"
done
[ "${NCU:-1}" = 0 ] && exit 0
# ncu: skip the first iteration's 8 launches (compilation, first touch), profile one of each half
if [ -n "${NCU_SECTIONS:-}" ]; then WHAT=(); for x in $NCU_SECTIONS; do WHAT+=(--section "$x"); done
else WHAT=(--set "${NCU_SET:-full}"); fi
env "${NOBUF[@]}" XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 300 ncu --clock-control none "${WHAT[@]}" --import-source yes \
  -k "regex:${NCU_KERNELS:-(dispatch|combine)_(send|recv)(_block|_regs)?_kernel}" --launch-skip ${NCU_SKIP:-8} --launch-count ${NCU_COUNT:-4} -f -o "$OUT/prof" \
  python3 "$BENCH/halves.py" --backend cuda --shape decode --iters 2 --warmup 1 --no-check --out "$RUNDIR/b" ${HALVES_ARGS:-} \
  > "$OUT/ncu-run.log" 2>&1
ncu --import "$OUT/prof.ncu-rep" --page details > "$OUT/ncu-details.txt" 2>&1
ncu --import "$OUT/prof.ncu-rep" --page source --csv --print-source sass > "$OUT/ncu-source.csv" 2>&1 \
  || ncu --import "$OUT/prof.ncu-rep" --page source --csv > "$OUT/ncu-source.csv" 2>&1
