#!/usr/bin/env bash
# The cuda backend's inter-node path (proxy thread + TransferEngine, every peer remote) with the
# processes under CUDA MPS, on one GPU, in one device call of < 6 minutes (issue 35; open item 5).
#
#   bash scripts/gpu_proxy_mps.sh                 # OUT=gpu-out-mps by default
#   (device tool: carry .devdeps/libfabric and .devdeps/whl; the logs go to $OUT)
#
# 1. build (scripts/gpu_check.sh's build stage, ~120 s; a carried .devdeps/prebuilt/<hash> skips it)
# 2. the MPS control daemon, its pipe and log folders under /tmp (stopped at the end by its own
#    `quit`, also when a stage fails or times out: trap)
# 3. benchmarks/proxy.py at N = 2 and 4 over shm, node_size 1, decode shape, pipeline modes peer and
#    series, each process CUDA_MPS_ACTIVE_THREAD_PERCENTAGE = 100 / N (as mpsbench does), with the
#    proxies' step timelines (--timeline: each transfer cut into its parts)
# 4. the proxy tests 2:1:shm and 4:2:shm under MPS (test_ops + test_slot_pairings, -x; FI_LOG_LEVEL=warn)
# 5. `pair` (not in the default STAGES): the two tests that hang (open item 5) in variants that tell
#    the causes apart, ~45 s each: STAGES="build pair" takes < 5 minutes (see stage 5 below)
# Reading a failure (open item 5: under MPS each proxy waited 60 s for the other rank's counts): the
# benchmark prints the engine's own ping-pong in the same processes first (shm working under MPS or
# not, no kernel involved); a proxy timeout now names the slot's flags and the proxy's step: at
# "counts in" with d_counts and d_packed up, our COUNTS went out and the peer's never arrived (the
# transport), with d_counts 0 our dispatch_send kernel never published (a kernel not running or not
# seeing d_send_ok); the cuda-gdb dump shows which kernels are resident and where each thread waits.
# Every stage is bounded by `timeout`. A stage that fails or hangs leaves, in $OUT: the per-rank logs
# (mpirun --output-filename), the MPS server and control logs, `get_server_list`, and, for a test
# still running 15 s before its limit, every rank's GPU kernels and host stacks (cuda-gdb; the proxy
# thread's stack says which flag or arrival it waits for). Limits: build 240 s (BUILD_LIMIT; 140 s cut off a 2026-12-05 build with libfabric), benchmark 45 / 55 s,
# tests 45 / 55 s (N = 2 / 4): 340 s at most, with the daemon's start and stop under 6 minutes;
# `pair` 55 + 45 + 45 s (its default variants): with the build, under 5 minutes.
# Env: OUT, STAGES (default "build bench tests"; also pair, layers (stage 6), LAYERS_LIMIT), PAIR_VARIANTS, PAIR_LIMIT (stage 5),
# BENCH_NS (default "2 4"), TEST_LOADING (the tests' CUDA module loadings, default "lazy eager": stage 4),
# LAYERS_VARIANTS and LAYERS_ROUNDS (the proxy path's layers.py --env-variants and
# --rounds, e.g. "default;JAX_MOE_A2A_COMB_PIECES=4" and 2: settings compared in the same processes, in
# interleaved rounds; the stage's own step timeline is then off), TEST_RUNS (default "2:1 4:2"), PROXY_PIPELINE_MODES (default "peer,series"),
# PROXY_ROUNDS (the modes in that many interleaved rounds, benchmarks/proxy.py --rounds; default 1), TEST_K (a pytest -k expression for the
# tests), TEST_LIMIT (seconds per test run, default 45 / 55 for N = 2 / 4; above the communicators'
# 60 s timeout_s a stuck op ends in its own TimeoutError, naming its flags).
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
OUT=${OUT:-gpu-out-mps}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
STAGES=${STAGES-build bench tests}  # set and empty: none
has() { [[ " $STAGES " == *" $1 "* ]]; }
T0=$(date +%s)
say() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a "$OUT/mps.log"; }
MPIRUN=(mpirun --allow-run-as-root --oversubscribe --bind-to none)
quiet() { grep -vE "^\s*$" | grep -vE "grpc|UNAVAIL|WatchTasks|Source Loc|CANCELLED|external/xla|^E[0-9]{4} [0-9:.]+ "; }
export CUDA_VISIBLE_DEVICES=${GPU_CHECK_VISIBLE:-0} PYTHONUNBUFFERED=1
export JAX_MOE_A2A_TEST_WATCHDOG_S=${JAX_MOE_A2A_TEST_WATCHDOG_S:-25}  # a stuck test prints its communicators (tests/watchdog.py)
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1

