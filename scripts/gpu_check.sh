#!/usr/bin/env bash
# Build and test on a GPU machine (one or more H200s: notes/gpu_runbook.md), then benchmark.
# Several processes share the one GPU, each one JAX rank (XLA's own collectives refuse that, so
# the multi-process runs use the cuda backend and the NumPy oracle only).
# Env: OUT (log dir, default gpu-out), NPROCS (default "2 4 8"), STAGES (default "build single mpi bench";
# also: probe (benchmarks/gemm_probe.cu: our own fp8 GEMM checked and timed without Python; PROBE_ARGS
#      check | time), gemmbench (benchmarks/gemm.py, default: CUTLASS, kAuto, kAuto unfused and wgmma,fused, fp8, decode
#      L = 8 / 32 / 256 and prefill; GEMM_BENCH_ARGS replaces its arguments), serve timeout nocmdbuf sanitizer mpibench mpsbench nvshmem nvshmem-timeout proxy proxybench,
#      layers (the MoE layer benchmark, command buffers on and off), anchor (pplx-kernels from
#      .devdeps/pplx_anchor at N = ANCHOR_NPROCS, default "2 4", processes on GPU 0) and anchorbench
#      (our cuda and nvshmem halves the same way, one table next to pplx's; run after anchor),
#      gpus gpusbench: every GPU of the machine, one process driving all and one process per GPU),
#      GPUS_SINGLE=0 skips the gpus stage's one-process run, TMAX (cap on every stage's timeout, s), .devdeps/prebuilt/<hash>/_C*.so (skip the build; with
#      jax_moe_a2a_bench*.so beside it, the benchmarks' C++ loops too).
#      NVSHMEM_NPROCS (process counts of the nvshmem stage, default "1 2 4"; 1 = no mpirun),
#      NVSHMEM_TESTS (its test files), NVSHMEM_ALL_CASES (0: test_ops's mpi subset under mpirun),
#      JAX_MOE_A2A_NVSHMEM_REMOTE=all (every peer on the nvshmem remote path: docs/api.md),
#      SINGLE_TESTS / MPI_TESTS (the test files of the single and mpi stages),
#      cpuproxy (issue 35 on CPUs: the host backend proxied, benchmarks/proxy.py at N = 2 / 4 over shm and tcp, then layers.py with and without --proxied;
#      CPUPROXY_RUNS, CPUPROXY_MODES, CPUPROXY_BENCH / CPUPROXY_LAYERS (0: skip proxy.py / the layer loops), CPUPROXY_ROUNDS), PROXYBENCH_RUNS / PROXYBENCH_MODES / PROXYBENCH_TMAX / PROXYBENCH_ARGS (the proxybench stage, below;
#      e.g. PROXYBENCH_ARGS="--nvlink-json DIR/halves.json" after `mpibench` with BENCH_ARGS="--turns"),
#      BENCH_ARGS (halves.py options of the bench stages; the anchor kit's run.sh reads it too, so
#      run `anchor` in a call without it and `anchorbench` with it).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
RUNDIR=$(mktemp -d)  # run Python outside the source tree so the installed package (with _C) is imported
REPO=$PWD; BENCH=$PWD/benchmarks  # benchmark programs (run as scripts: they import the installed package)
export PYTHONUNBUFFERED=1 JAX_MOE_A2A_COMMIT=${JAX_MOE_A2A_COMMIT:-unknown}
STAGES=${STAGES:-build single mpi bench}
MPIRUN=(mpirun --allow-run-as-root --oversubscribe --bind-to none)
has() { [[ " $STAGES " == *" $1 "* ]]; }
stage() { has "$1" && echo "$(date +%T) $1" >> "$OUT/stages.log"; }  # stages.log: when each stage began
cap() { echo $(( ${TMAX:-100000} < $1 ? ${TMAX:-100000} : $1 )); }  # TMAX: cap every stage's timeout (s)
# Multicast stays off on shared hosts with several GPUs (the device tool's KINDS.md), child processes too.
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
NGPU=$(nvidia-smi -L 2>/dev/null | grep -c "^GPU" || true)
# Every stage but gpus/gpusbench takes GPU 0 only (GPU_CHECK_VISIBLE to change); those two take all $NGPU.
export CUDA_VISIBLE_DEVICES=${GPU_CHECK_VISIBLE:-0}
quiet() { grep -vE "^\s*$" | grep -vE "grpc|UNAVAIL|WatchTasks|Source Loc|CANCELLED|external/xla|^E[0-9]{4} [0-9:.]+ "; }
rank_logs() {  # $1 = an mpirun --output-filename folder, $2 = lines kept per file
  for f in $(find "$1" -type f | sort); do echo "== $f"; quiet < "$f" | tail -"$2"; done
}
# A libfabric carried in .devdeps/libfabric (../shared/tools/device-libfabric.sh): the build finds it
# through pkg-config and the tests load it (the proxy stages need it; the rest builds without).
if [ -d .devdeps/libfabric/lib/pkgconfig ] && [ -z "${PKG_CONFIG_PATH:-}" ]; then
  export PKG_CONFIG_PATH=$PWD/.devdeps/libfabric/lib/pkgconfig LD_LIBRARY_PATH=$PWD/.devdeps/libfabric/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi
