"""Dispatch/combine halves benchmark of a DeepSeek-V3-shaped MoE layer.

    python benchmarks/halves.py [--backend cuda,reference] [--shape decode] [--quick]
    mpirun -n 2 python benchmarks/halves.py --backend cuda --shape decode --anchor-json DIR

Checks every backend against the NumPy oracle first (the `check` column), then times each half
as one jitted call from Python to block_until_ready with a barrier (the jax.distributed key-value
store) before it: p50/p99 over iterations, max over processes. With JAX_MOE_A2A_KERNEL_TIMING=1
(and XLA command buffers off) the cuda and nvshmem backends also report CUDA-event times of each
half's kernel alone, each launch behind a GPU-side barrier of the EP group as in pplx-kernels'
benchmark (`nosync`: without it). --turns adds (turns) rows: the same kernel times with the
processes taking turns, one kernel on the GPU at a time (time_turns). --anchor-json DIR adds
pplx-kernels' times at the same shape (DIR/pplx_N.json of the anchor kit, N = the number of
processes: intra-sync kernels next to cuda, inter next to nvshmem) with ours/pplx ratios. Writes halves.json (and halves.png unless --no-plot) into --out.
`python benchmarks/halves.py --report A/halves.json B/halves.json` prints several runs as one table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

import benchlib
from benchlib import HALVES, Progress, anchor, report, shapes


def add_common_args(p, what="half"):
    p.add_argument("--backend", default="", help="comma-separated backends (default: every available one)")
    p.add_argument("--shape", default="decode,prefill", help="comma-separated: decode, prefill")
    p.add_argument("--quick", action="store_true", help="tiny shapes and few iterations (smoke run)")
    p.add_argument("--ranks", type=int, default=None, help="EP ranks (default: all global devices)")
    p.add_argument("--tokens", type=int, default=None, help="override T for every shape")
    p.add_argument("--hidden", type=int, default=None, help="override H for every shape")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench-out", help="directory for the JSON results and PNG plots")
    p.add_argument("--no-plot", action="store_true", help="no PNG")
    p.add_argument("--cpu-devices", type=int, default=None,
                   help="CPU devices per process (default 8 in one process, 1 under mpirun)")
    p.add_argument("--min-time", type=float, default=None,
                   help="after the minimum iterations/repeats, go on until they took this many seconds (up to 10x "
                        "the minimum) per backend and shape: default 2 on CPUs, 0 on GPUs and with --quick")
    p.add_argument("--progress-label", default="", help=argparse.SUPPRESS)


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python benchmarks/halves.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    p.add_argument("--iters", type=int, default=None,
                   help="timed iterations per half, at least (default 50 on GPUs, 10 on CPUs, 1 with --quick; "
                        "see --min-time)")
    p.add_argument("--warmup", type=int, default=None, help="untimed iterations first (default 5 on GPUs, else 1)")
    p.add_argument("--no-check", action="store_true", help="skip the oracle check")
    p.add_argument("--sequential", action="store_true",
                   help="on CPUs too, time one backend after the other (default there: their iterations in turns, "
                        "so that they share the machine's load)")
    p.add_argument("--x-dtype", default="f32", choices=("f32", "bf16", "fp8"),
                   help="dtype of dispatch_send's x: f32 / bf16 (fp8 dispatch quantises in the send half), or fp8 "
                        "pre-quantised with its f32 scales (the send half copies: what pplx-kernels' dispatch takes)")
    p.add_argument("--recv-dtype", default=None, choices=("bf16", "f16", "f32"),
                   help="Spec.recv_dtype: fp8 on the wire, the rows dequantised to this dtype on receive")
    p.add_argument("--turns", action="store_true",
                   help="also time each half's kernel with the GPU to itself: the processes take turns (a (turns) "
                        "row; sets JAX_MOE_A2A_KERNEL_TIMING=nosync, so the (kernel) row has no GPU-side barrier)")
    p.add_argument("--json-out", default=None, help=argparse.SUPPRESS)  # child processes: results only
    p.add_argument("--anchor-json", default=os.environ.get("JAX_MOE_A2A_ANCHOR_JSON"),
                   help="folder with the pplx anchor kit's pplx_N.json (default $JAX_MOE_A2A_ANCHOR_JSON)")
    return p.parse_args(argv)


def bench_inputs(comm, args):
    """(inputs, prequantized): testing.make_inputs for every rank of `comm` with T =
    max_tokens_per_rank tokens, x in args.x_dtype (f32 / bf16; fp8: pre-quantised with its
    scales when the spec dispatches fp8), routing from args.seed."""
    import jax.numpy as jnp
    import numpy as np

    from jax_moe_a2a import testing

    spec = comm.spec
    prequantized = args.x_dtype == "fp8" and spec.is_fp8
    inputs = testing.make_inputs(spec, comm.num_ranks, args.seed, num_tokens=spec.max_tokens_per_rank,
                                 input_dtype=np.float32 if args.x_dtype == "f32" else jnp.bfloat16,
                                 prequantized=prequantized)
    return inputs, prequantized


def jitted_halves(jax, comm, inputs, prequantized):
    """(glob, fns): the benchmark's global arrays (x [N*T, H], topk_ids / topk_weights [N*T, K],
    num_tokens [N], and x_scale when prequantized), and one jitted shard_map call per step, keyed
    dispatch_send (glob -> handle), dispatch_recv (handle -> received), experts (received -> y:
    testing.expert_fn_jax in bf16), combine_send (y, received -> handle), combine_recv (handle ->
    out), dispatch (glob -> received) and combine (y, received -> out). Each call holds one op,
    so processes may run them at different times (no XLA collective)."""
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from jax_moe_a2a import testing

    spec, mesh, n, axis = comm.spec, comm.mesh, comm.num_ranks, comm.axis
    glob = testing.global_args(mesh, inputs, testing.INPUT_FIELDS + (("x_scale",) if prequantized else ()), axis)
    add = lambda t: jax.tree.map(lambda a: a[None], t)   # per-rank leaf -> [1, ...] for out_specs
    rm = lambda t: jax.tree.map(lambda a: a[0], t)

    def sm(fn, nin):
        return jax.jit(testing.shard_map(fn, mesh=mesh, in_specs=(P(axis),) * nin, out_specs=P(axis)))

    return glob, {
        "dispatch_send": sm(lambda x, i, w, k, *xs: add(comm.dispatch_send(x, i, w, k, x_scale=xs[0] if xs else None)),
                            len(glob)),
        "dispatch_recv": sm(lambda h: add(comm.dispatch_recv(rm(h))), 1),
        "experts": sm(lambda g: add(testing.expert_fn_jax(spec, n, rm(g), jnp.bfloat16)), 1),
        "combine_send": sm(lambda y, g: add(comm.combine_send(rm(y), rm(g))), 2),
        "combine_recv": sm(lambda h: add(comm.combine_recv(rm(h))), 1),
        "dispatch": sm(lambda x, i, w, k, *xs: add(comm.dispatch(x, i, w, k, x_scale=xs[0] if xs else None)), len(glob)),
        "combine": sm(lambda y, g: add(comm.combine(rm(y), rm(g))), 2),
    }


def time_turns(jax, comm, glob, fns, iters, warmup, landed=None):
    """Each half's kernel with the GPU to itself: {half: timing.summarize} of comm.kernel_seconds
    (the four halves; max over processes), or None when the backend has no kernel timing.

    The processes take turns: for each half, process 0 runs its call to completion while the others
    wait at a key-value-store barrier, then process 1, and so on; so no other process's kernel
    shares the GPU with the one timed (processes that time-slice one GPU otherwise time each
    other's work too). `landed(kind)` (kind "dispatch" / "combine"), when given, is called by every
    process before the receive half's turns and returns once that op's data landed for every local
    rank (the proxy path: the rows arrive after the send kernel, by the proxy thread); without it the
    send turns suffice (peers' kernels wrote the rows). The communicator must not put a GPU-side
    barrier before its launches (JAX_MOE_A2A_KERNEL_TIMING=nosync, or no node-local peers)."""
    from benchlib import timing

    me = jax.process_index()
    kernel = {h: [] for h in HALVES[:4]}

    def turns(name, *fn_args):
        out, sec = None, None
        for p in range(jax.process_count()):
            timing.barrier(f"turn {name} {p}")
            if p == me:
                out = timing.block(fns[name](*fn_args))
                sec = comm.kernel_seconds(name)
        timing.barrier(f"turn {name} end")
        return out, sec

    for it in range(warmup + iters):
        h, k_ds = turns("dispatch_send", *glob)
        if landed is not None:
            landed("dispatch")
        got, k_dr = turns("dispatch_recv", h)
        y = timing.block(fns["experts"](got))
        ch, k_cs = turns("combine_send", y, got)
        if landed is not None:
            landed("combine")
        _, k_cr = turns("combine_recv", ch)
        if None in (k_ds, k_dr, k_cs, k_cr):
            return None
        if it >= warmup:
            for name, sec in zip(HALVES[:4], (k_ds, k_dr, k_cs, k_cr)):
                kernel[name].append(sec)
    return {name: timing.summarize(timing.max_over_processes(v, "turns " + name)) for name, v in kernel.items()}


class HalvesTimer:
    """One backend at one shape: checks `comm` against the oracle and jits its halves (__init__),
    then times one iteration of the six calls per `iteration()` (module docstring), and `finish()`
    gives the record. hooks: None, or an object whose before_barrier(name) and after_barrier(name)
    run around the barrier before every call of a half (warm-up and timed; benchmarks/proxy.py
    records its counters and a clock there)."""

    def __init__(self, jax, comm, shape_name, args, progress, units=1.0, hooks=None):
        import numpy as np

        from jax_moe_a2a import oracle, testing

        self.jax, self.comm, self.shape_name, self.args = jax, comm, shape_name, args
        self.progress, self.units, self.hooks = progress, units, hooks
        spec, n = comm.spec, comm.num_ranks
        inputs, prequantized = bench_inputs(comm, args)
        record = {"backend": comm.backend_name, "shape": shape_name, "ranks": n, "processes": jax.process_count(),
                  "x_dtype": "fp8 (pre-quantised)" if prequantized else ("f32" if args.x_dtype == "f32" else "bf16"),
                  "local_path": bool(comm.diagnostics().get("local_path")),
                  "spec": {"T": spec.max_tokens_per_rank, "H": spec.hidden, "E": spec.num_experts,
                           "K": spec.experts_per_token, "dispatch_dtype": str(spec.dispatch_dtype),
                           "combine_dtype": str(spec.combine_dtype), "layout": spec.layout,
                           "recv_dtype": None if spec.recv_dtype is None else str(spec.recv_dtype)},
                  "buffer_bytes_per_rank": comm.buffer_bytes(), "buffer_regions": comm.buffer_regions()}
        # bytes of payload each rank sends (one row per routed (token, expert) pair)
        rows = [int(oracle.routed_pairs(spec, i)[0].sum()) for i in inputs]
        record["dispatch_bytes_per_rank"] = float(np.mean(rows)) * spec.token_bytes()
        record["combine_bytes_per_rank"] = float(np.mean(rows)) * spec.hidden * 2

        if args.no_check:
            record["check"] = "skipped"
        else:
            try:
                testing.check_all(comm, inputs, testing.run_ops(comm, inputs))
                record["check"] = "ok"
            except AssertionError as e:
                lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
                record["check"] = "FAILED: " + " | ".join(lines[:8])[:600]
        progress.update(f"{comm.backend_name}/{shape_name} check", 2 * units)
        self.record = record
        self.glob, self.fns = jitted_halves(jax, comm, inputs, prequantized)
        self.samples = {h: [] for h in HALVES}
        # Kernel-only times (cuda backend with JAX_MOE_A2A_KERNEL_TIMING=1): CUDA events around
        # each half's kernel, free of Python dispatch and host synchronisation.
        self.kernel = {h: [] for h in HALVES[:4]}
        self.calls = 0   # iterations run, warm-up included

    def _timed_call(self, name, timed, fn, *fn_args):
        """A barrier, then fn(*fn_args) to completion; its wall time (and, for the four halves, its
        kernel time) into the samples when `timed`. Returns fn's result."""
        from benchlib import timing
        if self.hooks is not None:
            self.hooks.before_barrier(name)
        timing.barrier(name)
        if self.hooks is not None:
            self.hooks.after_barrier(name)
        out, t = timing.time_once(fn, *fn_args)
        if timed:
            self.samples[name].append(t)
            sec = self.comm.kernel_seconds(name) if name in self.kernel else None
            if sec is not None:
                self.kernel[name].append(sec)
        return out

    def timed_iterations(self) -> int:
        return len(self.samples["combine"])

    def wants_more(self, iters, min_time_s) -> bool:
        """At least `iters` timed iterations, then more until the timed calls took `min_time_s`
        seconds (up to 10 x iters)."""
        from benchlib import timing
        spent = sum(map(sum, self.samples.values()))
        return timing.keep_going(self.timed_iterations(), spent, iters, min_time_s, 10 * iters)

    def iteration(self, timed: bool, count_progress: bool = True):
        from benchlib import timing
        f, call = self.fns, self._timed_call
        h = call("dispatch_send", timed, f["dispatch_send"], *self.glob)
        got = call("dispatch_recv", timed, f["dispatch_recv"], h)
        y = timing.block(f["experts"](got))
        ch = call("combine_send", timed, f["combine_send"], y, got)
        call("combine_recv", timed, f["combine_recv"], ch)
        call("dispatch", timed, f["dispatch"], *self.glob)
        call("combine", timed, f["combine"], y, got)
        self.calls += 1
        if count_progress:
            self.progress.update(f"{self.comm.backend_name}/{self.shape_name} iter", self.units)

    def finish(self, iters, warmup) -> dict:
        from benchlib import timing
        record, samples, kernel = self.record, self.samples, self.kernel
        if getattr(self.args, "turns", False):
            turns = time_turns(self.jax, self.comm, self.glob, self.fns, iters, warmup)
            if turns is not None:
                record["kernel_turns"] = turns
        record["timings"] = {h: timing.summarize(timing.max_over_processes(v, h)) for h, v in samples.items()}
        if all(len(v) == self.timed_iterations() for v in kernel.values()):
            record["kernel_timings"] = {h: timing.summarize(timing.max_over_processes(v, "k" + h))
                                        for h, v in kernel.items()}
        for op in ("dispatch", "combine"):
            p50 = record["timings"][op]["p50_us"]
            record.setdefault("goodput_GBps", {})[op] = record[f"{op}_bytes_per_rank"] / (p50 * 1e3) if p50 else 0.0
            if "kernel_timings" in record:  # send + recv kernels of the op
                k = sum(record["kernel_timings"][f"{op}_{h}"]["p50_us"] for h in ("send", "recv"))
                record.setdefault("kernel_goodput_GBps", {})[op] = \
                    record[f"{op}_bytes_per_rank"] / (k * 1e3) if k else 0.0
        return record


def bench_one(jax, comm, shape_name, args, iters, warmup, progress, units=1.0, hooks=None):
    """One backend alone: HalvesTimer's check, `warmup` untimed iterations, then timed ones (at
    least `iters`; more until args.min_time_s seconds, if set); returns the record."""
    t = HalvesTimer(jax, comm, shape_name, args, progress, units, hooks)
    for _ in range(warmup):
        t.iteration(False)
    while t.wants_more(iters, getattr(args, "min_time_s", 0.0)):
        t.iteration(True, count_progress=t.timed_iterations() < iters)
    return t.finish(iters, warmup)


def bench_interleaved(timers, iters, warmup, min_time_s):
    """Several backends at one shape, timed in turns, so that they share the machine's load (on a
    busy CPU a backend timed after another can meet a different machine: their ratio moved 4x
    between runs). Each round gives every timer that wants more one iteration, and then more while
    its timed calls of this round took less than min_time_s / iters: a fast backend's many
    iterations spread over the rounds of a slow one's few. Returns the records."""
    for t in timers:
        for _ in range(warmup):
            t.iteration(False)
    slice_s = min_time_s / max(1, iters)
    spent = lambda t: sum(map(sum, t.samples.values()))
    while True:
        more = [t for t in timers if t.wants_more(iters, min_time_s)]
        if not more:
            break
        for t in more:
            start = spent(t)
            t.iteration(True, count_progress=t.timed_iterations() < iters)
            while spent(t) - start < slice_s and t.wants_more(iters, min_time_s):
                t.iteration(True, count_progress=t.timed_iterations() < iters)
    return [t.finish(iters, warmup) for t in timers]


def run(jax, args, progress_label=""):
    """Runs every requested backend and shape; returns {"meta", "results", "skipped", "anchor"}."""
    import jax_moe_a2a as a2a
    from jax_moe_a2a import testing

    lead = jax.process_index() == 0
    platform = jax.default_backend()
    table = shapes.pick(platform, args.quick)
    names = [s for s in args.shape.split(",") if s]
    for s in names:
        if s not in table:
            raise SystemExit(f"--shape: unknown shape {s!r} (known: {sorted(table)})")
    chosen = {s: shapes.with_overrides(table[s], args.tokens, args.hidden) for s in names}
    backends, skipped = benchlib.backend_plan(args.backend)
    gpu = platform not in ("cpu",)
    from benchlib import timing
    iters = args.iters or (1 if args.quick else (50 if gpu else 10))
    args.min_time_s = timing.resolve_min_time(args, gpu)
    # CPUs, one process: the backends' iterations in turns (bench_interleaved); GPUs and several
    # processes: one backend after the other, each communicator closed before the next opens
    interleave = not gpu and jax.process_count() == 1 and not getattr(args, "sequential", False)
    if args.turns:  # a GPU-side barrier before each launch would wait for a process that waits its turn
        os.environ["JAX_MOE_A2A_KERNEL_TIMING"] = "nosync"
    warmup = args.warmup if args.warmup is not None else (5 if gpu and not args.quick else 1)
    mesh = testing.make_mesh(args.ranks)
    meta = benchlib.run_meta(jax, iters=iters, warmup=warmup, ranks=mesh.size, min_time_s=args.min_time_s,
                             kernel_timing=os.environ.get("JAX_MOE_A2A_KERNEL_TIMING", "0"))
    if lead:
        print(f"halves benchmark: backends {backends}, shapes {names}, {mesh.size} ranks on {meta['devices']} "
              f"{platform} device(s) in {meta['processes']} process(es), {iters} timed + {warmup} warm-up "
              f"iterations" + (f" at least, more until {args.min_time_s:g} s (up to {10 * iters})"
                               if args.min_time_s else "")
              + ("; the backends' iterations in turns" if interleave else ""), flush=True)
        for b, why in skipped.items():
            print(f"  skipped {b}: {why}", flush=True)
    units = {s: chosen[s].units() for s in names}
    spec_kw = {"recv_dtype": {"bf16": "bfloat16", "f16": "float16", "f32": "float32"}[args.recv_dtype]} \
        if args.recv_dtype else {}
    progress = Progress(len(backends) * sum(units[s] * (2 + iters + warmup) for s in names), lead,
                        label=progress_label)
    if "nvshmem" in backends and not os.environ.get("JAX_MOE_A2A_NVSHMEM_ARENA"):
        # The first communicator of a process fixes the NVSHMEM arena: make room for every shape.
        from jax_moe_a2a.backends.nvshmem import NvshmemBackend
        from jax_moe_a2a.config import Config
        nv = NvshmemBackend()
        need = sum(nv.buffer_bytes(Config.build(chosen[s].spec(**spec_kw), mesh.size, nv)) for s in names)
        os.environ["JAX_MOE_A2A_NVSHMEM_ARENA"] = str(need)
    results = []
    if interleave:   # per shape: every backend's communicator at once, their iterations in turns
        for s in names:
            timers, comms = [], []
            for b in backends:
                try:
                    comms.append(a2a.init(chosen[s].spec(**spec_kw), mesh, "ep", backend=b, collect_stats=False))
                    timers.append(HalvesTimer(jax, comms[-1], s, args, progress, units[s]))
                except Exception as e:
                    results.append({"backend": b, "shape": s, "error": f"{type(e).__name__}: {e}"})
                    if lead:
                        traceback.print_exc()
            try:
                recs = bench_interleaved(timers, iters, warmup, args.min_time_s)
            except Exception as e:
                recs = [{"backend": t.comm.backend_name, "shape": s, "error": f"{type(e).__name__}: {e}"}
                        for t in timers]
                if lead:
                    traceback.print_exc()
            for rec in recs:
                rec["scaled"] = chosen[s].scaled
                results.append(rec)
                if lead:
                    progress.write(f"finished {rec['backend']}/{s}: {rec.get('check') or rec.get('error')}")
            for c in comms:
                c.close()
    for b in ([] if interleave else backends):
        for s in names:
            try:
                comm = a2a.init(chosen[s].spec(**spec_kw), mesh, "ep", backend=b, collect_stats=False)
                rec = bench_one(jax, comm, s, args, iters, warmup, progress, units[s])
                rec["scaled"] = chosen[s].scaled
                comm.close()
            except Exception as e:  # report and go on with the other backends
                rec = {"backend": b, "shape": s, "error": f"{type(e).__name__}: {e}"}
                if lead:
                    traceback.print_exc()
            results.append(rec)
            if lead:  # one line per run as it ends, so that a run that hangs is named in the log
                progress.write(f"finished {b}/{s}: {rec.get('check') or rec.get('error')}")
    progress.close()
    out = {"meta": meta, "results": results, "skipped": skipped}
    if args.anchor_json:
        out["anchor"] = anchor.load(args.anchor_json, jax.process_count())
        for r in results:
            if "spec" in r:
                r["anchor_row"] = anchor.best_row(out["anchor"], r["backend"], r["spec"])
    return out


def merged_report(paths) -> dict:
    """Several halves.json (e.g. N = 2 and N = 4 processes) as one: backends tagged with N (and x's
    dtype when not f32)."""
    out = None
    for path in paths:
        with open(path) as f:
            part = json.load(f)
        for r in part["results"]:
            x = {"bf16": " x=bf16", "fp8 (pre-quantised)": " x=fp8"}.get(r.get("x_dtype"), "")
            local = " EP=1 path" if r.get("local_path") else ""
            r["backend"] = f"{r['backend']} N={r.get('processes', part['meta'].get('processes'))}{x}{local}"
        if out is None:
            out = part
        else:
            out["results"] += part["results"]
    return out


def failed(out) -> bool:
    return any("error" in r or str(r.get("check", "")).startswith("FAILED") for r in out["results"])


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--report"]:  # python benchmarks/halves.py --report a/halves.json b/halves.json
        report.print_halves(merged_report(argv[1:]))
        return 0
    args = parse_args(argv)
    jax = benchlib.setup_runtime(args.cpu_devices)
    out = run(jax, args, args.progress_label)
    if jax.process_index() == 0 and args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(out, f)
    elif jax.process_index() == 0:
        report.write_and_show(out, args.out, "halves.json", report.print_halves, report.plot_halves, args.no_plot)
    if jax.process_count() > 1:
        jax.distributed.shutdown()
    return 1 if failed(out) else 0


if __name__ == "__main__":
    sys.exit(main())