# ---- 1. build: gpu_check.sh's stage (it installs the package, or copies a carried prebuilt _C) ----
if has build; then
  say "build"
  OUT="$OUT/build" STAGES=build timeout -k 5 "${BUILD_LIMIT:-240}" bash scripts/gpu_check.sh > "$OUT/build-stage.log" 2>&1
  tail -5 "$OUT/build/build.log" 2>/dev/null | tee -a "$OUT/mps.log"
fi
# gpu_check.sh's prebuilt path puts _C into the source tree (PYTHONPATH=$REPO there); the same here.
ls "$REPO"/jax_moe_a2a/_C*.so > /dev/null 2>&1 && export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}
if [ -d .devdeps/libfabric/lib/pkgconfig ]; then
  export LD_LIBRARY_PATH=$PWD/.devdeps/libfabric/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi
RUNDIR=$(mktemp -d)
(cd "$RUNDIR" && python3 -c "import jax_moe_a2a._C as c; print('libfabric:', c.built_with_libfabric(), 'cuda:', c.built_with_cuda())") \
  2>&1 | tee -a "$OUT/mps.log"

# ---- 2. MPS ----------------------------------------------------------------------------------
export CUDA_MPS_PIPE_DIRECTORY=/tmp/a2a-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/a2a-mps-log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
mps_logs() {
  echo "== get_server_list: $(echo get_server_list | timeout 5 nvidia-cuda-mps-control 2>&1 | tr '\n' ' ')"
  for f in "$CUDA_MPS_LOG_DIRECTORY"/control.log "$CUDA_MPS_LOG_DIRECTORY"/server.log; do
    [ -f "$f" ] && { echo "== $f (last 25 lines)"; tail -25 "$f"; }
  done
}
stop_mps() {
  mps_logs > "$OUT/mps-daemon.log" 2>&1
  echo quit | timeout 10 nvidia-cuda-mps-control > /dev/null 2>&1
  say "MPS daemon stopped (quit)"
}
say "MPS daemon: nvidia-cuda-mps-control -d (pipe $CUDA_MPS_PIPE_DIRECTORY, log $CUDA_MPS_LOG_DIRECTORY)"
if ! timeout 20 nvidia-cuda-mps-control -d; then
  say "MPS: the control daemon did not start"; mps_logs | tee -a "$OUT/mps.log"; exit 1
fi
trap stop_mps EXIT
sleep 1
nvidia-smi --query-gpu=name,compute_mode,memory.used --format=csv 2>&1 | tee -a "$OUT/mps.log"

# A test or benchmark still running after $1 s: every rank's GPU kernels and host stacks.
dump_hung() {  # $1 = seconds, $2 = pgrep pattern, $3 = output prefix
  sleep "$1"
  for pid in $(pgrep -f "$2"); do
    timeout 25 cuda-gdb -q -batch -p "$pid" -ex "info cuda kernels" -ex "thread apply all bt 24" > "$3.$pid" 2>&1 &
  done
  wait
}
rank_logs() {  # $1 = an mpirun --output-filename folder, $2 = lines kept per file
  for f in $(find "$1" -type f 2>/dev/null | sort); do echo "== $f"; quiet < "$f" | tail -"$2"; done
}
# The provider: the caller's JAX_MOE_A2A_PROVIDER (e.g. "tcp;ofi_rxm" with JAX_MOE_A2A_IFACE=lo), else shm.
mps_env() {  # $1 = n: the environment of a run with n processes on GPU 0 under MPS
  echo JAX_PLATFORMS=cuda,cpu JAX_MOE_A2A_LOCAL_DEVICE_IDS=0 JAX_MOE_A2A_NODE_SIZE=1 JAX_MOE_A2A_PROVIDER="${JAX_MOE_A2A_PROVIDER:-shm}" \
    CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$((100 / $1)) \
    XLA_PYTHON_CLIENT_MEM_FRACTION=$(python3 -c "print(round(0.3/$1, 3))")
}