# The CUTLASS headers (grouped GEMMs: the build and the probe) come from the nvidia-cutlass wheel,
# carried in .devdeps/whl where the machine is offline; installed once, before any stage needs it.
if { has build || has probe; } && ls .devdeps/whl/nvidia_cutlass-*.whl > /dev/null 2>&1 \
   && ! python3 -c "import cutlass_library" 2> /dev/null; then
  python3 -m pip install -q --no-deps --no-index .devdeps/whl/nvidia_cutlass-*.whl > "$OUT/cutlass.log" 2>&1
fi
if stage build; then
  { nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    python3 -c "import jax; print('jax', jax.__version__, jax.devices())"; } 2>&1 | tee "$OUT/env.log"
  # A previous call's extension, carried in .devdeps/prebuilt/<hash of the C++ sources>/, skips the build.
  SRC_HASH=$(cat CMakeLists.txt pyproject.toml $(find cc -type f | LC_ALL=C sort) | sha256sum | cut -c1-16)
  PREBUILT=$(ls .devdeps/prebuilt/"$SRC_HASH"/_C*.so 2>/dev/null | head -1)
  if [ -n "$PREBUILT" ]; then
    # under the name Python imports (_C.cpython-312-x86_64-linux-gnu.so), not the carried one
    EXT=$(python3 -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
    cp "$PREBUILT" "jax_moe_a2a/_C$EXT" && export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
    # the benchmarks' C++ timing loops (benchmarks/engine.py, proxy.py), when carried beside it
    BENCH_SO=$(ls .devdeps/prebuilt/"$SRC_HASH"/jax_moe_a2a_bench*.so 2>/dev/null | head -1)
    [ -n "$BENCH_SO" ] && cp "$BENCH_SO" "jax_moe_a2a_bench$EXT"
    echo "prebuilt extension $PREBUILT" | tee "$OUT/build.log"
  else
    python3 -m pip install -v --no-build-isolation --no-deps . > "$OUT/build.full" 2>&1
    tail -20 "$OUT/build.full" | tee "$OUT/build.log"
    SO=$(cd "$RUNDIR" && python3 -c "import jax_moe_a2a._C as c; print(c.__file__)")
    [ -n "$SO" ] && cp "$SO" "$OUT/_C-$SRC_HASH.so"  # bring it back for the next call
    BSO=$(cd "$RUNDIR" && python3 -c "import jax_moe_a2a_bench as b; print(b.__file__)" 2>/dev/null)
    [ -n "$BSO" ] && cp "$BSO" "$OUT/jax_moe_a2a_bench-$SRC_HASH.so"  # carried beside _C (prebuilt/<hash>/)
  fi
  if ! (cd "$RUNDIR" && python3 -c "import jax_moe_a2a._C as c; print('cuda:', c.built_with_cuda(), 'nvshmem:', c.built_with_nvshmem(), 'libfabric:', c.built_with_libfabric())") 2>&1 | tee -a "$OUT/build.log"; then
    echo "gpu_check: the build failed (no _C to import); its errors:" | tee -a "$OUT/build.log"
    grep -B2 -A6 -E "error|FAILED" "$OUT/build.full" 2>/dev/null | head -60 | tee -a "$OUT/build.log"
    exit 1  # every later stage would fail on the missing extension
  fi
fi
if stage probe; then
  # Our own fp8 grouped GEMM without Python or the build (benchmarks/gemm_probe.cu, ~20 s to compile):
  # its checks against a CUDA-core reference, then its timings next to the HBM floor.
  CUTLASS_INC=$(python3 -c "import cutlass_library, os; print(os.path.join(os.path.dirname(cutlass_library.__file__), 'source', 'include'))")
  if nvcc -std=c++17 -O3 -arch=sm_90a --expt-relaxed-constexpr -DA2A_GEMM_ABLATIONS -Icc -I"$CUTLASS_INC" benchmarks/gemm_probe.cu \
       cc/gemm/gemm_fp8_wgmma.cu cc/gemm/swiglu.cu -o "$RUNDIR/gemm_probe" > "$OUT/probe-build.log" 2>&1; then
    timeout -k 5 "$(cap 180)" "$RUNDIR/gemm_probe" ${PROBE_ARGS:-} 2>&1 | tee "$OUT/probe.log"
  else
    echo "gpu_check: the probe did not compile" | tee -a "$OUT/probe-build.log"; tail -20 "$OUT/probe-build.log"
  fi
fi
cd tests
if stage single; then
  JAX_PLATFORMS=cuda,cpu JAX_MOE_A2A_TEST_BACKENDS=${SINGLE_BACKENDS:-cuda,reference} XLA_PYTHON_CLIENT_MEM_FRACTION=0.5 timeout $(cap 420) python3 -m pytest -q -p no:cacheprovider \
    ${SINGLE_TESTS:-test_quant.py test_ops.py test_errors.py test_grad.py test_readme_example.py test_models.py test_nnx.py \
    test_overlap_schedule.py test_slot_pairings.py test_gemm_gpu.py test_gemm_ffi.py} 2>&1 | tee "$OUT/single.full" | quiet | tail -40 | tee "$OUT/single.log"
fi
if stage mpi; then
  for n in ${NPROCS:-2 4 8}; do
    JAX_PLATFORMS=cuda,cpu JAX_MOE_A2A_LOCAL_DEVICE_IDS=0 JAX_MOE_A2A_TEST_BACKENDS=cuda \
    XLA_PYTHON_CLIENT_MEM_FRACTION=$(python3 -c "print(round(0.6/$n, 3))") \
      JAX_MOE_A2A_SOAK_STEPS=$([ "$n" = 2 ] && echo 1000 || echo 100) timeout $(cap 400) "${MPIRUN[@]}" -n "$n" python3 -m pytest -q --color=no -p no:cacheprovider -m mpi -x \
      ${MPI_TESTS:-test_ops.py test_grad.py test_protocol.py test_slot_pairings.py} 2>&1 | quiet \
      | tail -30 | tee "$OUT/mpi$n.log"
  done
fi
if stage serve; then  # the serving example: 2 processes sharing the GPU, cuda backend, checked against a dense layer
  JAX_PLATFORMS=cuda,cpu JAX_MOE_A2A_LOCAL_DEVICE_IDS=0 XLA_PYTHON_CLIENT_MEM_FRACTION=0.2 timeout $(cap 200) "${MPIRUN[@]}" -n 2 \
    python3 ../examples/serve.py --steps 8 --tokens 128 --hidden 1024 --backend cuda 2>&1 \
    | grep -E "^(step|process|[0-9]+ processes)|MISMATCH|Error" | tee "$OUT/serve.log"
fi
# A test that hangs anyway: after $1 s, the CPU and GPU stacks of every process matching $2 go to
# $3.<pid> (cuda-gdb attaches; run in the background, killed when the test ends).
dump_hung() {
  sleep "$1"
  for pid in $(pgrep -f "$2"); do
    timeout 60 cuda-gdb -q -batch -p "$pid" -ex "info cuda kernels" -ex "thread apply all bt 14" > "$3.$pid" 2>&1 &
  done
  wait
}
if stage timeout; then  # a rank that never calls: the others must fail naming it (kills their CUDA context)
  for n in ${TIMEOUT_NPROCS:-2}; do  # the last process stays silent
    rm -rf "$RUNDIR/timeout$n"
    dump_hung 100 "^python3 -m pytest.*never_calls" "$OUT/timeout$n-hung" & DUMPER=$!
    JAX_PLATFORMS=cuda,cpu JAX_MOE_A2A_LOCAL_DEVICE_IDS=0 JAX_MOE_A2A_TEST_BACKENDS=cuda JAX_MOE_A2A_TEST_TIMEOUT=1 \
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.1 timeout $(cap 150) "${MPIRUN[@]}" -n "$n" --output-filename "$RUNDIR/timeout$n" \
      python3 -m pytest -q -s --color=no -p no:cacheprovider -o timeout=90 -m mpi test_protocol.py -k never_calls \
      > /dev/null 2>&1
    echo "exit $?" > "$OUT/timeout$n.log"
    kill $DUMPER 2>/dev/null  # its pending sleep ends on its own; never pkill by pattern here
    rank_logs "$RUNDIR/timeout$n" 60 >> "$OUT/timeout$n.log"
  done
fi
# Every GPU of the machine (NVLink between them): one process driving all, then one process per GPU
# (JAX_MOE_A2A_LOCAL_DEVICE_IDS=local_rank) for cuda, nvshmem, the proxy path and reference (NCCL).
ALL_GPUS=(env -u CUDA_VISIBLE_DEVICES JAX_PLATFORMS=cuda,cpu NVSHMEM_REMOTE_TRANSPORT=none)
if stage gpus; then
  [ "${GPUS_SINGLE:-1}" = 1 ] && "${ALL_GPUS[@]}" JAX_MOE_A2A_TEST_BACKENDS=${GPUS_SINGLE_BACKENDS:-cuda,reference,ragged} \
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.5 JAX_MOE_A2A_SOAK_STEPS=1000 \
    timeout $(cap 300) python3 -m pytest -q -p no:cacheprovider test_ops.py test_grad.py test_protocol.py test_slot_pairings.py 2>&1 \
    | tail -30 | tee "$OUT/gpus-single.log"
  for be in ${GPUS_BACKENDS:-cuda nvshmem proxy ragged}; do
    extra=(JAX_MOE_A2A_TEST_BACKENDS=$be,reference)
    [ "$be" = proxy ] && extra=(JAX_MOE_A2A_TEST_BACKENDS=cuda JAX_MOE_A2A_NODE_SIZE=1 JAX_MOE_A2A_PROVIDER=shm)
    "${ALL_GPUS[@]}" "${extra[@]}" JAX_MOE_A2A_LOCAL_DEVICE_IDS=local_rank JAX_MOE_A2A_MPI_ALL_CASES=1 \
      XLA_PYTHON_CLIENT_MEM_FRACTION=0.5 JAX_MOE_A2A_SOAK_STEPS=1000 timeout $(cap 300) "${MPIRUN[@]}" -n "$NGPU" \
      --output-filename "$OUT/gpus-mpi-$be.ranks" python3 -m pytest -q --color=no -p no:cacheprovider -m mpi -x test_ops.py test_grad.py test_protocol.py test_slot_pairings.py 2>&1 \
      | quiet | tee "$OUT/gpus-mpi-$be.full" | tail -30 | tee "$OUT/gpus-mpi-$be.log"
  done
fi
if stage nocmdbuf; then  # the same single-process suite with XLA command buffers (CUDA graphs) disabled
  JAX_PLATFORMS=cuda,cpu XLA_FLAGS="--xla_gpu_enable_command_buffer=" XLA_PYTHON_CLIENT_MEM_FRACTION=0.5 timeout $(cap 300) \
    python3 -m pytest -q -p no:cacheprovider test_ops.py -k cuda 2>&1 | tail -5 | tee "$OUT/nocmdbuf.log"
fi
if stage sanitizer; then  # compute-sanitizer on small cases, one rank (SANITIZER_K: pytest -k, SANITIZER_TOOLS)
  for tool in ${SANITIZER_TOOLS:-memcheck racecheck}; do
    # Its own process group, killed whole afterwards: a timeout that kills compute-sanitizer alone
    # leaves the target running, holding the GPU and the output pipe (seen: the stage ran 6 min).
    JAX_PLATFORMS=cuda,cpu XLA_PYTHON_CLIENT_PREALLOCATE=false setsid bash -c 'echo $$ > "$0"; exec "$@"' "$RUNDIR/san.pgid" \
      timeout $(cap 400) compute-sanitizer --tool $tool --target-processes all python3 -m pytest -q -p no:cacheprovider \
      test_ops.py -k "${SANITIZER_K:-cuda and (fp8-random or tp2 or overflow-ragged or odd-hidden)}" \
      > "$OUT/sanitizer-$tool.full" 2>&1
    pkill -9 -g "$(cat "$RUNDIR/san.pgid")" 2>/dev/null
    grep -E -A12 "ERROR SUMMARY|passed|failed|Invalid|Race|Misaligned" "$OUT/sanitizer-$tool.full" | head -60 \
      | tee "$OUT/sanitizer-$tool.log"
  done
fi
if stage nvshmem; then  # the nvshmem backend on the oracle: every case, the protocol tests and a soak
  # (JAX_MOE_A2A_NVSHMEM_REMOTE=all in the environment: every peer on the remote path, bounce rows)
  # NVSHMEM_REMOTE_TRANSPORT=none: several PEs on the one GPU run in NVSHMEM's limited MPG mode.
  NV_ENV=(JAX_PLATFORMS=cuda,cpu JAX_MOE_A2A_TEST_BACKENDS=nvshmem NVSHMEM_REMOTE_TRANSPORT=none)
  for n in ${NVSHMEM_NPROCS:-1 2 4}; do
    if [ "$n" = 1 ]; then  # one process, one rank (N = 1): every test of these files
      env "${NV_ENV[@]}" XLA_PYTHON_CLIENT_MEM_FRACTION=0.5 JAX_MOE_A2A_SOAK_STEPS=1000 timeout $(cap 500) \
        python3 -m pytest -q -p no:cacheprovider ${NVSHMEM_TESTS:-test_ops.py test_grad.py test_protocol.py test_slot_pairings.py test_errors.py test_nvshmem_remote.py test_nvshmem_counts.py test_quant.py::test_gpu_send_kernels_non_finite} 2>&1 \
        | tee "$OUT/nvshmem1.full" | tail -30 | tee "$OUT/nvshmem1.log"
      continue
    fi
    env "${NV_ENV[@]}" JAX_MOE_A2A_LOCAL_DEVICE_IDS=0 JAX_MOE_A2A_MPI_ALL_CASES=${NVSHMEM_ALL_CASES:-1} \
      XLA_PYTHON_CLIENT_MEM_FRACTION=$(python3 -c "print(round(0.5/$n, 3))") \
      JAX_MOE_A2A_SOAK_STEPS=$([ "$n" = 2 ] && echo 1000 || echo 200) timeout $(cap 560) "${MPIRUN[@]}" -n "$n" \
      python3 -m pytest -q --color=no -p no:cacheprovider -m mpi -x ${NVSHMEM_TESTS:-test_ops.py test_grad.py test_protocol.py test_slot_pairings.py test_nvshmem_remote.py test_nvshmem_counts.py} 2>&1 \
      | quiet | tee "$OUT/nvshmem-mpi$n.full" | tail -30 | tee "$OUT/nvshmem-mpi$n.log"
  done
fi
if stage nvshmem-timeout; then  # a rank that never calls: the other must fail naming it (kills its CUDA context)
  rm -rf "$RUNDIR/nvshmem-timeout"
  JAX_PLATFORMS=cuda,cpu JAX_MOE_A2A_LOCAL_DEVICE_IDS=0 JAX_MOE_A2A_TEST_BACKENDS=nvshmem NVSHMEM_REMOTE_TRANSPORT=none \
  JAX_MOE_A2A_TEST_TIMEOUT=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.1 timeout $(cap 150) "${MPIRUN[@]}" -n 2 \
    --output-filename "$RUNDIR/nvshmem-timeout" python3 -m pytest -q -s --color=no -p no:cacheprovider -o timeout=90 -m mpi \
    test_protocol.py -k never_calls > /dev/null 2>&1
  echo "exit $?" > "$OUT/nvshmem-timeout.log"  # 0: both processes passed; 124: something hung
  rank_logs "$RUNDIR/nvshmem-timeout" 60 >> "$OUT/nvshmem-timeout.log"
fi
# The cuda backend's inter-node path: JAX_MOE_A2A_NODE_SIZE=1 makes every peer remote (proxy thread +
# TransferEngine over pinned host memory), 2 keeps pairs of ranks on NVLink/IPC (hybrid). Needs an
# extension built with libfabric (PKG_CONFIG_PATH / LD_LIBRARY_PATH of a libfabric build, notes/gpu_runbook.md).
# PROXY_RUNS: "n:node_size:provider:what" items; what = full (test_ops + test_protocol + test_grad),
# ops (test_ops + test_protocol), slots (test_slot_pairings), priv0 / priv1 (test_ops subset with 0 / 1 private rows: overflow).
proxy_run() {  # $1 = n, $2 = node_size, $3 = provider, $4 = what
  local n=$1 ns=$2 prov=$3 what=$4 label files kexpr="" priv=""
  label="proxy-n$1-ns$2-${3%%;*}-$4"
  case $what in
    full) files="test_ops.py test_protocol.py test_grad.py test_slot_pairings.py";;
    ops) files="test_ops.py test_protocol.py test_slot_pairings.py";;
    slots) files="test_slot_pairings.py";;
    priv*) files="test_ops.py test_protocol.py"; priv=${what#priv}; kexpr="fp8-random or expert-major or tp2 or overflow or one-hot or two_slots";;
  esac
  env JAX_PLATFORMS=cuda,cpu JAX_MOE_A2A_LOCAL_DEVICE_IDS=0 JAX_MOE_A2A_TEST_BACKENDS=cuda JAX_MOE_A2A_NODE_SIZE="$ns" \
    JAX_MOE_A2A_PROVIDER="$prov" JAX_MOE_A2A_IFACE="$([ "$prov" = shm ] || echo lo)" JAX_MOE_A2A_MAX_PRIVATE_TOKENS="$priv" \
    XLA_PYTHON_CLIENT_MEM_FRACTION=$(python3 -c "print(round(0.5/$n, 3))") \
    JAX_MOE_A2A_SOAK_STEPS=$([ "$n" = 2 ] && echo 1000 || echo 200) timeout $(cap 560) "${MPIRUN[@]}" -n "$n" \
    python3 -m pytest -q --color=no -p no:cacheprovider -m mpi -x ${kexpr:+-k "$kexpr"} $files 2>&1 \
    | quiet | tee "$OUT/$label.full" | tail -30 | tee "$OUT/$label.log"
}
if stage proxy; then
  python3 -c "import jax_moe_a2a._C as c; assert c.built_with_libfabric(), 'built without libfabric'" 2>&1 | tee "$OUT/proxy.log" || exit 1
  for run in ${PROXY_RUNS-2:1:shm:full 4:1:shm:ops 4:2:shm:ops "2:1:tcp;ofi_rxm:ops" "4:2:tcp;ofi_rxm:ops" 4:1:shm:priv0 "4:2:tcp;ofi_rxm:priv1"}; do
    IFS=: read -r n ns prov what <<< "$run"
    proxy_run "$n" "$ns" "$prov" "$what"
  done
  # A rank that never calls (node_size 2 with 4 ranks: the silent one is remote to two of them).
  # PROXY_TIMEOUT_SPREAD=1: two processes per GPU over the machine's GPUs instead of all on GPU 0.
  for ns in ${PROXY_TIMEOUT_NS-1 2}; do  # set and empty: none
    n=$((2 * ns)); rm -rf "$RUNDIR/proxy-timeout$ns"
    place=(env CUDA_VISIBLE_DEVICES=0)
    [ "${PROXY_TIMEOUT_SPREAD:-0}" = 1 ] && place=(env -u CUDA_VISIBLE_DEVICES bash -c \
      'export CUDA_VISIBLE_DEVICES=$((OMPI_COMM_WORLD_LOCAL_RANK / 2)); exec "$@"' place)
    dump_hung 100 "^python3 -m pytest.*never_calls" "$OUT/proxy-timeout-ns$ns-hung" & DUMPER=$!
    JAX_PLATFORMS=cuda,cpu JAX_MOE_A2A_LOCAL_DEVICE_IDS=0 JAX_MOE_A2A_TEST_BACKENDS=cuda JAX_MOE_A2A_TEST_TIMEOUT=1 \
    JAX_MOE_A2A_NODE_SIZE=$ns JAX_MOE_A2A_PROVIDER=shm XLA_PYTHON_CLIENT_MEM_FRACTION=0.1 timeout $(cap 150) "${MPIRUN[@]}" -n "$n" \
      --output-filename "$RUNDIR/proxy-timeout$ns" "${place[@]}" python3 -m pytest -q -s --color=no -p no:cacheprovider -o timeout=90 \
      -m mpi test_protocol.py -k never_calls > /dev/null 2>&1
    echo "exit $?" > "$OUT/proxy-timeout-ns$ns.log"
    kill $DUMPER 2>/dev/null  # its pending sleep ends on its own; never pkill by pattern here
    rank_logs "$RUNDIR/proxy-timeout$ns" 40 >> "$OUT/proxy-timeout-ns$ns.log"
  done
