"""The main job: dispatch/combine benchmark of a DeepSeek-V3-shaped MoE layer.

Checks every backend against the NumPy oracle first, then times each half (p50/p99 over
iterations, max over processes), and writes results.json and latency.png into --out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import traceback

HALVES = ("dispatch_send", "dispatch_recv", "combine_send", "combine_recv", "dispatch", "combine")


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m jax_moe_a2a.bench", description=__doc__)
    p.add_argument("--backend", default="", help="comma-separated backends (default: every available one)")
    p.add_argument("--shape", default="decode,prefill", help="comma-separated: decode, prefill")
    p.add_argument("--quick", action="store_true", help="small shapes and few iterations (smoke run)")
    p.add_argument("--iters", type=int, default=None,
                   help="timed iterations per half (default 50 on GPUs, 20 on CPUs, 5 with --quick)")
    p.add_argument("--warmup", type=int, default=None, help="untimed iterations first (default 5, quick 2)")
    p.add_argument("--ranks", type=int, default=None, help="EP ranks (default: all global devices)")
    p.add_argument("--tokens", type=int, default=None, help="override T for every shape")
    p.add_argument("--hidden", type=int, default=None, help="override H for every shape")
    p.add_argument("--no-check", action="store_true", help="skip the oracle check")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench-out", help="directory for results.json and PNG plots")
    p.add_argument("--cpu-devices", type=int, default=None,
                   help="CPU devices per process (default 8 in one process, 1 under mpirun)")
    return p.parse_args(argv)


def setup_runtime(args):
    """Environment before JAX initialises its backends: CPU device count, multi-process init."""
    mpi_size = int(os.environ.get("OMPI_COMM_WORLD_SIZE", os.environ.get("PMI_SIZE", "1")))
    ndev = args.cpu_devices or (8 if mpi_size == 1 else 1)
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={ndev}".strip()
    import jax
    if mpi_size > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        from jax_moe_a2a.runtime import local_device_ids_from_env  # "0": processes sharing GPU 0
        jax.distributed.initialize(local_device_ids=local_device_ids_from_env())
    return jax


def git_commit() -> str:
    if os.environ.get("JAX_MOE_A2A_COMMIT"):  # set by scripts that run on a copy without .git
        return os.environ["JAX_MOE_A2A_COMMIT"]
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        c = subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                           timeout=5).stdout.strip()
        dirty = subprocess.run(["git", "-C", here, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return (c + ("-dirty" if dirty else "")) if c else "unknown"
    except Exception:
        return "unknown"


class Progress:
    """tqdm on process 0 when available; silent elsewhere."""

    def __init__(self, total, enabled):
        self.bar = None
        if enabled:
            try:
                from tqdm import tqdm
                self.bar = tqdm(total=total, unit="step", dynamic_ncols=True, file=sys.stderr)
            except ImportError:
                self.bar = None
        self.enabled = enabled
        self.n, self.total = 0, total

    def update(self, desc):
        self.n += 1
        if self.bar is not None:
            self.bar.set_description(desc)
            self.bar.update(1)
        elif self.enabled and self.n % 10 == 0:
            print(f"[{self.n}/{self.total}] {desc}", file=sys.stderr, flush=True)

    def write(self, line):
        """A line of its own on stdout, flushed (the bar is on stderr)."""
        if self.enabled:
            print(line, flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.close()


def bench_one(jax, comm, shape_name, args, iters, warmup, progress):
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import PartitionSpec as P

    from .. import oracle, testing
    from . import timing

    spec, mesh, n = comm.spec, comm.mesh, comm.num_ranks
    inputs = testing.make_inputs(spec, n, args.seed, num_tokens=spec.max_tokens_per_rank)
    record = {"backend": comm.backend_name, "shape": shape_name, "ranks": n, "processes": jax.process_count(),
              "spec": {"T": spec.max_tokens_per_rank, "H": spec.hidden, "E": spec.num_experts,
                       "K": spec.experts_per_token, "dispatch_dtype": str(spec.dispatch_dtype),
                       "combine_dtype": str(spec.combine_dtype), "layout": spec.layout},
              "buffer_bytes_per_rank": comm.buffer_bytes()}
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
    progress.update(f"{comm.backend_name}/{shape_name} check")

    axis = comm.axis
    glob = [testing.stack_global(mesh, axis, [getattr(i, f) for i in inputs]) for f in ("x", "topk_ids", "topk_weights")]
    glob.append(testing.stack_global(mesh, axis, [np.int32(i.num_tokens) for i in inputs]))
    add = lambda t: jax.tree.map(lambda a: a[None], t)   # per-rank leaf -> [1, ...] for out_specs
    rm = lambda t: jax.tree.map(lambda a: a[0], t)

    def sm(fn, nin):
        return jax.jit(testing.shard_map(fn, mesh=mesh, in_specs=(P(axis),) * nin, out_specs=P(axis)))

    f_ds = sm(lambda x, i, w, k: add(comm.dispatch_send(x, i, w, k)), 4)
    f_dr = sm(lambda h: add(comm.dispatch_recv(rm(h))), 1)
    f_y = sm(lambda g: add(testing.expert_fn_jax(spec, n, rm(g), jnp.bfloat16)), 1)
    f_cs = sm(lambda y, g: add(comm.combine_send(rm(y), rm(g))), 2)
    f_cr = sm(lambda h: add(comm.combine_recv(rm(h))), 1)
    f_d = sm(lambda x, i, w, k: add(comm.dispatch(x, i, w, k)), 4)
    f_c = sm(lambda y, g: add(comm.combine(rm(y), rm(g))), 2)

    samples = {h: [] for h in HALVES}
    # Kernel-only times (cuda backend with JAX_MOE_A2A_KERNEL_TIMING=1): CUDA events around each
    # half's kernel, free of Python dispatch and host synchronisation.
    kernel_of = getattr(comm._backend, "kernel_seconds", None)
    kernel = {h: [] for h in HALVES[:4]}

    def kernel_sample(half):
        sec = kernel_of(comm, half) if kernel_of else None
        if sec is not None:
            kernel[half].append(sec)
    for it in range(warmup + iters):
        timed = it >= warmup
        timing.barrier("ds")
        h, t = timing.time_once(f_ds, *glob)
        samples["dispatch_send"].append(t)
        kernel_sample("dispatch_send")
        timing.barrier("dr")
        got, t = timing.time_once(f_dr, h)
        samples["dispatch_recv"].append(t)
        kernel_sample("dispatch_recv")
        y = timing.block(f_y(got))
        timing.barrier("cs")
        ch, t = timing.time_once(f_cs, y, got)
        samples["combine_send"].append(t)
        kernel_sample("combine_send")
        timing.barrier("cr")
        _, t = timing.time_once(f_cr, ch)
        samples["combine_recv"].append(t)
        kernel_sample("combine_recv")
        timing.barrier("d")
        _, t = timing.time_once(f_d, *glob)
        samples["dispatch"].append(t)
        timing.barrier("c")
        _, t = timing.time_once(f_c, y, got)
        samples["combine"].append(t)
        if not timed:
            for v in list(samples.values()) + list(kernel.values()):
                if v:
                    v.pop()
        progress.update(f"{comm.backend_name}/{shape_name} iter")
    record["timings"] = {h: timing.summarize(timing.max_over_processes(v, h)) for h, v in samples.items()}
    if all(len(v) == iters for v in kernel.values()):
        record["kernel_timings"] = {h: timing.summarize(timing.max_over_processes(v, "k" + h)) for h, v in kernel.items()}
    for op in ("dispatch", "combine"):
        p50 = record["timings"][op]["p50_us"]
        record.setdefault("goodput_GBps", {})[op] = record[f"{op}_bytes_per_rank"] / (p50 * 1e3) if p50 else 0.0
    return record


def print_table(results):
    hdr = f"{'backend':<11} {'shape':<8} {'check':<6} " + " ".join(f"{h:>17}" for h in HALVES) + "   buffer/rank"
    print(hdr)
    print(f"{'':<27}" + " ".join(f"{'p50/p99 µs':>17}" for _ in HALVES))
    for r in results:
        if "timings" not in r:
            print(f"{r['backend']:<11} {r['shape']:<8} {r.get('error', '')}")
            continue
        cells = " ".join(f"{r['timings'][h]['p50_us']:>8.0f}/{r['timings'][h]['p99_us']:<8.0f}" for h in HALVES)
        chk = "ok" if r["check"] == "ok" else ("skip" if r["check"] == "skipped" else "FAIL")
        print(f"{r['backend']:<11} {r['shape']:<8} {chk:<6} {cells}   {r['buffer_bytes_per_rank'] / 2**20:8.1f} MiB")
        if "kernel_timings" in r:  # CUDA-event time of each half's kernel alone
            kt = r["kernel_timings"]
            cells = " ".join(f"{kt[h]['p50_us']:>8.1f}/{kt[h]['p99_us']:<8.1f}" for h in HALVES[:4])
            print(f"{'  (kernel)':<27}{cells}")


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    jax = setup_runtime(args)
    import jax_moe_a2a as a2a
    from .. import testing
    from . import plot as plot_mod, shapes

    lead = jax.process_index() == 0
    platform = jax.default_backend()
    table = shapes.pick(platform, args.quick)
    names = [s for s in args.shape.split(",") if s]
    for s in names:
        if s not in table:
            raise SystemExit(f"--shape: unknown shape {s!r} (known: {sorted(table)})")
    backends = [b for b in args.backend.split(",") if b] or a2a.available_backends()
    iters = args.iters or (5 if args.quick else (20 if platform == "cpu" else 50))
    warmup = args.warmup if args.warmup is not None else (2 if args.quick else (3 if platform == "cpu" else 5))
    mesh = testing.make_mesh(args.ranks)
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": git_commit(), "jax": jax.__version__, "platform": platform,
            "device_kind": jax.devices()[0].device_kind, "devices": jax.device_count(),
            "processes": jax.process_count(), "argv": sys.argv, "iters": iters, "warmup": warmup}
    if lead:
        print(f"jax_moe_a2a bench: {len(backends)} backend(s) {backends}, shapes {names}, {mesh.size} ranks on "
              f"{meta['devices']} {platform} device(s) in {meta['processes']} process(es)", flush=True)
    progress = Progress(len(backends) * len(names) * (1 + iters + warmup), lead)
    overrides = {}
    if args.tokens:
        overrides["max_tokens_per_rank"] = args.tokens
    if args.hidden:
        overrides["hidden"] = args.hidden
    if "nvshmem" in backends and not os.environ.get("JAX_MOE_A2A_NVSHMEM_ARENA"):
        # The first communicator of a process fixes the NVSHMEM arena: make room for every shape.
        from ..backends.nvshmem import NvshmemBackend
        nv = NvshmemBackend()
        os.environ["JAX_MOE_A2A_NVSHMEM_ARENA"] = str(sum(nv.buffer_bytes(table[s].spec(**overrides), mesh.size)
                                                          for s in names))
    results = []
    failed = False
    for b in backends:
        for s in names:
            shape = table[s]
            try:
                comm = a2a.init(shape.spec(**overrides), mesh, "ep", backend=b, collect_stats=False)
                rec = bench_one(jax, comm, s, args, iters, warmup, progress)
                failed |= rec["check"].startswith("FAILED")
            except Exception as e:  # report and go on with the other backends
                failed = True
                rec = {"backend": b, "shape": s, "error": f"{type(e).__name__}: {e}"}
                if lead:
                    traceback.print_exc()
            results.append(rec)
            if lead:  # one line per run as it ends, so that a run that hangs is named in the log
                progress.write(f"finished {b}/{s}: {rec.get('check') or rec.get('error')}")
    progress.close()
    out = {"meta": meta, "results": results}
    if lead:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump(out, f, indent=2)
        pngs = plot_mod.plot(out, args.out)
        print_table(results)
        print(f"wrote {os.path.join(args.out, 'results.json')} " + " ".join(pngs))
    if jax.process_count() > 1:
        jax.distributed.shutdown()
    return 1 if failed else 0