# ---- 3. the benchmark: end to end, breakdown, raw wire, pipelined and series -----------------
if has bench; then
  for n in ${BENCH_NS:-2 4}; do
    name=bench-n$n; rm -rf "$RUNDIR/$name"
    say "proxy benchmark N=$n under MPS ($(mps_env "$n"))"
    limit=$(( (n == 2 ? 45 : 55) * ${PROXY_ROUNDS:-1} ))
    dump_hung $((limit - 15)) "python3 $REPO/benchmarks/proxy.py" "$OUT/$name-hung" & DUMPER=$!
    (cd "$RUNDIR" && env $(mps_env "$n") JAX_MOE_A2A_KERNEL_TIMING=1 XLA_FLAGS="--xla_gpu_enable_command_buffer=" \
      timeout -k 5 "$limit" "${MPIRUN[@]}" -n "$n" --output-filename "$RUNDIR/$name" \
      python3 "$REPO/benchmarks/proxy.py" --shape decode --iters 30 --warmup 5 --no-turns --engine-iters 1000 \
      --engine-stream-mib 16 --proxy-modes "${PROXY_PIPELINE_MODES:-peer,series}" --rounds "${PROXY_ROUNDS:-1}" \
      --json "$OUT/$name.json" --timeline "$RUNDIR/$name-timeline" \
      > "$OUT/$name.full" 2>&1)
    rc=$?
    kill $DUMPER 2>/dev/null  # by its own id; its sleep ends on its own
    quiet < "$OUT/$name.full" | grep -vE "^\s+at |Traceback" | tail -70 > "$OUT/$name.log"
    say "proxy benchmark N=$n: exit $rc (124: timed out)"; tail -45 "$OUT/$name.log"
    [ "$rc" = 0 ] || { rank_logs "$RUNDIR/$name" 25 >> "$OUT/$name.log"; mps_logs >> "$OUT/$name.log" 2>&1; }
  done
fi

# One mpirun of the proxy tests under MPS: $1 name, $2 n, $3 node_size, $4 limit (s), $5 pytest -k
# ("" for all), then extra VAR=value words for env (they win over mps_env's). Logs: $OUT/$1.{full,log},
# per rank in $RUNDIR/$1; a run still going 15 s before its limit leaves every rank's host stacks in
# $OUT/$1-hung.<pid> and their CUDA / jax_moe_a2a frames in $OUT/$1.log.
run_tests() {
  local name=$1 n=$2 ns=$3 limit=$4 k=$5; shift 5
  rm -rf "$RUNDIR/$name"
  dump_hung $((limit - 15)) "python3 -m pytest.*$name" "$OUT/$name-hung" & DUMPER=$!
  (cd "$REPO/tests" && env $(mps_env "$n") JAX_MOE_A2A_NODE_SIZE="$ns" JAX_MOE_A2A_TEST_BACKENDS=cuda \
    JAX_MOE_A2A_SOAK_STEPS=50 FI_LOG_LEVEL=warn "$@" \
    timeout -k 5 "$limit" "${MPIRUN[@]}" -n "$n" --output-filename "$RUNDIR/$name" \
    python3 -m pytest -q --color=no -p no:cacheprovider -m mpi -x -o "junit_suite_name=$name" \
    ${k:+-k "$k"} test_ops.py test_slot_pairings.py > "$OUT/$name.full" 2>&1)
  local rc=$?
  kill $DUMPER 2>/dev/null  # by its own id; its sleep ends on its own
  quiet < "$OUT/$name.full" | tail -30 > "$OUT/$name.log"
  say "$name ($n:$ns:${JAX_MOE_A2A_PROVIDER:-shm}, $*): exit $rc (124: timed out)"; tail -8 "$OUT/$name.log"
  # What tells the causes apart (open item 5), whatever the exit: the launch report, the proxies'
  # stall reports and timeouts, and which thread of a hung rank sits in a launch or a module load.
  grep -hE "launch report|cooperative|occupancy|no step for|did not arrive|too large|passed|failed" "$OUT/$name.full" \
    | sort | uniq -c | head -40 | tee -a "$OUT/$name.log"
  for f in "$OUT/$name"-hung.*; do
    [ -f "$f" ] || continue
    echo "== $f: threads in CUDA, a launch or a wait" | tee -a "$OUT/$name.log"
    grep -E "^Thread |^#[0-9]+ .*(a2a::|launch_|cuda[A-Z]|cu[A-Z][A-Za-z0-9_]+|BlockUntilReady|nanosleep|Synchronize|libcuda)" "$f" \
      | head -60 | tee -a "$OUT/$name.log"
  done
  if [ "$rc" != 0 ]; then
    rank_logs "$RUNDIR/$name" 30 >> "$OUT/$name.log"; mps_logs >> "$OUT/$name.log" 2>&1
  fi
  return 0
}