fi
cd "$RUNDIR"
if stage gpusbench; then  # NVLink numbers: EP=$NGPU, every backend side by side (GPUS_BENCH1=0: no one-process run)
  [ "${GPUS_BENCH1:-1}" = 1 ] && "${ALL_GPUS[@]}" JAX_MOE_A2A_KERNEL_TIMING=1 XLA_FLAGS="--xla_gpu_enable_command_buffer=" timeout $(cap 300) \
    python3 "$BENCH/halves.py" --backend cuda,reference,ragged --out "$OUT/gpus-bench1" ${BENCH_ARGS:-} 2>&1 \
    | grep -v "step/s" | tee "$OUT/gpus-bench1.log"
  # ragged_all_to_all across processes: XLA:GPU refuses its NCCL send/recv path unless allowed
  "${ALL_GPUS[@]}" JAX_MOE_A2A_LOCAL_DEVICE_IDS=local_rank JAX_MOE_A2A_KERNEL_TIMING=1 \
    XLA_FLAGS="--xla_gpu_enable_command_buffer= --xla_gpu_allow_ragged_all_to_all_nccl_send_recv_fallback=true" \
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.5 timeout $(cap 400) "${MPIRUN[@]}" -n "$NGPU" python3 "$BENCH/halves.py" \
    --backend ${GPUS_BENCH_BACKENDS:-cuda,nvshmem,reference,ragged} --out "$OUT/gpus-benchmpi" ${BENCH_ARGS:-} 2>&1 \
    | grep -v "step/s" | quiet | tee "$OUT/gpus-benchmpi.log"
