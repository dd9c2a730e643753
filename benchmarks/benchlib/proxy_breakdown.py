"""Where the cuda backend's inter-node transfer goes (benchmarks/proxy.py): the arithmetic of the
breakdown (bytes on the wire, the engine benchmark's figures, skew, transfer per iteration, the
unexplained rest, the idle-policy table, the report lines), free of JAX and of the extension so
that tests check it on synthetic inputs. The parts are defined in benchmarks/proxy.py's docstring.
Units: µs unless a name says otherwise (`_ns`, bytes, MB/s)."""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence

import numpy as np

# Breakdown name -> (halves.bench_one's calls it spans, proxy counter, kernel halves (pack, unpack)).
# "dispatch" and "combine" are the split halves (send and recv as two calls with a barrier between);
# the "(one call)" rows are the one-shot ops, which have no kernel times of their own.
PARTS = {
    "dispatch": (("dispatch_send", "dispatch_recv"), "counts_to_landed_ns", ("dispatch_send", "dispatch_recv")),
    "combine": (("combine_send", "combine_recv"), "comb_to_landed_ns", ("combine_send", "combine_recv")),
    "dispatch (one call)": (("dispatch",), "counts_to_landed_ns", None),
    "combine (one call)": (("combine",), "comb_to_landed_ns", None),
}
KERNEL_LABELS = {"dispatch": ("pack", "unpack"), "combine": ("pack", "reduce")}

# Modes of the timed loop: environment changes made before the communicator is created (None:
# unset, i.e. the library's default). The proxy and the engine's progress thread read their idle
# policies when they start (cc/proxy/proxy.cc, cc/transfer/progress.cc); the cuda inter-node path
# reads where its rows live at creation (JAX_MOE_A2A_STAGING, cc/cuda/remote_path.cc). The idle
# modes leave JAX_MOE_A2A_STAGING as the environment has it; host-rows / copy-rows set it.
PROXY_MODES = {
    "default": {"JAX_MOE_A2A_PROXY": None, "JAX_MOE_A2A_PROGRESS": None},
    # the idle policy before the proxy polled while an op is under way (cc/proxy/proxy.h poll_in_flight)
    "backoff": {"JAX_MOE_A2A_PROXY": "backoff", "JAX_MOE_A2A_PROGRESS": None},
    "spin": {"JAX_MOE_A2A_PROXY": "spin", "JAX_MOE_A2A_PROGRESS": None},
    "spin-all": {"JAX_MOE_A2A_PROXY": "spin", "JAX_MOE_A2A_PROGRESS": "spin"},
    "host-rows": {"JAX_MOE_A2A_PROXY": None, "JAX_MOE_A2A_PROGRESS": None, "JAX_MOE_A2A_STAGING": "host"},
    "copy-rows": {"JAX_MOE_A2A_PROXY": None, "JAX_MOE_A2A_PROGRESS": None, "JAX_MOE_A2A_STAGING": "copy"},
    # JAX_MOE_A2A_PROXY_PIPELINE (cc/proxy/proxy.h): `peer` each peer's write once its rows are
    # packed, each OVER once its offset is known, and the receiver per source; `off` the series
    # (every write after the whole pack).
    "peer": {"JAX_MOE_A2A_PROXY": None, "JAX_MOE_A2A_PROGRESS": None, "JAX_MOE_A2A_PROXY_PIPELINE": "peer"},
    "series": {"JAX_MOE_A2A_PROXY": None, "JAX_MOE_A2A_PROGRESS": None, "JAX_MOE_A2A_PROXY_PIPELINE": "off"},
    # `priv`: `peer` with every OVER write after every COUNTS (before 2026-12-07; `peer` posts each
    # once its offset is known)
    "over-late": {"JAX_MOE_A2A_PROXY": None, "JAX_MOE_A2A_PROGRESS": None, "JAX_MOE_A2A_PROXY_PIPELINE": "priv"},
    "peer-spin": {"JAX_MOE_A2A_PROXY": "spin", "JAX_MOE_A2A_PROGRESS": None, "JAX_MOE_A2A_PROXY_PIPELINE": "peer"},
    "series-spin": {"JAX_MOE_A2A_PROXY": "spin", "JAX_MOE_A2A_PROGRESS": None, "JAX_MOE_A2A_PROXY_PIPELINE": "off"},
    # JAX_MOE_A2A_WRITE_CHUNK_KIB (cc/protocol/exchange.cc): a peer's PRIV and OVER rows in pieces of
    # at most 256 KiB / 1 MiB (the engine's streaming bandwidth over shm is ~20 GB/s at 256 KiB - 1 MiB
    # messages, ~13 GB/s at 4 MiB); `peer` writes them in one piece.
    "chunk256": {"JAX_MOE_A2A_PROXY": None, "JAX_MOE_A2A_PROGRESS": None, "JAX_MOE_A2A_WRITE_CHUNK_KIB": "256"},
    "chunk1024": {"JAX_MOE_A2A_PROXY": None, "JAX_MOE_A2A_PROGRESS": None, "JAX_MOE_A2A_WRITE_CHUNK_KIB": "1024"},
    # the idle back-off capped at 100 µs instead of growing to 2 ms after 20 ms idle (between steps)
    "peer-nap100": {"JAX_MOE_A2A_PROXY": None, "JAX_MOE_A2A_PROGRESS": None, "JAX_MOE_A2A_PROXY_PIPELINE": "peer",
                    "JAX_MOE_A2A_PROXY_IDLE_SLEEP_US": "100"},
}


