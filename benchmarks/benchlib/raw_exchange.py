"""The raw wire time of an exchange's bytes in the exchange's own pattern: every rank writes its
message to every other rank at once (raw fi_writedata, no engine: cc/bench/raw_exchange.h), and an
exchange ends when a rank's own writes completed and every peer's message landed. Issue 35's
measure divides the proxy path's end to end by this plus the NVLink path's kernels.

The raw ping-pong (engine benchmark, proxy_breakdown.raw_at) times one peer's message in one
direction; an exchange moves every rank's messages in every direction at once, which over shm (the
provider's CPU copies) and over one NIC (its bandwidth) costs more than one message alone.

Sizes come from what the proxy really wrote (proxy_stats' row_bytes_to / comb_bytes_to, per
destination rank, summed over steps): `sizes_per_step` turns two snapshots and the steps between
them into the average bytes one step wrote each peer. Rows a rank writes itself (the host backend
with node_size 0 routes those through its engine too) are left out: they cross no wire.
"""

from __future__ import annotations

import base64
import os
import threading
from typing import Dict, List, Optional

import numpy as np

# proxy_stats' key with the bytes per destination, per op
_KEYS = {"dispatch": "row_bytes_to", "combine": "comb_bytes_to"}


def sizes_per_step(before: dict, after: dict, steps: int) -> Dict[int, Dict[str, List[int]]]:
    """Two comm.proxy_stats() snapshots ({rank: dict}) and the dispatches (and combines) the caller
    ran between them -> {rank: {op: [N] bytes one step wrote each rank}} (the average, whole bytes;
    0 for the rank itself). The caller counts the steps: the proxy's own dispatches / combines
    count a step once its FREE went out, which may lag the last one. Ranks keyed (group, rank) on
    meshes with several EP groups keep their keys. Empty when steps <= 0."""
    if steps <= 0:
        return {}
    out = {}
    for r, a in after.items():
        b = before.get(r, {})
        me = r[-1] if isinstance(r, tuple) else r
        out[r] = {op: [0 if d == me else int(round((x - y) / steps))
                       for d, (x, y) in enumerate(zip(a[key], b.get(key, [0] * len(a[key]))))]
                  for op, key in _KEYS.items()}
    return out


def measure(sizes: Dict[int, Dict[str, List[int]]], provider: Optional[str] = None, iface: Optional[str] = None,
            iters: int = 20, blocks: int = 7, timeout_s: float = 60.0) -> Optional[dict]:
    """Times the raw exchange of `sizes` ({rank: {op: [N] bytes to each rank}}, this process's ranks;
    collective: every process calls it, together holding every rank once, with the same ops).
    Per op: `blocks` runs of `iters` exchanges back to back after one warm-up run, each local rank
    in its own thread; a block's figure is its seconds / iters on the slowest rank (over processes
    too). Returns {op: {"p50_us", "min_us", "max_us", "bytes_max" (the most one rank wrote in one
    exchange), "blocks"}}, or None where there is no remote peer or no bytes at all.
    provider / iface: default $JAX_MOE_A2A_PROVIDER (shm) and $JAX_MOE_A2A_IFACE ("lo" for tcp)."""
    import jax_moe_a2a_bench as loops

    from . import timing
    if any(isinstance(r, tuple) for r in sizes):
        raise ValueError("raw exchange: one EP group only (proxy_stats keyed by (group, rank))")
    ranks = sorted(sizes)
    ops = [op for op in _KEYS if all(op in sizes[r] for r in ranks)]
    all_ops = timing.gather(ops, "raw_exchange_ops")
    ops = [op for op in ops if all(op in o for o in all_ops)]
    world = len(next(iter(sizes.values()))[ops[0]]) if ops and ranks else 0
    biggest = max([max(sizes[r][op]) for r in ranks for op in ops] or [0])
    biggest = max(timing.gather(int(biggest), "raw_exchange_max"))  # every rank's buffer alike
    if world < 2 or biggest == 0:
        return None
    provider = provider or os.environ.get("JAX_MOE_A2A_PROVIDER") or "shm"
    if iface is None:
        iface = os.environ.get("JAX_MOE_A2A_IFACE") or ("lo" if provider.startswith("tcp") else "")
    ex = {r: loops.RawExchange(provider, iface, biggest, world, r) for r in ranks}
    blobs = {}
    for part in timing.gather({str(r): base64.b64encode(e.blob()).decode("ascii") for r, e in ex.items()},
                              "raw_exchange_blobs"):
        blobs.update({int(r): base64.b64decode(b) for r, b in part.items()})
    if sorted(blobs) != list(range(world)):
        raise RuntimeError(f"raw exchange: blobs of ranks {sorted(blobs)}, expected 0..{world - 1}")
    for e in ex.values():
        e.connect([blobs[r] for r in range(world)])

    def run_all(op, n):  # every local rank's run at once; seconds per rank
        secs, errors = {}, []

        def one(r):
            try:
                secs[r] = ex[r].run(sizes[r][op], n, timeout_s)
            except Exception as exc:  # reported below, after every thread ended
                errors.append((r, exc))
        threads = [threading.Thread(target=one, args=(r,)) for r in ranks]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise RuntimeError(f"raw exchange ({op}): {errors}")
        return max(secs.values())

    out = {}
    for op in ops:
        run_all(op, max(1, iters // 4))  # warm-up: first touches of the buffers, the provider's setup
        per = [run_all(op, iters) / iters for _ in range(blocks)]
        arr = timing.max_over_processes(per, f"raw_exchange_{op}") * 1e6
        most = max(timing.gather(max(sum(sizes[r][op]) for r in ranks), f"raw_exchange_bytes_{op}"))
        out[op] = {"p50_us": float(np.percentile(arr, 50)), "min_us": float(arr.min()), "max_us": float(arr.max()),
                   "bytes_max": int(most), "blocks": int(arr.size)}
    return out


def total_us(raw: dict) -> float:
    """The raw exchange of one step's bytes: every op's p50 µs, summed (dispatch + combine)."""
    return sum(v["p50_us"] for v in raw.values())


def describe(raw: Optional[dict]) -> str:
    """One line: each op's raw exchange p50 [min, max] and their sum."""
    if not raw:
        return "raw exchange: none (no remote peer or no bytes)"
    parts = [f"{op} {v['p50_us']:.1f} [{v['min_us']:.1f}, {v['max_us']:.1f}] µs ({v['bytes_max'] / 1e6:.2f} MB)"
             for op, v in raw.items()]
    total = total_us(raw)
    return f"raw exchange of the same bytes (every rank writing every peer at once): {', '.join(parts)}; " \
           f"sum {total:.1f} µs"