fi
if stage gemmbench; then  # the grouped GEMMs alone (benchmarks/gemm.py), CUTLASS next to our own kernel
  timeout $(cap 400) python3 "$BENCH/gemm.py" --out "$OUT/gemm.json" \
    ${GEMM_BENCH_ARGS:---variants "cutlass;auto;unfused;wgmma,fused" --cases decode,prefill --experts 8,32,256 --fp8-only --trials 3} \
    2>&1 | tee "$OUT/gemm.log"
fi
if stage bench; then  # one process, one rank: cuda next to reference, decode and prefill
  JAX_PLATFORMS=cuda,cpu JAX_MOE_A2A_KERNEL_TIMING=1 XLA_FLAGS="--xla_gpu_enable_command_buffer=" timeout $(cap 300) python3 "$BENCH/halves.py" --out "$OUT/bench1" ${BENCH_ARGS:-} 2>&1 \
    | grep -v "step/s" | tee "$OUT/bench1.log"
fi
# N processes sharing the one GPU: kernel + synchronisation overhead, never NVLink. mpibench
# time-slices the GPU; mpsbench runs the ranks side by side under the CUDA MPS daemon, each with
# 100/N % of the SMs (closer to N GPUs). Both record CUDA-event kernel times next to wall times
# (command buffers off there: a launch captured into a CUDA graph is not timed).
mpi_bench() {  # $1 = label, $2 = n, extra env before the command
  local label=$1 n=$2; shift 2
  env "$@" JAX_PLATFORMS=cuda,cpu JAX_MOE_A2A_LOCAL_DEVICE_IDS=0 JAX_MOE_A2A_KERNEL_TIMING=1 XLA_FLAGS="--xla_gpu_enable_command_buffer=" \
    XLA_PYTHON_CLIENT_MEM_FRACTION=$(python3 -c "print(round(0.3/$n, 3))") \
    timeout $(cap 300) "${MPIRUN[@]}" -n "$n" python3 "$BENCH/halves.py" --backend cuda --shape decode \
    --out "$OUT/$label$n" ${BENCH_ARGS:-} 2>&1 | grep -v "step/s" | quiet > "$OUT/$label$n.log"
  rm -f "$OUT/$label$n/halves.png"
}
if stage mpibench; then
  for n in ${NPROCS:-2 4 8}; do mpi_bench bench "$n"; done