# ---- 4. the proxy tests under MPS --------------------------------------------------------------
# Each run once per CUDA module loading of TEST_LOADING (default: the caller's CUDA_MODULE_LOADING, or
# "lazy eager"): the default row path (JAX_MOE_A2A_STAGING=auto) is host rows under lazy loading and
# copy rows under eager, so both get the tests (test_ops' test_cuda_row_path_follows_module_loading
# checks which ran). A JAX_MOE_A2A_STAGING the caller sets wins over both.
if has tests; then
  for run in ${TEST_RUNS:-2:1 4:2}; do
    IFS=: read -r n ns <<< "$run"
    for ml in ${TEST_LOADING:-${CUDA_MODULE_LOADING:-lazy eager}}; do
      ml=$(echo "$ml" | tr '[:lower:]' '[:upper:]')
      run_tests "tests-n$n-ns$ns-${ml,,}" "$n" "$ns" "${TEST_LIMIT:-$((n == 2 ? 45 : 55))}" "${TEST_K:-}" \
        JAX_MOE_A2A_LAUNCH_INFO=1 CUDA_MODULE_LOADING="$ml"
    done
  done
fi

# ---- 5. the pair that hangs (open item 5), in variants that tell its causes apart --------------
# `minus-one-and-invalid` then `tp2-fp8-expert-major` (the first test whose dispatch_send is the
# grid-routed, cooperative kernel) under mpirun -n 2, each variant's limit PAIR_LIMIT (45 s; lazy:
# +10 s, for the stall report and the stack dump). Every variant prints the launch report
# (JAX_MOE_A2A_LAUNCH_INFO=1: SM count, the context's SM limit, module loading, each kernel's
# occupancy against the grid) and the proxies' stall reports after 12 s (JAX_MOE_A2A_PROXY_REPORT_S).
# PAIR_VARIANTS (default "lazy preload eager"; also atp100, nocmdbuf):
#   lazy     JAX_MOE_A2A_PRELOAD_KERNELS=0: our kernels loaded at their first launch (the code that hung)
#   preload  the default: every kernel of the backend loaded at communicator creation (cc/cuda/preload.h)
#   eager    lazy, with CUDA_MODULE_LOADING=EAGER (CUDA loads every kernel at start)
#   atp100   lazy, each client CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=100 (no SM limit)
#   nocmdbuf lazy, XLA's command buffers off
# Reading (notes/open_items.md, item 5): lazy hangs and preload and eager pass: a first launch's lazy
# load waited for the other client's spinning kernel (the fix is preload). lazy's hung rank, in its
# proxy's stall report: `waiting [0 ...` with `COUNTS ... came from ranks [0]`: its dispatch_send
# never started (its stack: a launch or a module load); `waiting [1 ...` with d_counts 0: its
# block 0 passed the d_send_ok wait and the grid never met in grid.sync (blocks not co-resident:
# see the cooperative kernel's occupancy line). preload hangs but eager passes: a load of XLA's
# kernels (not preloaded by us) did it. preload and eager hang too: not a load; then atp100 and
# nocmdbuf say whether the SM limit or command buffers matter. lazy passes: the hang did not
# reproduce (it did in every MPS test run of 2026-12-04): the run decides nothing; run it again.
if has pair; then
  PAIR_K="against_oracle and (minus-one or tp2-fp8-expert-major)"
  for v in ${PAIR_VARIANTS:-lazy preload eager}; do
    lim=${PAIR_LIMIT:-45}
    common=(JAX_MOE_A2A_LAUNCH_INFO=1 JAX_MOE_A2A_PROXY_REPORT_S=12)
    case $v in
      lazy) run_tests "pair-$v" 2 1 $((lim + 10)) "$PAIR_K" "${common[@]}" JAX_MOE_A2A_PRELOAD_KERNELS=0 ;;
      preload) run_tests "pair-$v" 2 1 "$lim" "$PAIR_K" "${common[@]}" ;;
      eager) run_tests "pair-$v" 2 1 "$lim" "$PAIR_K" "${common[@]}" JAX_MOE_A2A_PRELOAD_KERNELS=0 CUDA_MODULE_LOADING=EAGER ;;
      atp100) run_tests "pair-$v" 2 1 "$lim" "$PAIR_K" "${common[@]}" JAX_MOE_A2A_PRELOAD_KERNELS=0 CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=100 ;;
      nocmdbuf) run_tests "pair-$v" 2 1 "$lim" "$PAIR_K" "${common[@]}" JAX_MOE_A2A_PRELOAD_KERNELS=0 XLA_FLAGS=--xla_gpu_enable_command_buffer= ;;
      *) say "pair: unknown variant $v" ;;
    esac
  done