def parse_modes(text: str) -> List[str]:
    """Parses "default,spin" -> ["default", "spin"] (order kept, duplicates dropped); ValueError naming the
    known modes for anything else."""
    modes = []
    for m in (s.strip() for s in text.split(",")):
        if m and m not in PROXY_MODES:
            raise ValueError(f"unknown proxy mode {m!r} (known: {', '.join(PROXY_MODES)})")
        if m and m not in modes:
            modes.append(m)
    if not modes:
        raise ValueError("no proxy mode given")
    return modes


# ---- bytes on the wire ----------------------------------------------------------------------

def pad16(n: int) -> int:
    return -(-int(n) // 16) * 16


def dispatch_row_bytes(token_bytes: int) -> int:
    """Bytes of one dispatched row in the proxy's buffers (cc/core/config.cc `row`): the wire row
    (Spec.token_bytes: payload and f32 scales), token index and router weight, padded to 16."""
    return pad16(token_bytes + 8)


def rows_between(dest_ranks: Sequence[np.ndarray], n: int) -> np.ndarray:
    """dest_ranks[s]: [pairs] int, the destination rank of every routed (token, expert) pair of rank
    s -> [N, N] int64 rows[s, d] that rank s sends rank d."""
    rows = np.zeros((n, n), np.int64)
    for s, d in enumerate(dest_ranks):
        rows[s] = np.bincount(np.asarray(d, np.int64).ravel(), minlength=n)[:n]
    return rows


def remote_pairs(n: int, node_size: int) -> np.ndarray:
    """[N, N] bool: pair (s, d) goes through the engine. node_size 0 (the host backend): every pair,
    a rank and itself included; else ranks on different nodes (s // node_size != d // node_size)."""
    r = np.arange(n)
    if not node_size:
        return np.ones((n, n), bool)
    return (r[:, None] // node_size) != (r[None, :] // node_size)


def half_bytes(rows: np.ndarray, remote: np.ndarray, row_bytes: int) -> dict:
    """Bytes the busiest rank sends remote ranks in one half. rows[s, d]: rows s sends d in that
    half (dispatch: the routing; combine: its transpose, an expert rank returns every row it got);
    remote: [N, N] bool (remote_pairs). Returns {"bytes", "rank", "peers" (its remote peers),
    "block" (bytes / peers: one peer's message), "rows"}."""
    sent_rows = (rows * remote).sum(axis=1)
    rank = int(np.argmax(sent_rows))
    peers = int(remote[rank].sum())
    nbytes = int(sent_rows[rank]) * int(row_bytes)
    return {"bytes": nbytes, "rank": rank, "peers": peers, "rows": int(sent_rows[rank]),
            "block": nbytes / peers if peers else 0.0}


# ---- the engine benchmark's figures ---------------------------------------------------------

def nearest(points: Sequence[dict], size: float) -> Optional[dict]:
    """The point whose "size" is nearest `size` on a log scale (ties: the smaller); None if none."""
    pts = [p for p in points if p.get("size", 0) > 0]
    if not pts:
        return None
    target = max(float(size), 1.0)
    return min(pts, key=lambda p: (abs(math.log(p["size"] / target)), p["size"]))


def engine_figures(result: dict, row_bytes: float, block_bytes: float) -> dict:
    """engine.bench_provider's result -> {"latency_us" (half round trip at the size nearest one row),
    "latency_size", "raw_latency_us" (raw fi_writedata at that size, None if not measured),
    "bandwidth_MBps" (streaming, at the size nearest one peer's block), "bandwidth_size"}."""
    lat = nearest(result.get("latency", []), row_bytes)
    bw = nearest(result.get("bandwidth", []), block_bytes)
    return {"provider": result.get("provider"),
            "latency_us": lat["half_rtt_us"] if lat else None, "latency_size": lat["size"] if lat else None,
            "raw_latency_us": lat.get("raw_half_rtt_us") if lat else None,
            "bandwidth_MBps": bw["MBps"] if bw else None, "bandwidth_size": bw["size"] if bw else None}


def wire_us(nbytes: float, latency_us: float, MBps: float) -> float:
    """latency + bytes / bandwidth in µs (1 MB/s moves one byte per µs)."""
    return float(latency_us) + float(nbytes) / float(MBps)


# ---- per-iteration samples from the recorded calls ------------------------------------------

def skew_us(stamps_ns) -> np.ndarray:
    """[processes, iters] host clock (ns) at each process's entry into the half -> [iters] max - min
    (µs). One process: zeros."""
    s = np.asarray(stamps_ns, np.int64)
    return (s.max(axis=0) - s.min(axis=0)).astype(np.float64) / 1e3


def counter_deltas(snaps: Sequence[dict], key: str) -> np.ndarray:
    """snaps: [calls + 1] proxy_stats() snapshots ({rank: {counter: value}}), snapshot k taken before
    call k and the last after the last call -> [calls] increase of `key` over each call, max over the
    process's ranks (0 without ranks)."""
    out = np.zeros(max(0, len(snaps) - 1), np.float64)
    for k in range(len(out)):
        a, b = snaps[k], snaps[k + 1]
        out[k] = max((b[r][key] - a[r][key] for r in b if r in a), default=0)
    return out


def per_iteration(names: Sequence[str], values: Sequence[float], calls: Sequence[str], iters: int,
                  how: str = "sum") -> np.ndarray:
    """Values of the recorded calls (names[k], values[k], in call order) grouped per iteration of the
    loop: each iteration makes every call of `calls` once. `how`: "sum" adds the group's values,
    "first" takes the value of calls[0]. Keeps the last `iters` iterations (the timed ones after the
    warm-up) -> [iters]. ValueError when the calls do not come in whole groups."""
    cols = []
    for c in calls:
        cols.append([v for n, v in zip(names, values) if n == c])
    if len({len(col) for col in cols}) != 1 or len(cols[0]) < iters:
        raise ValueError(f"recorded calls {[len(c) for c in cols]} of {list(calls)}: expected {iters} or more "
                         "of each")
    if how == "first":  # host clock stamps: integers kept exact (ns since the epoch pass 2**53)
        return np.asarray(cols[0][len(cols[0]) - iters:])
    return np.asarray([col[len(col) - iters:] for col in cols], np.float64).sum(axis=0)


# ---- the breakdown --------------------------------------------------------------------------

def p50(x) -> Optional[float]:
    x = np.asarray(x, np.float64)
    return float(np.percentile(x, 50)) if x.size else None


def breakdown(transfer_us, skew: np.ndarray, wire: Optional[float], kernels: Optional[dict] = None) -> dict:
    """One half's breakdown. transfer_us, skew: [iters] µs (max over ranks; max - min over processes);
    wire: µs or None (no engine figures); kernels: {label: p50 µs} or None. Returns p50s and
    unexplained = transfer - (skew + wire) (None without wire), plus its per-iteration p50."""
    t, s = np.asarray(transfer_us, np.float64), np.asarray(skew, np.float64)
    out = {"transfer_us": p50(t), "transfer_mean_us": float(t.mean()) if t.size else None,
           "transfer_p99_us": float(np.percentile(t, 99)) if t.size else None,
           "skew_us": p50(s), "skew_p99_us": float(np.percentile(s, 99)) if s.size else None,
           "wire_us": wire, "kernels_us": dict(kernels or {}), "iters": int(t.size)}
    if wire is None or not t.size:
        out["unexplained_us"] = out["unexplained_per_iter_us"] = None
    else:
        out["unexplained_us"] = out["transfer_us"] - (out["skew_us"] + wire)
        out["unexplained_per_iter_us"] = p50(t - s - wire)
    return out


def median_parts(rounds: List[Dict[str, float]]) -> Dict[str, float]:
    """{part: median over the rounds} of [{part: value}, ...] (a part missing from a round is left
    out of that round's median; None values are skipped). [{"dispatch": 3}, {"dispatch": 1},
    {"dispatch": 2}] -> {"dispatch": 2}."""
    parts: Dict[str, List[float]] = {}
    for r in rounds:
        for p, v in r.items():
            if v is not None:
                parts.setdefault(p, []).append(float(v))
    return {p: float(np.median(v)) for p, v in parts.items()}


def idle_policy(transfers: Dict[str, Dict[str, float]]) -> Dict[str, dict]:
    """{mode: {half: transfer p50 µs}} -> {half: {mode: µs, ..., "default - <mode>": µs}} (the
    differences only when "default" ran)."""
    out: Dict[str, dict] = {}
    for mode, halves in transfers.items():
        for half, us in halves.items():
            out.setdefault(half, {})[mode] = us
    for half, row in out.items():
        base = row.get("default")
        for mode in [m for m in list(row) if m != "default"]:
            if base is not None and row[mode] is not None:
                row[f"default - {mode}"] = base - row[mode]
    return out


# ---- report lines ---------------------------------------------------------------------------

def fmt_size(n) -> str:
    n = int(n)
    return f"{n / 2**20:g} MiB" if n >= 2**20 else f"{n / 2**10:g} KiB" if n >= 2**10 else f"{n} B"


def _us(x) -> str:
    return "n/a" if x is None else f"{x:.1f} µs"


def format_engine(result: Optional[dict], why: str = "") -> List[str]:
    """The engine benchmark's latency and bandwidth by size (engine.bench_provider's result), or why
    there is none."""
    if not result or not result.get("latency") or not result.get("bandwidth"):
        return [f"engine benchmark: no figures ({why or 'not run'}); wire time n/a"]
    lat = " | ".join(f"{fmt_size(x['size'])} {x['half_rtt_us']:.2f}" for x in result["latency"])
    raw = " | ".join(f"{fmt_size(x['size'])} {x['raw_half_rtt_us']:.2f}" for x in result["latency"]
                     if x.get("raw_half_rtt_us") is not None)
    bw = " | ".join(f"{fmt_size(x['size'])} {x['MBps']:.0f}" for x in result["bandwidth"])
    lines = [f"engine benchmark, provider {result.get('provider')} (these processes, ranks 0 and 1):",
             f"  half round trip (µs): {lat}"]
    if raw:
        lines.append(f"  raw fi_writedata (µs): {raw}")
    lines.append(f"  bandwidth (MB/s): {bw}")
    return lines


def format_half(name: str, b: dict, wire_bytes: Optional[dict] = None, fig: Optional[dict] = None) -> List[str]:
    """Two lines: the parts in order of the op (kernels around the transfer), then the transfer's
    decomposition into skew + wire + unexplained."""
    k = b.get("kernels_us") or {}
    labels = list(k)
    head = [f"{labels[0]} {_us(k[labels[0]])}"] if labels else []
    tail = [f"{lab} {_us(k[lab])}" for lab in labels[1:]]
    lines = [f"  breakdown {name}: " + " | ".join(head + [f"transfer {_us(b['transfer_us'])}"] + tail)
             + f"  (p50 of {b['iters']} iterations; mean {_us(b['transfer_mean_us'])}, "
               f"p99 {_us(b['transfer_p99_us'])})"]
    if b.get("wire_us") is not None and wire_bytes and fig:
        wire = (f"wire {_us(b['wire_us'])} ({fig['latency_us']:.2f} µs half round trip at "
                f"{fmt_size(fig['latency_size'])} + {wire_bytes['bytes'] / 1e6:.3f} MB from rank {wire_bytes['rank']} "
                f"to {wire_bytes['peers']} remote peer(s) at {fig['bandwidth_MBps']:.0f} MB/s, measured at "
                f"{fmt_size(fig['bandwidth_size'])})")
    else:
        wire = f"wire {_us(b.get('wire_us'))}"
    lines.append(f"    transfer {_us(b['transfer_us'])} = skew {_us(b['skew_us'])} + {wire} + unexplained "
                 f"{_us(b['unexplained_us'])} (per iteration: {_us(b['unexplained_per_iter_us'])})")
    return lines


def format_idle(table: Dict[str, dict], modes: Sequence[str]) -> List[str]:
    """The transfer p50 per half and mode, and default - mode."""
    diffs = [f"default - {m}" for m in modes if m != "default" and "default" in modes]
    cols = list(modes) + diffs
    lines = ["  idle policy, transfer p50 (µs): " + " | ".join(f"{c}" for c in cols)]
    for half, row in table.items():
        cells = " | ".join("n/a" if row.get(c) is None else f"{row[c]:.1f}" for c in cols)
        lines.append(f"    {half:<20} {cells}")
    return lines


# ---- the packer's side, end to end (host backend's proxied mode) -----------------------------
# proxy_stats() carries, per op, the packer's time in its calls (call_ns_<op>) and the part of it
# spent waiting for the proxy's flags (wait_ns_<op>); pack = send call - its wait, unpack = recv
# call - its wait. A group is one dispatch or combine: the one-call op, or the split halves.
PACKER_GROUPS = {
    "dispatch (one call)": (("dispatch",), "dispatch_send", "dispatch_recv"),
    "combine (one call)": (("combine",), "combine_send", "combine_recv"),
    "dispatch (halves)": (("dispatch_send", "dispatch_recv"), "dispatch_send", "dispatch_recv"),
    "combine (halves)": (("combine_send", "combine_recv"), "combine_send", "combine_recv"),
}
PACKER_PARTS = ("pack", "send_wait", "unpack", "recv_wait")
# benchlib/sched.py's thread groups -> the packer samples' run-queue columns (µs a group's threads sat
# runnable without a CPU during the calls; per iteration the most any process saw)
SCHED_PARTS = {"main": "runq_main", "proxy": "runq_proxy", "progress": "runq_progress"}


def packer_deltas(a: dict, b: dict, send: str, recv: str) -> Optional[Dict[str, float]]:
    """Two proxy_stats() snapshots ({rank: counters}) around one call -> its packer parts (µs) on the
    rank whose calls took longest: pack, send_wait, unpack, recv_wait and "calls" (their sum).
    None when the counters are absent (the cuda path) or did not move."""
    best = None
    for r in b:
        if r not in a or f"call_ns_{send}" not in b[r]:
            continue
        d = {k: (b[r][k] - a[r][k]) / 1e3 for k in (f"call_ns_{send}", f"wait_ns_{send}", f"call_ns_{recv}",
                                                    f"wait_ns_{recv}")}
        parts = {"pack": d[f"call_ns_{send}"] - d[f"wait_ns_{send}"], "send_wait": d[f"wait_ns_{send}"],
                 "unpack": d[f"call_ns_{recv}"] - d[f"wait_ns_{recv}"], "recv_wait": d[f"wait_ns_{recv}"]}
        parts["calls"] = d[f"call_ns_{send}"] + d[f"call_ns_{recv}"]
        if parts["calls"] > 0 and (best is None or parts["calls"] > best["calls"]):
            best = parts
    return best


def packer_breakdown(walls_us, parts: Dict[str, Sequence[float]], raw_wire_us: Optional[float],
                     skew_us=None) -> dict:
    """One group's end-to-end breakdown. walls_us: [iters] wall of the group's calls; parts: {part:
    [iters]} of PACKER_PARTS, each iteration on the process whose wall was longest. Returns p50s of
    wall, every part and rest = wall - (pack + send_wait + unpack + recv_wait) (the framework: JAX
    dispatch, the FFI call, Python), skew (max - min of the processes' entries, [iters], or None),
    beyond_wire = recv_wait - skew - raw_wire per iteration (what waiting costs past the raw provider
    time of the same bytes and the other processes' late start: the proxy's and engine's reactions,
    the protocol's rounds: COUNTS, then OVER where rows overflow, before the rows count as landed), and
    ratio = wall / (raw_wire + pack + unpack), the issue's measure (the packer's compute standing for
    the NVLink path's kernel time)."""
    w = np.asarray(walls_us, np.float64)
    p = {k: np.asarray(parts[k], np.float64) for k in PACKER_PARTS}
    rest = w - sum(p.values())
    out = {"wall_us": p50(w), "wall_p99_us": float(np.percentile(w, 99)) if w.size else None,
           "iters": int(w.size), "rest_us": p50(rest), "raw_wire_us": raw_wire_us}
    for k, v in p.items():
        out[f"{k}_us"] = p50(v)
    sk = np.zeros_like(w) if skew_us is None else np.asarray(skew_us, np.float64)
    out["skew_us"] = p50(sk)
    if raw_wire_us is not None and w.size:
        out["beyond_wire_us"] = p50(p["recv_wait"] - sk - raw_wire_us)
        out["ratio"] = p50(w / (raw_wire_us + p["pack"] + p["unpack"]))
    else:
        out["beyond_wire_us"] = out["ratio"] = None
    # Run-queue waits (when the samples carry them): the proxy's and progress thread's share of the
    # unexplained wait is named; what remains past them is beyond_runq.
    runq = {k: np.asarray(parts[k], np.float64) for k in SCHED_PARTS.values() if k in parts}
    for k, v in runq.items():
        out[f"{k}_us"] = p50(v)
    out["beyond_runq_us"] = None
    if len(runq) == len(SCHED_PARTS) and raw_wire_us is not None and w.size:
        out["beyond_runq_us"] = p50(p["recv_wait"] - sk - raw_wire_us - runq["runq_proxy"] - runq["runq_progress"])
    return out


def raw_at(result: Optional[dict], size: float) -> Optional[float]:
    """The raw fi_writedata half round trip (µs) measured at exactly `size` bytes (an extra latency
    point of the engine benchmark), else None."""
    for x in (result or {}).get("latency", []):
        if x.get("size") == int(size) and x.get("raw_half_rtt_us") is not None:
            return float(x["raw_half_rtt_us"])
    return None


def format_packer(name: str, b: dict, block: float, peers: int) -> List[str]:
    """Two lines: wall = pack + send_wait + unpack + recv_wait + rest, then the wait against the raw wire."""
    lines = [f"  end to end {name}: wall {_us(b['wall_us'])} (p99 {_us(b['wall_p99_us'])}) = pack {_us(b['pack_us'])} + "
             f"send wait {_us(b['send_wait_us'])} + unpack {_us(b['unpack_us'])} + recv wait {_us(b['recv_wait_us'])}"
             f" + rest {_us(b['rest_us'])} (framework: JAX, FFI, Python"
             + (f"; {_us(b['rest_less_floor_us'])} past JAX's call floor)" if b.get("rest_less_floor_us") is not None
                else ")")]
    if b.get("raw_wire_us") is not None:
        lines.append(f"    recv wait = skew {_us(b['skew_us'])} + raw wire {_us(b['raw_wire_us'])} (raw fi_writedata, one "
                     f"{fmt_size(block)} message, {peers} peer(s) in parallel) + unexplained {_us(b['beyond_wire_us'])} "
                     f"(per iteration); wall / (raw wire + pack + unpack) = {b['ratio']:.2f}x")
    else:
        lines.append("    raw wire n/a (no raw point at the block size)")
    if b.get("runq_proxy_us") is not None:
        lines.append(f"    run-queue waits (runnable, no CPU; Linux schedstat, the most any process saw): proxy thread "
                     f"{_us(b['runq_proxy_us'])}, progress thread {_us(b['runq_progress_us'])}, main thread "
                     f"{_us(b['runq_main_us'])}; unexplained less the proxy's and progress thread's: "
                     f"{_us(b['beyond_runq_us'])}")
    return lines