fi
# The inter-node path on one GPU: signalling round trip, then per run (n:node_size:provider) the engine
# benchmark and the halves once per proxy mode (PROXYBENCH_MODES, default "default,spin"; spin-all also
# spins the engine's progress thread) in one mpirun, with the transfer's breakdown (skew, wire time,
# unexplained rest, idle policy); log and JSON per run. Each run's timeout grows with the modes (PROXYBENCH_TMAX
# per mode, default 240 s; TMAX caps the total).
if stage proxybench; then
  JAX_PLATFORMS=cuda,cpu timeout $(cap 120) python3 "$BENCH/proxy.py" --signal 2>&1 | tee "$OUT/proxybench-signal.log"
  modes=${PROXYBENCH_MODES:-default,spin}
  nmodes=$(( $(tr -cd , <<< "$modes" | wc -c) + 1 ))
  for run in ${PROXYBENCH_RUNS:-2:1:shm 4:1:shm 4:2:shm "2:1:tcp;ofi_rxm"}; do
    IFS=: read -r n ns prov <<< "$run"
    name="proxybench-n$n-ns$ns-${prov%%;*}"
    env JAX_MOE_A2A_NODE_SIZE="$ns" JAX_MOE_A2A_PROVIDER="$prov" JAX_MOE_A2A_IFACE="$([ "$prov" = shm ] || echo lo)" \
      JAX_PLATFORMS=cuda,cpu JAX_MOE_A2A_LOCAL_DEVICE_IDS=0 JAX_MOE_A2A_KERNEL_TIMING=1 XLA_FLAGS="--xla_gpu_enable_command_buffer=" \
      XLA_PYTHON_CLIENT_MEM_FRACTION=$(python3 -c "print(round(0.3/$n, 3))") \
      timeout -k 20 $(cap $(( 60 + nmodes * ${PROXYBENCH_TMAX:-240} ))) "${MPIRUN[@]}" -n "$n" \
      python3 "$BENCH/proxy.py" --shape decode --proxy-modes "$modes" --json "$OUT/$name.json" ${PROXYBENCH_ARGS:-} 2>&1 | quiet \
      | tee "$OUT/$name.log"
    echo "exit ${PIPESTATUS[0]}" >> "$OUT/$name.log"
  done
