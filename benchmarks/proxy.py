"""The cuda backend's inter-node path (proxy thread + TransferEngine) on GPUs, and where its transfer goes.

    python benchmarks/proxy.py --signal             # GPU -> host -> GPU flag round trip
    JAX_MOE_A2A_NODE_SIZE=1 JAX_MOE_A2A_KERNEL_TIMING=1 XLA_FLAGS=--xla_gpu_enable_command_buffer= \\
        mpirun -n 2 python benchmarks/proxy.py --shape decode --json proxy.json
    mpirun -n 2 python benchmarks/proxy.py --backend host --tokens 16 --hidden 256
                                                    # the same program on CPUs (host backend's proxy)

The second form first runs the engine benchmark's latency and bandwidth loops (benchmarks/engine.py,
same processes, same provider), then, once per proxy mode (--proxy-modes, default "default,spin": a
communicator per mode, the mode's environment set before it is created), checks against the oracle
and times each half as the main bench does (halves.bench_one: a key-value-store barrier before each
jitted call, max over processes), with JAX_MOE_A2A_KERNEL_TIMING=1 also each half's kernel alone.
Each call is recorded (bench_one's hooks): the proxy's counters before it and a host clock right after its barrier.
Breakdown per half (µs, p50 over the timed iterations; benchlib/proxy_breakdown.py does the arithmetic):
  pack         dispatch: the dispatch_send kernel (CUDA events): routing, packing remote rows into
               pinned host memory; combine: the combine_send kernel
  transfer     the proxy's counter: dispatch from our COUNTS posted (dispatch_send raised d_counts,
               before it packs) to every remote rank's PRIV and OVER rows landed (counts_to_landed_ns);
               combine from our COMB posted (combine_send done) to every remote rank's COMB landed
               (comb_to_landed_ns). Per iteration the counter's increase over the half's calls, max
               over ranks; it includes waiting for the slowest peer
  unpack       dispatch: the dispatch_recv kernel (reads remote rows from pinned memory); combine:
               `reduce`, the combine_recv kernel
  skew         how far apart the processes enter the half: per iteration, max - min over processes of
               the host clock read right before each process's first call of the half (after its
               barrier; CLOCK_MONOTONIC, one clock for the processes of a machine), gathered through
               the key-value store. Host side only: processes that time-slice one GPU (no MPS) start
               their kernels later still
  wire         what the transport alone would take: latency + bytes / bandwidth. bytes: the most any
               rank sends to remote ranks in the half (rows of the benchmark's routing times the
               proxy's row: dispatch pad16(payload + scales + 8), combine H * itemsize(combine dtype));
               latency: the engine benchmark's half round trip at its size nearest one row;
               bandwidth: its streaming bandwidth at its size nearest one peer's block (bytes / remote
               peers)
  unexplained  transfer - (skew + wire), from the p50s (so that the parts add up), and the p50 of
               the same difference per iteration: the proxy's reaction to flags and the engine's
               progress thread (their idle policies), GPU time-slicing, and for dispatch the part of
               our own pack kernel after the counts went out (at most `pack`)
  idle policy  the transfer per proxy mode: `default` (JAX_MOE_A2A_PROXY=adaptive: poll while a
               transfer is under way, between ops poll 20 µs after progress, then sleep 1 µs
               doubling to 100 µs, after 20 ms idle up to 2 ms), `backoff` (the back-off also
               mid-transfer whenever no packer waits: the policy before 2026-12-05), `spin`
               (JAX_MOE_A2A_PROXY=spin: the proxy never sleeps), `spin-all` (also
               JAX_MOE_A2A_PROGRESS=spin: the engine's progress thread too); `default - spin` is what
               sleeping cost
  reaction     half the signalling round trip (--signal): one kernel -> proxy or proxy -> kernel flag
Kernels alone ("(turns)" rows, cuda with JAX_MOE_A2A_KERNEL_TIMING): processes that time-slice one
GPU time each other's kernels, copies and spinning receives too, so each half's kernel is also timed
with the GPU to itself: the processes take turns (halves.time_turns), and before a receive half's
turns every process waits until its proxy raised the landed flag (proxy_stats' dispatches_landed /
combines_landed), so the receive kernel reads rows that are there instead of waiting for the
transfer. Needs no node-local peers (JAX_MOE_A2A_NODE_SIZE=1) or KERNEL_TIMING=nosync; with
--nvlink-json each half is set against the NVLink path's (turns) p50 from halves.py --turns.
The same parts for the one-call ops ("dispatch (one call)", "combine (one call)": transfer, skew,
wire; no kernel times). --json holds every mode's record with the per-iteration samples.

End to end (host backend's proxied mode: `--backend host`; benchlib/proxy_breakdown.py, packer_*),
per dispatch and per combine, one-call op and split halves, p50 over the timed iterations, each
iteration taken on the process whose wall was longest:
  wall         the host clock from just before the call to just after it returned (the halves: the
               sum of both calls, without the barrier between them)
  pack         the send op's C++ time less its waits for the proxy's flags (proxy_stats' call_ns_* and
               wait_ns_*, kept by the host backend per op)
  send wait    the send op's wait for d_send_ok (the previous step's FREE and flush)
  unpack       the receive op's C++ time less its waits: unpacking rows / the weighted reduction
  recv wait    the receive op's waits for d_placed / d_landed_from / d_landed (or c_landed)
  rest         wall - (pack + send wait + unpack + recv wait): JAX's dispatch, the FFI call, Python
  call floor   a jitted shard_map of the dispatch's operands that calls no FFI target, timed as the
               ops are: JAX's own share of rest (the report gives rest past it; the halves pay it twice)
  raw wire     raw fi_writedata (cc/bench/raw_pingpong.h: own endpoint and CQ, busy polling) half
               round trip at exactly one peer's message size in the half (the engine benchmark's extra
               latency points, measured in these processes, interleaved with the engine's ping-pong
               at the same size), i.e. the remote peers' messages moving in parallel
  unexplained  recv wait - skew - raw wire per iteration: the proxy's and the engine's reactions, the
               protocol's rounds (COUNTS, then OVER where rows overflow, before rows count as landed),
               and on a small machine the threads time-slicing its cores
  ratio        wall / (raw wire + pack + unpack): the issue's measure, the packer's compute standing
               for the NVLink path's kernel time
  run-queue    per thread group (benchlib/sched.py: the calling thread, the proxy thread a2a-proxy, the
               engine's progress thread a2a-progress), the time it sat runnable without a CPU during the
               calls (Linux schedstat), per iteration the most any process saw: where the processes'
               threads outnumber the cores this names the unexplained wait's cause; a spinning
               thread is runnable all along, so its figure bounds (does not measure) what was on the
               transfer's path
Modes `peer` / `series` (and `-spin`) set JAX_MOE_A2A_PROXY_PIPELINE; "PRIV writes posted before the
whole pack" is proxy_stats' priv_early per dispatch.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import sys
import time

import numpy as np

from benchlib import proxy_breakdown as pb
from benchlib import raw_exchange

def parse_args(argv):
    p = argparse.ArgumentParser(prog="python benchmarks/proxy.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--signal", action="store_true", help="only the GPU -> host -> GPU signalling round trip")
    p.add_argument("--signal-iters", type=int, default=10000)
    p.add_argument("--shape", default="decode", help="decode or prefill")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--tokens", type=int, default=None)
    p.add_argument("--hidden", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--proxy-modes", default="default,spin",
                   help=f"the timed loop once per mode, comma-separated: {', '.join(pb.PROXY_MODES)} "
                        "(default: %(default)s)")
    p.add_argument("--rounds", type=int, default=1,
                   help="run the modes in this many interleaved rounds (A, B, A, B, ...: a drift of the shared "
                        "machine then hits every mode alike); the idle policy compares each mode's median over "
                        "the rounds of its transfer p50s, and the record keeps every round ('MODE (round R)')")
    p.add_argument("--backend", default="cuda", choices=("cuda", "host"),
                   help="cuda, or host: the host backend's proxied mode (same proxy thread, C++ packing), "
                        "which runs this program without GPUs")
    p.add_argument("--pause-ms", type=float, default=0.0,
                   help="every process sleeps this long before each call's barrier: idle gaps, as a serving loop "
                        "has them (the proxy thread's idle back-off, and what wakes it)")
    p.add_argument("--no-engine", action="store_true", help="skip the engine benchmark (no wire time)")
    p.add_argument("--engine-iters", type=int, default=5000,
                   help="engine benchmark: ping-pong iterations at small sizes")
    p.add_argument("--engine-stream-mib", type=int, default=64, help="engine benchmark: MiB per bandwidth point")
    p.add_argument("--no-turns", action="store_true",
                   help="skip the kernels-alone loop (the processes taking turns; see the module docstring)")
    p.add_argument("--nvlink-json", default=None,
                   help="halves.json of `halves.py --turns --backend cuda` at the same shape and process count (the "
                        "NVLink path, one node): prints each half's (turns) p50 against it")
    p.add_argument("--timeline", default=None, metavar="DIR",
                   help="record the proxies' step timelines (JAX_MOE_A2A_PROXY_TIMELINE) into DIR, one prefix per "
                        "mode and round (the processes of one machine: process 0 reads them all), and report the "
                        "timed iterations' transfers (both call forms) cut into their parts and grouped by cause, "
                        "the rows against one raw write of a peer's message (benchlib/proxy_timeline.py)")
    p.add_argument("--json", default=None, help="write the record here (process 0)")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    try:
        args.modes = pb.parse_modes(args.proxy_modes)
    except ValueError as e:
        p.error(f"--proxy-modes: {e}")
    rows = [m for m in args.modes if "JAX_MOE_A2A_STAGING" in pb.PROXY_MODES[m]]
    if args.backend == "host" and rows:
        p.error(f"--proxy-modes {','.join(rows)}: JAX_MOE_A2A_STAGING is the cuda backend's (the host backend "
                "packs host memory)")
    return args


def signal(iters):
    import jax_moe_a2a_bench as loops  # the benchmark's C++ (cc/bench), built with the package
    if not hasattr(loops, "signal_roundtrip"):
        sys.exit("benchmarks/proxy.py --signal: jax_moe_a2a_bench was built without nvcc")
    ns = np.asarray(loops.signal_roundtrip(0, iters)[iters // 10:])  # first 10 %: warm-up
    us = ns / 1e3
    rec = {"round_trips": int(us.size), "p50_us": float(np.percentile(us, 50)),
           "p99_us": float(np.percentile(us, 99)), "min_us": float(us.min()), "mean_us": float(us.mean())}
    print(f"GPU -> host -> GPU flag round trip (mapped pinned memory, host thread spinning), {us.size} trips: "
          f"p50 {rec['p50_us']:.2f} µs, p99 {rec['p99_us']:.2f} µs, min {rec['min_us']:.2f} µs", flush=True)
    return rec


# ---- across processes -----------------------------------------------------------------------

def host_clock():
    """(clock() -> int ns, its name): CLOCK_MONOTONIC when every process runs on this machine (Linux
    keeps one for all processes), else the wall clock (as good as the hosts' synchronisation)."""
    from benchlib.timing import gather
    if len(set(gather(socket.gethostname(), "hosts"))) == 1:
        return (lambda: time.clock_gettime_ns(time.CLOCK_MONOTONIC)), "CLOCK_MONOTONIC"
    return time.time_ns, "CLOCK_REALTIME (processes on several hosts)"


@contextlib.contextmanager
def environment(changes):
    """os.environ with `changes` ({name: value, None: unset}) applied inside, restored after."""
    old = {k: os.environ.get(k) for k in changes}

    def put(values):
        for k, v in values.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    put(changes)
    try:
        yield
    finally:
        put(old)


class CallRecorder:
    """Records every call of halves.bench_one's halves (warm-up and timed), as its `hooks`: a
    snapshot of comm.proxy_stats() before each call's barrier (= after the previous call) and
    `clock` after it (= just before the call). names[k], stamps[k] (ns) and snaps[k] belong to call
    k; close() takes one more snapshot (after the last call). With a `sched` reader
    (benchlib/sched.py), also the threads' scheduler statistics right before each call (sched_in[k],
    read before its clock) and right after it (sched_out[k + 1], read after the clock): call k's run
    and run-queue times are sched_out[k + 1] - sched_in[k]. `pause_s`: every process sleeps this
    long before each call's barrier (a serving loop's idle gaps: the proxy's idle back-off)."""

    def __init__(self, comm, clock, sched=None, pause_s=0.0):
        self.comm, self.clock, self.sched, self.pause_s = comm, clock, sched, pause_s
        self.names, self.stamps, self.snaps, self.pre = [], [], [], []
        self.sched_in, self.sched_out = [], []

    def before_barrier(self, name):
        self.pre.append(self.clock())  # pre[k + 1] - stamps[k]: call k's wall (its end, as seen from here)
        if self.sched:
            self.sched_out.append(self.sched.snapshot())
        self.snaps.append(self.comm.proxy_stats())
        if self.pause_s:
            time.sleep(self.pause_s)

    def after_barrier(self, name):
        if self.sched:
            self.sched_in.append(self.sched.snapshot())
        self.stamps.append(self.clock())
        self.names.append(name)

    def close(self):
        self.pre.append(self.clock())
        if self.sched:
            self.sched_out.append(self.sched.snapshot())
        self.snaps.append(self.comm.proxy_stats())

    def sched_deltas(self):
        """[calls] of {group: (run µs, run-queue wait µs)} (benchlib/sched.py), or None without a
        reader or where Linux gives no schedstat."""
        if not self.sched or not self.sched.available or len(self.sched_out) != len(self.names) + 1:
            return None
        return [self.sched.delta(self.sched_in[k], self.sched_out[k + 1]) for k in range(len(self.names))]


class LandedWaiter:
    """halves.time_turns' `landed` hook for the proxy path: landed(kind) returns once every local
    rank's proxy raised the landed flag of one more `kind` ("dispatch" / "combine") than at the
    previous call (proxy_stats' dispatches_landed / combines_landed, counted from construction),
    and for "combine" also sent the FREE of the dispatch before it (the next dispatch_send waits for
    it). Raises after timeout_s."""

    def __init__(self, comm, timeout_s=60.0):
        self.comm, self.timeout_s = comm, timeout_s
        # The steps before ours finished their receive halves; their FREE counters may still lag.
        self.base = self._until(lambda s: all(v["dispatches"] == v["dispatches_landed"] and
                                              v["combines"] == v["combines_landed"] for v in s.values()),
                                "its earlier steps finished")
        self.calls = {"dispatch": 0, "combine": 0}

    def _until(self, done, what):
        deadline = time.monotonic() + self.timeout_s
        while True:
            now = self.comm.proxy_stats()
            if done(now):
                return now
            if time.monotonic() > deadline:
                raise TimeoutError(f"benchmarks/proxy.py: the proxy did not report {what} within {self.timeout_s} s "
                                   f"(counters {now})")
            time.sleep(20e-6)

    def __call__(self, kind):
        self.calls[kind] += 1
        want = {{"dispatch": "dispatches_landed", "combine": "combines_landed"}[kind]: self.calls[kind]}
        if kind == "combine":
            want["dispatches"] = self.calls["dispatch"]
        self._until(lambda now: all(now[r][k] - self.base[r][k] >= n for r in now for k, n in want.items()),
                    f"{want} more than at start {self.base}")


def part_samples(calls, iters):
    """{part: {"transfer_us": [iters], "skew_us": [iters]}} for every part of pb.PARTS (collective):
    transfer max over ranks and processes, skew max - min of the entry stamps over processes."""
    from benchlib import timing
    out = {}
    for i, (part, (names, key, _)) in enumerate(pb.PARTS.items()):
        mine = pb.per_iteration(calls.names, pb.counter_deltas(calls.snaps, key) / 1e3, names, iters)
        transfer = np.max(np.asarray(timing.gather(mine.tolist(), f"transfer{i}"), np.float64), axis=0)
        stamps = pb.per_iteration(calls.names, calls.stamps, names, iters, how="first")
        skew = pb.skew_us(np.asarray(timing.gather([int(s) for s in stamps], f"stamps{i}"), np.int64))
        out[part] = {"transfer_us": transfer.tolist(), "skew_us": skew.tolist()}
    return out


def packer_samples(calls, iters):
    """{group: {"wall_us": [iters], part: [iters] for pb.PACKER_PARTS}} for every group of
    pb.PACKER_GROUPS whose counters moved (the host backend's proxied mode; collective): per
    iteration the wall of the group's calls (host clock from just before the first to just after
    the last, less the barrier between split halves) and the packer's parts on the rank whose
    calls took longest, of the process whose wall was longest."""
    from benchlib import timing
    walls = [(calls.pre[k + 1] - calls.stamps[k]) / 1e3 for k in range(len(calls.names))]
    sched = calls.sched_deltas()
    out = {}
    for i, (group, (names, send, recv)) in enumerate(pb.PACKER_GROUPS.items()):
        per_call = [pb.packer_deltas(calls.snaps[k], calls.snaps[k + 1], send, recv) if calls.names[k] in names
                    else None for k in range(len(calls.names))]
        ok = all(p is not None for k, p in enumerate(per_call) if calls.names[k] in names)
        mine = {"wall_us": pb.per_iteration(calls.names, walls, names, iters)}
        for part in pb.PACKER_PARTS:
            vals = [p[part] if p else 0.0 for p in per_call]
            mine[part] = pb.per_iteration(calls.names, vals, names, iters)
        table = np.asarray(timing.gather([[float(v) for v in mine[k]] for k in ["wall_us", *pb.PACKER_PARTS]],
                                         f"packer{i}"), np.float64)  # [processes, 1 + parts, iters]
        oks = timing.gather(bool(ok), f"packer-ok{i}")
        # The threads' run-queue waits during the group's calls; per iteration the most any process saw.
        runq = {k: pb.per_iteration(calls.names, [d[g][1] if d and g in d else 0.0 for d in sched], names, iters)
                for g, k in pb.SCHED_PARTS.items()} if sched else {}
        runq_all = timing.gather({k: [float(v) for v in a] for k, a in runq.items()}, f"packer-runq{i}")
        if not all(oks):
            continue
        worst = np.argmax(table[:, 0, :], axis=0)  # per iteration, the slowest process
        cols = np.arange(table.shape[2])
        out[group] = {k: table[worst, j, cols].tolist() for j, k in enumerate(["wall_us", *pb.PACKER_PARTS])}
        if all(runq_all):
            for k in pb.SCHED_PARTS.values():
                out[group][k] = np.max(np.asarray([r[k] for r in runq_all], np.float64), axis=0).tolist()
    return out


# ---- bytes and the engine's figures -----------------------------------------------------------

def routed_rows(spec, n, seed):
    """[N, N] rows[s, d] that bench_one's inputs (same seed) route from rank s to rank d (tp_size 1)."""
    from jax_moe_a2a import oracle, testing
    inputs = testing.make_inputs(spec, n, seed, num_tokens=spec.max_tokens_per_rank)
    L = spec.local_experts(n)
    return pb.rows_between([np.asarray(i.topk_ids)[oracle.routed_pairs(spec, i)[0]] // L for i in inputs], n)


def wire_bytes(spec, n, seed, node_size):
    """{"dispatch", "combine"}: pb.half_bytes of each half plus the row size it moves."""
    rows, remote = routed_rows(spec, n, seed), pb.remote_pairs(n, node_size)
    d_row = pb.dispatch_row_bytes(spec.token_bytes())
    c_row = spec.hidden * np.dtype(spec.combine_dtype).itemsize
    return {"dispatch": {**pb.half_bytes(rows, remote, d_row), "row": d_row, "matrix": rows.tolist(),
                         "remote": remote.tolist()},
            "combine": {**pb.half_bytes(rows.T, remote.T, c_row), "row": c_row, "matrix": rows.T.tolist(),
                        "remote": remote.T.tolist()}}


def measure_engine(jax, provider, args, extra_sizes=()):
    """The engine benchmark's latency and bandwidth loops (benchmarks/engine.py, bench_provider) for
    `provider` between these processes (collective). Returns (its result on process 0, else None;
    why there is none)."""
    if args.no_engine:
        return None, "--no-engine"
    if jax.process_count() < 2:
        return None, "the engine benchmark needs 2 processes"
    import engine
    from jax_moe_a2a.runtime import kv_client
    opts = argparse.Namespace(iface=None, num_domains=1, iters=args.engine_iters, blocks=20, baseline=True,
                              baseline_max=64 * engine.KIB, stream_mib=args.engine_stream_mib, timeout=60.0,
                              only="latency,bandwidth", extra_sizes=list(extra_sizes))
    try:
        res = engine.bench_provider(provider, opts, jax.process_index(), jax.process_count(), kv_client(),
                                    "proxybench")
        return res, "" if res or jax.process_index() else "no result"
    except Exception as e:  # report it and go on: the rest of the breakdown stands without wire time
        return None, f"{type(e).__name__}: {e}"


def wire_parts(nbytes, engine_result):
    """{part: (engine figures, wire µs or None)} for every part of pb.PARTS."""
    out = {}
    for part in pb.PARTS:
        b = nbytes[part.split(" ")[0]]
        fig = pb.engine_figures(engine_result, b["row"], b["block"]) if engine_result else None
        ok = fig and fig["latency_us"] is not None and fig["bandwidth_MBps"]
        out[part] = (fig, pb.wire_us(b["bytes"], fig["latency_us"], fig["bandwidth_MBps"]) if ok else None)
    return out


# ---- one mode ---------------------------------------------------------------------------------

def framework_floor(jax, comm, glob, iters, warmup=3):
    """JAX's per-call floor in these processes, µs: p50 (each iteration the slowest process, each
    call after a barrier, as the ops are timed) of a jitted shard_map over the dispatch's operands
    `glob` that returns one element per rank and calls no FFI target. The part of the breakdown's
    `rest` that any jitted call of these operands pays, so not the library's."""
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from benchlib import timing
    from jax_moe_a2a import testing

    fn = jax.jit(testing.shard_map(lambda *a: a[0].reshape(-1)[:1].astype(jnp.float32), mesh=comm.mesh,
                                   in_specs=(P(comm.axis),) * len(glob), out_specs=P(comm.axis)))
    samples = []
    for i in range(warmup + iters):
        timing.barrier("floor")
        _, t = timing.time_once(fn, *glob)
        if i >= warmup:
            samples.append(t)
    return timing.summarize(timing.max_over_processes(samples, "floor"))["p50_us"]


def run_mode(jax, spec, mesh, args, clock, mode, timeline=None):
    """Creates the communicator under the mode's environment, runs halves.bench_one recording its
    calls, and returns the record with "samples" (per part, per iteration; collective). timeline: a
    path prefix for the proxies' step timelines (JAX_MOE_A2A_PROXY_TIMELINE); process 0 reads every
    process's files after the communicator closed and adds their parts as "timeline"."""
    import jax_moe_a2a as a2a
    from benchlib import Progress, timing
    from halves import bench_inputs, bench_one, jitted_halves, time_turns

    opts = {"proxied": True} if args.backend == "host" else {}
    if args.backend == "host":
        from jax_moe_a2a import env
        opts["node_size"] = env.get_int("NODE_SIZE", 0)
    changes = dict(pb.PROXY_MODES[mode], **({"JAX_MOE_A2A_PROXY_TIMELINE": timeline} if timeline else {}))
    with environment(changes):
        comm = a2a.init(spec, mesh, "ep", backend=args.backend, collect_stats=False, **opts)
    try:
        before = comm.proxy_stats()
        if not before:  # the same on every process: all leave here
            raise SystemExit(f"benchmarks/proxy.py: no proxy thread (node_size {comm.diagnostics().get('node_size')} "
                             f"of {comm.num_ranks} ranks): set JAX_MOE_A2A_NODE_SIZE below the number of ranks")
        from benchlib.sched import SchedReader
        calls = CallRecorder(comm, clock, SchedReader(), args.pause_ms / 1e3)
        rec = bench_one(jax, comm, args.shape, argparse.Namespace(seed=args.seed, no_check=False, x_dtype="f32"),
                        args.iters, args.warmup, Progress(1 + args.iters + args.warmup, False), hooks=calls)
        calls.close()
        # The timed iterations' first call (each iteration makes every call form once; the check and
        # warm-up come before): the timeline keeps the steps from there (one clock on one machine).
        per_iter = len(set(calls.names))
        timed_from = calls.stamps[max(0, len(calls.stamps) - args.iters * per_iter)] if calls.stamps else None
        after = comm.proxy_stats()
        diag = comm.diagnostics()
        rec.update(proxy_mode=mode, proxy_env=pb.PROXY_MODES[mode], node_size=diag.get("node_size"),
                   provider=diag.get("provider"), num_ranks=comm.num_ranks, spec_text=comm.spec.describe())
        rec["proxy_threads"] = {str(r): {k: s.get(k) for k in ("cpu", "flag_path", "row_path")} for r, s in after.items()}
        # Mean over every dispatch / combine of the run (check and warm-up included), as before.
        per = {}
        for key, count in (("counts_to_landed_ns", "dispatches"), ("comb_to_landed_ns", "combines")):
            vals = [(after[r][key] - before[r][key]) / max(1, after[r][count] - before[r][count]) for r in after]
            per[key] = float(np.max(timing.max_over_processes([max(vals) if vals else 0.0], "proxy" + key)))
        rec["proxy"] = {"counts_to_landed_us": per["counts_to_landed_ns"] / 1e3,
                        "comb_to_landed_us": per["comb_to_landed_ns"] / 1e3}
        # JAX_MOE_A2A_STAGING=copy: the row copies of one dispatch + combine (four copies, summed),
        # their time from start to the proxy's poll that saw them done; the slowest rank.
        steps = [max(1, after[r]["dispatches"] - before[r]["dispatches"]) for r in after]
        copy_us = [(after[r].get("staging_ns", 0) - before[r].get("staging_ns", 0)) / n / 1e3 for r, n in zip(after, steps)]
        copy_mb = [(after[r].get("staged_bytes", 0) - before[r].get("staged_bytes", 0)) / n / 1e6 for r, n in zip(after, steps)]
        rec["proxy"]["row_copies_us"] = float(np.max(timing.max_over_processes([max(copy_us)], "proxy row copies")))
        rec["proxy"]["row_copies_mb"] = float(np.max(timing.max_over_processes([max(copy_mb)], "proxy row copy MB")))
        rec["samples"] = part_samples(calls, args.iters)
        rec["packer_samples"] = packer_samples(calls, args.iters)
        # Per dispatch, the busiest rank: PRIV writes posted before the whole pack, the proxy's idle
        # sleeps, and those a packer's flag cut short (Proxy::wake).
        for key in ("priv_early", "sleeps", "woken"):
            rec["proxy"][f"{key}_per_dispatch"] = float(np.max(timing.max_over_processes(
                [max((after[r].get(key, 0) - before[r].get(key, 0)) / n for r, n in zip(after, steps))],
                f"proxy {key}")))
        rec["proxy"]["pipeline"] = [bool(after[r].get("pipeline")) for r in after]
        rec["kernel_turns_why_none"] = turns_refused(args, rec)
        glob, fns = jitted_halves(jax, comm, *bench_inputs(comm, argparse.Namespace(seed=args.seed, x_dtype="f32")))
        rec["framework_floor_us"] = framework_floor(jax, comm, glob, args.iters)
        if rec["kernel_turns_why_none"] is None:
            rec["kernel_turns"] = time_turns(jax, comm, glob, fns, args.iters, args.warmup, LandedWaiter(comm))
    finally:
        comm.close()
    if timeline:
        from benchlib import proxy_timeline
        timing.barrier("timeline")  # every proxy stopped and wrote its file
        if jax.process_index() == 0:  # the calls' stamps and the marks: one CLOCK_MONOTONIC (halves())
            rec["timeline"] = proxy_timeline.summarize(proxy_timeline.read(timeline), timed_from)
    return rec


def turns_refused(args, rec):
    """Why the kernels-alone loop does not run for this mode (None: it runs)."""
    if args.no_turns:
        return "--no-turns"
    if not rec.get("kernel_timings"):
        return "no kernel times (cuda with JAX_MOE_A2A_KERNEL_TIMING=1 and command buffers off)"
    if (rec.get("node_size") or 0) != 1 and os.environ.get("JAX_MOE_A2A_KERNEL_TIMING") != "nosync":
        return ("node-local peers: their GPU-side timing barrier would wait for a process that waits its turn "
                "(JAX_MOE_A2A_KERNEL_TIMING=nosync)")
    return None


def nvlink_turns(path):
    """{half: p50 µs} of the (turns) row of halves.json at `path` (its first cuda result with one)."""
    with open(path) as f:
        out = json.load(f)
    for r in out["results"]:
        if r.get("backend") == "cuda" and "kernel_turns" in r:
            return {h: v["p50_us"] for h, v in r["kernel_turns"].items()}
    raise SystemExit(f"--nvlink-json {path}: no cuda result with a (turns) row (run halves.py --turns)")


def add_packer_breakdown(rec, nbytes, engine_result, raw_ex=None):
    """rec["packer_breakdown"] = {group: pb.packer_breakdown(...)} (host backend's proxied mode), the
    raw wire of each group the raw fi_writedata half round trip at its per-peer message size, and
    rest_less_floor_us: its rest less JAX's call floor (framework_floor) per jitted call; with the
    raw exchange of the op's bytes (raw_exchange_of) also raw_exchange_us and ratio_exchange =
    wall / (raw exchange + pack + unpack) per iteration, p50."""
    rec["packer_breakdown"] = {}
    for group, smp in rec.get("packer_samples", {}).items():
        op = group.split(" ")[0]
        b = nbytes[op]
        raw = pb.raw_at(engine_result, message_size(b)) if b["peers"] else 0.0
        part = {"dispatch (halves)": "dispatch", "combine (halves)": "combine"}.get(group, group)
        skew = rec["samples"][part]["skew_us"] if part in rec.get("samples", {}) else None
        b = rec["packer_breakdown"][group] = pb.packer_breakdown(smp["wall_us"], smp, raw, skew)
        if raw_ex and op in raw_ex:
            rx = raw_ex[op]["p50_us"]
            w, pk, up = (np.asarray(smp[k], np.float64) for k in ("wall_us", "pack", "unpack"))
            b["raw_exchange_us"] = rx
            b["ratio_exchange"] = float(np.median(w / (rx + pk + up))) if w.size else None
        if rec.get("framework_floor_us") is not None:  # the split op's two jitted calls pay it twice
            b["rest_less_floor_us"] = b["rest_us"] - (2 if "halves" in group else 1) * rec["framework_floor_us"]


def raw_exchange_of(jax, nbytes, args):
    """The raw exchange (benchlib/raw_exchange.py) of each op's bytes as this benchmark routes them:
    rank r writes rank d rows[r, d] rows (remote pairs, not itself). Collective; one rank per process
    (mpirun), else None, as with --no-engine."""
    if args.no_engine or jax.process_count() < 2 or jax.local_device_count() != 1:
        return None
    r = jax.process_index()
    sizes = {op: [int(rows) * nbytes[op]["row"] if (rem and d != r) else 0
                  for d, (rows, rem) in enumerate(zip(nbytes[op]["matrix"][r], nbytes[op]["remote"][r]))]
             for op in ("dispatch", "combine")}
    try:
        return raw_exchange.measure({r: sizes}, iters=10, blocks=7)
    except Exception as e:  # report it and go on, as the engine benchmark does
        print(f"raw exchange failed on process {r}: {type(e).__name__}: {e}", flush=True)
        return None


def message_size(b):
    """The bytes of one peer's write in a half (its block, whole rows, at least 8)."""
    return max(8, int(round(b["block"] / b["row"])) * b["row"]) if b["row"] else 8


def add_breakdown(rec, wires):
    """rec["breakdown"] = {part: pb.breakdown(...)} from the samples, kernel p50s and wire times."""
    k = rec.get("kernel_timings")
    rec["breakdown"] = {}
    for part, (_, _, halves) in pb.PARTS.items():
        kernels = None
        if k and halves:
            kernels = {lab: k[h]["p50_us"] for lab, h in zip(pb.KERNEL_LABELS[part], halves)}
        s = rec["samples"][part]
        rec["breakdown"][part] = pb.breakdown(s["transfer_us"], s["skew_us"], wires[part][1], kernels)


def print_mode(rec, nbytes, wires, nvlink=None):
    t, k = rec["timings"], rec.get("kernel_timings")
    env = ", ".join(f"{n}={'unset' if v is None else v}" for n, v in rec["proxy_env"].items())
    what = "cuda inter-node path" if rec["backend"] == "cuda" else f"{rec['backend']} backend, proxied"
    print(f"\n{what}, proxy mode {rec['proxy_mode']} ({env}): {rec['num_ranks']} ranks, node_size "
          f"{rec['node_size']}, provider {rec['provider']}, {rec['spec_text']}, check {rec['check']}")
    for h in ("dispatch_send", "dispatch_recv", "combine_send", "combine_recv", "dispatch", "combine"):
        kt = f"   kernel p50 {k[h]['p50_us']:8.1f} µs" if k and h in k else ""
        print(f"  {h:<14} wall p50 {t[h]['p50_us']:8.1f} µs  p99 {t[h]['p99_us']:8.1f} µs{kt}")
    if not k:
        print("  (set JAX_MOE_A2A_KERNEL_TIMING=1 and disable command buffers for the kernel times)")
    kt = rec.get("kernel_turns")
    if kt:
        print("  kernels alone (processes taking turns, rows landed before each receive), p50 / p99 µs:")
        for h, v in kt.items():
            ratio = f"   {v['p50_us'] / nvlink[h]:5.2f}x the NVLink path's {nvlink[h]:.1f}" if nvlink and nvlink.get(h) else ""
            print(f"    {h:<14} {v['p50_us']:8.1f} / {v['p99_us']:8.1f}{ratio}")
    elif rec.get("kernel_turns_why_none"):
        print(f"  kernels alone: not run ({rec['kernel_turns_why_none']})")
    for part, b in rec["breakdown"].items():
        for line in pb.format_half(part, b, nbytes[part.split(" ")[0]], wires[part][0]):
            print(line)
    if "timeline" in rec:  # --timeline: the timed iterations' steps (both call forms)
        from benchlib import proxy_timeline
        print("  proxy step timeline (the timed iterations):")
        for line in proxy_timeline.describe(rec["timeline"], rec.get("timeline_raw_wire_us")):
            print(line)
    floor = rec.get("framework_floor_us")
    if floor is not None:
        print(f"  JAX's call floor: {floor:.1f} µs per jitted call (a shard_map of the dispatch's operands returning one "
              f"element per rank, no FFI call, timed as the ops are); a split op pays it twice")
    for group, b in rec.get("packer_breakdown", {}).items():
        nb = nbytes[group.split(" ")[0]]
        for line in pb.format_packer(group, b, message_size(nb), nb["peers"]):
            print(line)
        if b.get("ratio_exchange") is not None:
            print(f"    against the raw exchange of the same bytes ({b['raw_exchange_us']:.1f} µs, every rank writing "
                  f"every peer at once): wall / (raw exchange + pack + unpack) = {b['ratio_exchange']:.2f}x")
    if "priv_early_per_dispatch" in rec["proxy"]:
        print(f"  pipeline {rec['proxy']['pipeline']}: PRIV writes posted before the whole pack, per dispatch "
              f"(busiest rank): {rec['proxy']['priv_early_per_dispatch']:.2f}")
    if "woken_per_dispatch" in rec["proxy"]:
        print(f"  proxy idle sleeps per dispatch + combine (busiest rank): {rec['proxy']['sleeps_per_dispatch']:.1f}, "
              f"of which a packer's flag cut short: {rec['proxy']['woken_per_dispatch']:.2f}")
    if rec["proxy"].get("row_copies_mb"):
        print(f"  row copies per dispatch + combine (slowest rank): {rec['proxy']['row_copies_mb']:.2f} MB in "
              f"{rec['proxy']['row_copies_us']:.1f} µs (start to the proxy's poll that saw them done)")
    print(f"  proxy threads (rank: pinned CPU, flag path, rows): "
          + ", ".join(f"{r}: {th['cpu']}, {th['flag_path']}, {th['row_path']}" for r, th in rec["proxy_threads"].items()),
          flush=True)


def halves(args):
    import benchlib
    from benchlib import shapes
    jax = benchlib.setup_runtime()
    from jax_moe_a2a import env, testing

    table = shapes.pick(jax.default_backend(), False)
    overrides = {k: v for k, v in (("max_tokens_per_rank", args.tokens), ("hidden", args.hidden)) if v}
    spec = table[args.shape].spec(**overrides)
    mesh = testing.make_mesh()
    lead = jax.process_index() == 0
    clock, clock_name = host_clock()
    provider = env.get_str("PROVIDER", "shm")
    # The message sizes the engine issues in these halves: each half's per-peer block and the count
    # matrix; the engine benchmark times them (and raw fi_writedata) exactly.
    node_size = env.get_int("NODE_SIZE", 0 if args.backend == "host" else jax.device_count())
    pre_bytes = wire_bytes(spec, jax.device_count(), args.seed, node_size)
    extra = [message_size(b) for b in pre_bytes.values() if b["peers"]]
    extra.append(4 * jax.device_count() * spec.local_experts(jax.device_count()))
    engine_result, why = measure_engine(jax, provider, args, extra)
    raw_ex = raw_exchange_of(jax, pre_bytes, args)
    out = {"meta": benchlib.run_meta(jax, iters=args.iters, warmup=args.warmup, backend=args.backend,
                                     kernel_timing=os.environ.get("JAX_MOE_A2A_KERNEL_TIMING", "0")),
           "clock": clock_name, "engine": {"provider": provider, "result": engine_result, "why_none": why},
           "raw_exchange": raw_ex, "modes": {}}
    if lead:
        print(f"proxy path breakdown: modes {args.modes}, {args.iters} timed + {args.warmup} warm-up iterations, "
              f"skew from {clock_name}", flush=True)
        print("\n".join(pb.format_engine(engine_result, why)), flush=True)
        print(raw_exchange.describe(raw_ex), flush=True)
    nbytes = wires = None
    nvlink = nvlink_turns(args.nvlink_json) if args.nvlink_json else None
    if nvlink:
        out["nvlink_turns_p50_us"] = nvlink
    # The timelines are files of every process, read by process 0, and their marks compared with the
    # calls' stamps: one machine (one CLOCK_MONOTONIC) only.
    timeline_on = bool(args.timeline) and clock_name == "CLOCK_MONOTONIC"
    if args.timeline and not timeline_on and lead:
        print(f"--timeline: not recorded (processes on several hosts: {clock_name})", flush=True)
    transfers = {m: [] for m in args.modes}  # mode -> each round's {part: transfer p50}
    for rnd, mode in ((r, m) for r in range(args.rounds) for m in args.modes):
        tl = os.path.join(os.path.abspath(args.timeline), f"{mode}.round{rnd + 1}") if timeline_on else None
        if tl and lead:
            os.makedirs(args.timeline, exist_ok=True)
        rec = run_mode(jax, spec, mesh, args, clock, mode, tl)
        if nbytes is None:  # routing and placement are the same in every mode
            nbytes = wire_bytes(spec, rec["num_ranks"], args.seed, rec["node_size"] or 0)
            wires = wire_parts(nbytes, engine_result)
            out["wire_bytes"] = nbytes
            out["engine"]["figures"] = {p: fig for p, (fig, _) in wires.items()}
        add_breakdown(rec, wires)
        add_packer_breakdown(rec, nbytes, engine_result, raw_ex)
        if "timeline" in rec:  # the rows' part against one raw write of one peer's message
            rec["timeline_raw_wire_us"] = {op: pb.raw_at(engine_result, message_size(nbytes[op]))
                                           for op in ("dispatch", "combine") if nbytes[op]["peers"]}
        out["modes"][mode if args.rounds == 1 else f"{mode} (round {rnd + 1})"] = rec
        transfers[mode].append({p: b["transfer_us"] for p, b in rec["breakdown"].items()})
        if lead:
            if args.rounds > 1:
                print(f"\n-- round {rnd + 1} of {args.rounds}", flush=True)
            print_mode(rec, nbytes, wires, nvlink)
    out["idle_policy"] = pb.idle_policy({m: pb.median_parts(rounds) for m, rounds in transfers.items()})
    if lead:
        print()
        for line in pb.format_idle(out["idle_policy"], args.modes):
            print(line)
    if jax.process_count() > 1:
        jax.distributed.shutdown()
    return out


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    rec = {"signal": signal(args.signal_iters)} if args.signal else halves(args)
    if args.json and int(os.environ.get("OMPI_COMM_WORLD_RANK", "0")) == 0:
        with open(args.json, "w") as f:
            json.dump(rec, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
