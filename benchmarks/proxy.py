"""The cuda backend's inter-node path (proxy thread + TransferEngine) on GPUs.

    python benchmarks/proxy.py --signal             # GPU -> host -> GPU flag round trip
    JAX_MOE_A2A_NODE_SIZE=1 mpirun -n 2 python benchmarks/proxy.py --shape decode

The second form checks against the oracle and times each half as the main bench does (barrier
between halves, max over processes), with JAX_MOE_A2A_KERNEL_TIMING=1 also each half's kernel
alone, and adds the proxy's counters. Breakdown per dispatch (µs, p50 over iterations where timed):
  pack       dispatch_send kernel (CUDA events): routing, packing remote rows into pinned memory
  transfer   the proxy's time from posting our counts to every remote row landed
             (counts_to_landed, mean over dispatches; includes waiting for the slowest peer)
  unpack     dispatch_recv kernel (CUDA events): reading remote rows from pinned memory
  reaction   half the signalling round trip (--signal): one kernel -> proxy or proxy -> kernel flag
and the same for combine (comb_to_landed between the two kernels).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np


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
    p.add_argument("--json", default=None, help="write the record here (process 0)")
    return p.parse_args(argv)


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


def halves(args):
    import benchlib
    from benchlib import Progress, shapes, timing
    from halves import bench_one
    jax = benchlib.setup_runtime()
    import jax_moe_a2a as a2a
    from jax_moe_a2a import testing

    table = shapes.pick(jax.default_backend(), False)
    overrides = {k: v for k, v in (("max_tokens_per_rank", args.tokens), ("hidden", args.hidden)) if v}
    mesh = testing.make_mesh()
    comm = a2a.init(table[args.shape].spec(**overrides), mesh, "ep", backend="cuda", collect_stats=False)
    lead = jax.process_index() == 0
    before = comm.proxy_stats()
    rec = bench_one(jax, comm, args.shape, argparse.Namespace(seed=args.seed, no_check=False), args.iters,
                    args.warmup, Progress(1 + args.iters + args.warmup, False))
    after = comm.proxy_stats()
    diag = comm.diagnostics()
    rec["node_size"] = diag.get("node_size")
    rec["provider"] = diag.get("provider")
    per = {}
    for key, count in (("counts_to_landed_ns", "dispatches"), ("comb_to_landed_ns", "combines")):
        vals = [(after[r][key] - before[r][key]) / max(1, after[r][count] - before[r][count]) for r in after]
        per[key] = float(np.max(timing.max_over_processes([max(vals) if vals else 0.0], "proxy" + key)))
    rec["proxy"] = {"counts_to_landed_us": per["counts_to_landed_ns"] / 1e3,
                    "comb_to_landed_us": per["comb_to_landed_ns"] / 1e3}
    if lead:
        t, k = rec["timings"], rec.get("kernel_timings")
        print(f"cuda inter-node path: {comm.num_ranks} ranks, node_size {rec['node_size']}, provider "
              f"{rec['provider']}, {comm.spec.describe()}, check {rec['check']}")
        for h in ("dispatch_send", "dispatch_recv", "combine_send", "combine_recv", "dispatch", "combine"):
            kt = f"   kernel p50 {k[h]['p50_us']:8.1f} µs" if k and h in k else ""
            print(f"  {h:<14} wall p50 {t[h]['p50_us']:8.1f} µs  p99 {t[h]['p99_us']:8.1f} µs{kt}")
        if k:
            print(f"  breakdown dispatch: pack {k['dispatch_send']['p50_us']:.1f} µs | transfer (proxy: counts out -> "
                  f"all rows landed) {rec['proxy']['counts_to_landed_us']:.1f} µs | unpack "
                  f"{k['dispatch_recv']['p50_us']:.1f} µs")
            print(f"  breakdown combine:  pack {k['combine_send']['p50_us']:.1f} µs | transfer (proxy: rows out -> "
                  f"all landed) {rec['proxy']['comb_to_landed_us']:.1f} µs | reduce {k['combine_recv']['p50_us']:.1f} µs")
        else:
            print("  (set JAX_MOE_A2A_KERNEL_TIMING=1 and disable command buffers for the kernel breakdown)")
    comm.close()
    if jax.process_count() > 1:
        jax.distributed.shutdown()
    return rec


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    rec = {"signal": signal(args.signal_iters)} if args.signal else halves(args)
    if args.json and int(os.environ.get("OMPI_COMM_WORLD_RANK", "0")) == 0:
        with open(args.json, "w") as f:
            json.dump(rec, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