fi
if stage cpuproxy; then  # issue 35's CPU figure on this machine's cores: host backend, proxied (no GPU)
  # The 2-core development VM cannot give it (2 ranks x main, proxy and progress threads: the
  # proxy's run-queue wait exceeded the unexplained rest, notes/benchmarks.md 2026-12-04).
  for run in ${CPUPROXY_RUNS:-2:shm 4:shm "2:tcp;ofi_rxm" "4:tcp;ofi_rxm"}; do
    IFS=: read -r n prov <<< "$run"
    name="cpuproxy-n$n-${prov%%;*}"
    cpu_env=(env JAX_PLATFORMS=cpu JAX_MOE_A2A_PROVIDER="$prov" JAX_MOE_A2A_IFACE="$([ "$prov" = shm ] || echo lo)")
    : > "$OUT/$name.log"
    if [ "${CPUPROXY_BENCH:-1}" = 1 ]; then  # per call: benchmarks/proxy.py's breakdown (CPUPROXY_BENCH=0: skip)
      "${cpu_env[@]}" timeout -k 20 $(cap 240) "${MPIRUN[@]}" -n "$n" python3 "$BENCH/proxy.py" --backend host --iters 50 --warmup 5 \
        --engine-iters 2000 --engine-stream-mib 16 --proxy-modes "${CPUPROXY_MODES:-peer,series}" --json "$OUT/$name.json" \
        --timeline "$RUNDIR/$name-timeline" 2>&1 \
        | quiet | tee "$OUT/$name.log"
      echo "exit ${PIPESTATUS[0]}" >> "$OUT/$name.log"
    fi
    # The same op pairs as a model runs them (layers.py: 4 identity layers in one jit, no barrier
    # between calls): the loop issue 35 measures on GPUs, proxy loop / (raw exchange of its bytes +
    # the loop on the node-local path, the CPU's counterpart of the NVLink loop). The host backend's
    # node-local ranks must share a process, so the pair runs twice:
    #   same process  one process with n CPU devices, the proxied path with every peer remote
    #                 (NODE_SIZE=1, its raw exchange measured after: --raw-wire) and the node-local path
    #                 (NODE_SIZE=n: rows copied in memory, no wire) as --env-variants of one run,
    #                 interleaved in CPUPROXY_ROUNDS rounds (default 3): only the transport differs
    #   processes     n processes through the proxy (as deployed) against the node-local loop of one
    #                 process, one process start each (these loops drift 1.6-4.3 ms a layer between
    #                 starts on 16 cores: read the minima too)
    # and once through the host backend's own engine path (n processes, no proxy thread).
    # CPUPROXY_LAYERS=0: skip.
    if [ "${CPUPROXY_LAYERS:-1}" = 1 ]; then
      layers() {  # $1 tag, $2 node_size, $3 processes (0: one process with n devices), then layers.py options
        local tag=$1 ns=$2 np=$3; shift 3
        local run=("${MPIRUN[@]}" -n "$np")
        [ "$np" = 0 ] && run=(env JAX_NUM_CPU_DEVICES="$n")
        "${cpu_env[@]}" JAX_MOE_A2A_NODE_SIZE="$ns" timeout -k 20 $(cap 180) "${run[@]}" python3 "$BENCH/layers.py" \
          --backend host --shape decode --experts identity --shared none --routing fixed --no-plain --no-plot \
          --out "$OUT/$name-layers-$tag" "$@" 2>&1 | quiet | grep -E "^host |Error" | sed "s/^/layers $tag: /" | tee -a "$OUT/$name.log"
      }
      rounds=${CPUPROXY_ROUNDS:-3}
      layers same 1 0 --proxied --raw-wire --env-variants "JAX_MOE_A2A_NODE_SIZE=1;JAX_MOE_A2A_NODE_SIZE=$n" --rounds "$rounds"
      for r in $(seq 1 "$rounds"); do
        layers "local$r" "$n" 0 --proxied
        layers "proxied$r" 1 "$n" --proxied --raw-wire
      done
      layers engine 0 "$n"
      (cd "$BENCH" && python3 -m benchlib.loop_ratio cpu "$OUT/$name-layers" "$rounds" "$n") 2>&1 | tee -a "$OUT/$name.log"
    fi
  done
