"""TransferEngine micro-benchmark: write latency, bandwidth, scatter to N peers, barrier.

    mpirun --allow-run-as-root --oversubscribe -n 2 python benchmarks/engine.py \
        --provider shm --provider "tcp;ofi_rxm" --json /tmp/engine.json

Per provider (tcp stays on loopback unless --iface says otherwise):
  latency    half round trip of a `size`-byte write + immediate, ping-pong between ranks 0 and 1
             (timing loop in C++: no Python in the measured path; median and best of --blocks
             blocks), next to a raw fi_writedata ping-pong (own endpoint and CQ, one polling
             thread, no engine) run in the same processes block by block in between, and the
             same from Python (engine.write + engine.wait per hop) for 8 bytes;
  bandwidth  rank 0 streams `count` writes of `size` bytes to rank 1, which acknowledges the last;
  scatter    every rank scatters `size` bytes to every other rank and waits for all of theirs
             (time per round, max over ranks);
  barrier    barrier over all ranks (time per barrier, max over ranks).
Needs at least 2 processes; addresses and descriptors go through the jax.distributed KV store.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import numpy as np

KIB, MIB = 1 << 10, 1 << 20
LAT_SIZES = [8, 64, 512, 4 * KIB, 64 * KIB, 1 * MIB, 4 * MIB]
BW_SIZES = [8, 64, 512, 4 * KIB, 32 * KIB, 256 * KIB, 1 * MIB, 4 * MIB]
SCATTER_SIZES = [8, 4 * KIB, 64 * KIB]


def _mpi_world():
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK", "0")))
    size = int(os.environ.get("OMPI_COMM_WORLD_SIZE", os.environ.get("PMI_SIZE", "1")))
    return rank, size


def _kv():
    import jax
    from jax._src import distributed
    if distributed.global_state.client is None:
        jax.distributed.initialize()
    return distributed.global_state.client


def _iters(base: int, size: int, floor: int = 20) -> int:
    """Fewer iterations for large messages: about base * 4 KiB bytes per point, at least floor."""
    return max(floor, min(base, base * 4 * KIB // max(size, 1)))


def _fmt_size(n: int) -> str:
    return f"{n // MIB} MiB" if n >= MIB else f"{n // KIB} KiB" if n >= KIB else f"{n} B"


def bench_provider(provider: str, args, rank: int, world: int, kv, tag: str) -> dict | None:
    from jax_moe_a2a import transfer
    import jax_moe_a2a_bench as loops  # the C++ timing loops (cc/bench), built with the package

    iface = args.iface if args.iface is not None else (
        os.environ.get("JAX_MOE_A2A_IFACE") or ("lo" if provider.startswith("tcp") else ""))
    conn = transfer.connect(provider, kv, rank=rank, world_size=world, num_domains=args.num_domains,
                            iface=iface, name=f"bench-engine/{tag}/{provider}")
    e = conn.engine
    peers = conn.group()
    everyone = list(range(world))
    timeout = args.timeout
    # Extra latency points (args.extra_sizes: benchmarks/proxy.py asks for the message sizes its engine
    # issues), each with the raw baseline whatever baseline_max says.
    extra = sorted({int(x) for x in getattr(args, "extra_sizes", ()) or () if int(x) > 0})
    lat_sizes = sorted(set(LAT_SIZES) | set(extra))
    maxsize = max(lat_sizes + BW_SIZES)
    width = max(maxsize, max(SCATTER_SIZES) * world)
    src = np.frombuffer(np.random.default_rng(rank).bytes(width), np.uint8).copy()
    dst = np.zeros(width, np.uint8)
    rsrc, rdst = conn.register(src), conn.register(dst)
    dsts = conn.share(rdst)
    out = {"provider": e.provider, "domains": e.domain_names(), "num_domains": e.num_domains,
           "world_size": world, "latency": [], "bandwidth": [], "scatter": [], "barrier": {}}
    base = args.iters

    def sync(n):
        e.barrier_ranked(peers, 30, n % 256, timeout)

    def gather_max(name: str, value: float) -> float:
        vals = conn.all_gather(name, json.dumps(value).encode())
        return max(json.loads(v) for v in vals)

    only = set(args.only.split(","))
    # Raw fi_writedata baseline in the same processes (ranks 0 and 1), interleaved block by block
    # with the engine's ping-pong so that both see the same placement and load.
    raw = None
    if "latency" in only and args.baseline:
        raw = loops.RawPingPong(provider, iface, maxsize) if rank < 2 else None
        blobs = conn.all_gather("raw-baseline", raw.blob() if raw else b"")
        if raw:
            raw.connect(blobs[1 - rank])
    step = 0
    # --- latency: ping-pong 0 <-> 1 ------------------------------------------------------------
    for size in lat_sizes if "latency" in only else []:
        step += 1
        sync(step)
        if rank < 2:
            n = _iters(base, size)
            blocks = max(1, min(args.blocks, n // 10))
            per = max(1, n // blocks)
            times, raw_times = [], []
            with_raw = raw is not None and (size <= args.baseline_max or size in extra)
            if with_raw:
                raw.run(size, max(10, per // 10), rank == 0, timeout)  # warm-up
            for b in range(blocks):  # the timing loops are C++; blocks only split the statistics
                if with_raw:
                    raw_times.append(raw.run(size, per, rank == 0, timeout) / per / 2 * 1e6)
                t = loops.pingpong(e, 1 - rank, rsrc, dsts[1 - rank], size, per,
                                   max(10, per // 10) if b == 0 else 0, rank == 0,
                                   transfer.pack_imm(20, 0, 0), timeout)
                times.append(t / per / 2 * 1e6)
            if rank == 0:
                row = {"size": size, "iters": per * blocks, "blocks": blocks, "extra": size in extra,
                       "half_rtt_us": float(np.median(times)), "best_block_us": min(times)}
                if with_raw:
                    row.update(raw_half_rtt_us=float(np.median(raw_times)),
                               raw_best_block_us=min(raw_times),
                               ratio=float(np.median(np.array(times) / np.array(raw_times))))
                out["latency"].append(row)
    del raw
    # The same from Python, one write + one wait per hop (what a Python caller would see).
    step += 1
    sync(step)
    if rank < 2 and "latency" in only:
        n = max(200, base // 10)
        imm = transfer.pack_imm(21, 0, 0)
        other, d = 1 - rank, dsts[1 - rank]
        blocks = max(1, min(args.blocks, n // 10))
        per = n // blocks
        times = []
        for i in range(100 + per * blocks):
            if i >= 100 and (i - 100) % per == 0:
                t0 = time.perf_counter()
            if rank == 0:
                e.write(other, rsrc, 0, 8, d, 0, imm)
                e.wait(imm, 1, timeout)
            else:
                e.wait(imm, 1, timeout)
                e.write(other, rsrc, 0, 8, d, 0, imm)
            if i >= 100 and (i - 99) % per == 0:
                times.append((time.perf_counter() - t0) / per / 2 * 1e6)
        if rank == 0:
            out["python_write_wait_8B_half_rtt_us"] = float(np.median(times))
        e.flush(timeout)

    # --- bandwidth: stream 0 -> 1 --------------------------------------------------------------
    for size in BW_SIZES if "bandwidth" in only else []:
        step += 1
        sync(step)
        if rank < 2:
            count = max(8, min(base, (args.stream_mib * MIB) // size))
            loops.stream(e, 1 - rank, rsrc, dsts[1 - rank], size, min(count, 64), rank == 0,
                         transfer.pack_imm(22, 0, 0), transfer.pack_imm(23, 0, 0), timeout)
            t = loops.stream(e, 1 - rank, rsrc, dsts[1 - rank], size, count, rank == 0,
                             transfer.pack_imm(22, 0, 0), transfer.pack_imm(23, 0, 0), timeout)
            if rank == 0:
                out["bandwidth"].append({"size": size, "count": count, "seconds": t,
                                         "MBps": size * count / t / 1e6})

    # --- scatter to every other rank -----------------------------------------------------------
    my_slot = rank
    for size in SCATTER_SIZES if "scatter" in only else []:
        step += 1
        sync(step)
        n = _iters(base // 4, size)
        t = loops.scatter(e, peers, rsrc, [dsts[r] for r in peers.ranks], size, my_slot, n,
                          max(10, n // 10), transfer.pack_imm(24, 0, 0), timeout)
        us = gather_max(f"scatter-{size}", t / n * 1e6)
        out["scatter"].append({"size": size, "peers": len(peers), "iters": n, "round_us": us})

    # --- barrier -------------------------------------------------------------------------------
    if "barrier" in only:
        step += 1
        sync(step)
        n = max(100, base // 10)
        t = loops.barrier(e, peers, n, max(10, n // 10), transfer.pack_imm(25, 0, 0), timeout)
        out["barrier"] = {"ranks": len(everyone), "iters": n,
                          "us": gather_max("barrier", t / n * 1e6)}

    step += 1
    sync(step)
    e.flush(timeout)
    conn.close()
    return out if rank == 0 else None


def print_table(r: dict) -> None:
    print(f"\n== TransferEngine on {r['provider']} (domains {', '.join(r['domains'])}), "
          f"{r['world_size']} ranks ==")
    if r["latency"]:
        print(f"{'size':>8} {'half RTT (us)':>14} {'best block':>11} {'raw fi_writedata':>17} "
              f"{'engine/raw':>11} {'iters':>7}")
    for x in r["latency"]:
        raw = (f"{x['raw_half_rtt_us']:>17.3f} {x['ratio']:>11.2f}" if "ratio" in x
               else f"{'':>17} {'':>11}")
        print(f"{_fmt_size(x['size']):>8} {x['half_rtt_us']:>14.3f} {x['best_block_us']:>11.3f} "
              f"{raw} {x['iters']:>7}")
    if "python_write_wait_8B_half_rtt_us" in r:
        print(f"{'8 B':>8} {r['python_write_wait_8B_half_rtt_us']:>14.3f}  (from Python: write + wait)")
    if r["bandwidth"]:
        print(f"\n{'size':>8} {'bandwidth (MB/s)':>17} {'writes':>7}")
    for x in r["bandwidth"]:
        print(f"{_fmt_size(x['size']):>8} {x['MBps']:>17.1f} {x['count']:>7}")
    if r["scatter"]:
        print(f"\n{'size':>8} {'scatter round (us)':>19} {'peers':>6}")
    for x in r["scatter"]:
        print(f"{_fmt_size(x['size']):>8} {x['round_us']:>19.2f} {x['peers']:>6}")
    b = r["barrier"]
    if b:
        print(f"\nbarrier over {b['ranks']} ranks: {b['us']:.2f} us")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/engine.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--provider", action="append",
                   help="libfabric provider (repeatable); default $JAX_MOE_A2A_PROVIDER or shm")
    p.add_argument("--iface", default=None, help="domain/interface names (default: lo for tcp)")
    p.add_argument("--num-domains", type=int, default=1)
    p.add_argument("--iters", type=int, default=20000, help="ping-pong iterations for small sizes")
    p.add_argument("--no-baseline", dest="baseline", action="store_false",
                   help="latency: skip the raw fi_writedata baseline")
    p.add_argument("--baseline-max", type=int, default=64 * KIB,
                   help="latency: largest size with a raw baseline")
    p.add_argument("--blocks", type=int, default=20,
                   help="latency: split the iterations into blocks, report median and best block")
    p.add_argument("--stream-mib", type=int, default=256, help="bytes per bandwidth point (MiB)")
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--quick", action="store_true", help="fewer iterations (smoke run)")
    p.add_argument("--only", default="latency,bandwidth,scatter,barrier",
                   help="comma-separated subset of latency,bandwidth,scatter,barrier")
    p.add_argument("--json", default=None, help="write the results here (rank 0)")
    args = p.parse_args(argv)
    if args.quick:
        args.iters, args.stream_mib = 2000, 16

    rank, world = _mpi_world()
    if world < 2:
        print("run under mpirun with at least 2 processes, e.g.\n  mpirun -n 2 python "
              "benchmarks/engine.py --provider shm", file=sys.stderr)
        return 2
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    kv = _kv()
    tag = os.environ.get("OMPI_MCA_ess_base_jobid", str(os.getppid()))
    providers = args.provider or [os.environ.get("JAX_MOE_A2A_PROVIDER") or "shm"]
    results = []
    for prov in providers:
        r = bench_provider(prov, args, rank, world, kv, tag)
        if r is not None:
            print_table(r)
            sys.stdout.flush()
            results.append(r)
    if rank == 0 and args.json:
        record = {"benchmark": "transfer_engine", "host": platform.node(), "cpus": os.cpu_count(),
                  "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "args": vars(args), "results": results}
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
        print(f"\nwrote {args.json}")
    import jax
    jax.distributed.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