fi
# ---- 6. `layers` (not in the default STAGES): dispatch + combine as a model runs them --------------
# benchmarks/layers.py (identity experts, no shared expert, fixed routing, 4 layers in one jit, 10
# steps back to back, 5 repeats) at each N of BENCH_NS under MPS, once through the proxy path
# (JAX_MOE_A2A_NODE_SIZE=1, every peer remote) and once through the NVLink path (NODE_SIZE=N), in
# the same MPS session: no key-value barrier before each call (the proxy benchmark has one, and its
# call floor under MPS is 160-220 us a call), so "µs/layer" is one dispatch + combine end to end in
# steady state, and proxy / NVLink is issue 35's end-to-end ratio less the wire (from the `bench`
# stage's raw figures of the same bytes). ~60 s a run. The proxy path records the proxies' step
# timelines and prints each layer cut into transfers, kernel reactions and local compute.
if has layers; then
  for n in ${BENCH_NS:-2 4}; do
    for path in proxy nvlink; do
      name=layers-n$n-$path; ns=$([ "$path" = proxy ] && echo 1 || echo "$n")
      say "layers N=$n, $path path (node_size $ns) under MPS"
      tl=$([ "$path" = proxy ] && [ -z "${LAYERS_VARIANTS:-}" ] && echo "JAX_MOE_A2A_PROXY_TIMELINE=$RUNDIR/$name-timeline")
      extra=()
      [ "$path" = proxy ] && extra=(--raw-wire)
      [ "$path" = proxy ] && [ -n "${LAYERS_VARIANTS:-}" ] && extra+=(--env-variants "$LAYERS_VARIANTS" --rounds "${LAYERS_ROUNDS:-1}")
      (cd "$RUNDIR" && env $(mps_env "$n") JAX_MOE_A2A_NODE_SIZE="$ns" $tl timeout -k 5 "${LAYERS_LIMIT:-60}" \
        "${MPIRUN[@]}" -n "$n" python3 "$REPO/benchmarks/layers.py" --backend cuda --shape decode --experts identity \
        --shared none --routing fixed --layers 4 --steps 10 --repeats 5 --no-plain --no-plot --out "$OUT/$name" \
        "${extra[@]}" > "$OUT/$name.full" 2>&1)
      rc=$?
      quiet < "$OUT/$name.full" | grep -vE "^\s+at |Traceback" | tail -30 > "$OUT/$name.log"
      say "layers N=$n $path: exit $rc (124: timed out)"; grep -E "^cuda |finished" "$OUT/$name.log" | tail -3
      # the proxy's steps per layer (benchlib/proxy_timeline.py: transfers and the cycle between them),
      # the first 40 dispatches of each rank (compile, warm-up) left out
      [ -n "$tl" ] && (cd "$REPO/benchmarks" && python3 -m benchlib.proxy_timeline "$RUNDIR/$name-timeline" --skip 40) \
        2>&1 | tee -a "$OUT/$name.log"
    done
    # issue 35's measure of this N: the proxy loop against the raw exchange of its bytes (measured
    # in its processes, --raw-wire) plus the NVLink path's loop (its kernels and framework)
    (cd "$REPO/benchmarks" && python3 -m benchlib.loop_ratio gpu "$OUT/layers-n$n-proxy/layers.json" \
      "$OUT/layers-n$n-nvlink/layers.json") 2>&1 | tee -a "$OUT/mps.log"
  done
fi
say "done"