fi
if stage mpsbench; then
  nvidia-cuda-mps-control -d && sleep 1
  for n in ${NPROCS:-2 4 8}; do mpi_bench mps "$n" CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$((100 / n)); done
  echo quit | nvidia-cuda-mps-control
fi
if stage layers; then  # the headline: L MoE layers in one jit per backend next to plain XLA, command buffers on and off
  JAX_PLATFORMS=cuda,cpu XLA_PYTHON_CLIENT_MEM_FRACTION=0.6 timeout $(cap 500) python3 "$BENCH/layers.py" --out "$OUT/layers" \
    ${LAYERS_ARGS:-} 2>&1 | tee "$OUT/layers.log"
fi
# pplx-kernels (the anchor kit, carried as .devdeps/pplx_anchor) at the decode shape with N processes
# on GPU 0, then our cuda and nvshmem halves the same way, merged into one table (ours/pplx per half).
ANCHOR_DIR=$OUT/pplx
if stage anchor; then
  OUT="$ANCHOR_DIR" NS="${ANCHOR_NPROCS:-2 4}" timeout $(cap 900) bash "$REPO/.devdeps/pplx_anchor/run.sh" 2>&1 \
    | tee "$OUT/anchor.log"
fi
if stage anchorbench; then
  for n in ${ANCHOR_NPROCS:-2 4}; do
    env JAX_PLATFORMS=cuda,cpu JAX_MOE_A2A_LOCAL_DEVICE_IDS=0 JAX_MOE_A2A_KERNEL_TIMING=1 NVSHMEM_REMOTE_TRANSPORT=none \
      XLA_FLAGS="--xla_gpu_enable_command_buffer=" XLA_PYTHON_CLIENT_MEM_FRACTION=$(python3 -c "print(round(0.3/$n, 3))") \
      timeout $(cap 400) "${MPIRUN[@]}" -n "$n" python3 "$BENCH/halves.py" --backend "${ANCHOR_BACKENDS:-cuda,nvshmem}" \
      --shape decode --anchor-json "$ANCHOR_DIR" --no-plot --out "$OUT/anchorbench$n" ${BENCH_ARGS:-} 2>&1 | quiet \
      > "$OUT/anchorbench$n.log"
  done
  python3 "$BENCH/halves.py" --report $(for n in ${ANCHOR_NPROCS:-2 4}; do echo "$OUT/anchorbench$n/halves.json"; done) \
    2>&1 | tee "$OUT/anchorbench.log"
fi
