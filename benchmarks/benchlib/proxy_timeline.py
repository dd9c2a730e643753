"""The proxy's step timeline (JAX_MOE_A2A_PROXY_TIMELINE, cc/proxy/timeline.h) read back and cut
into the parts of a transfer, so that the proxy benchmark's "unexplained" rest gets names.

Every proxy writes "<prefix>.r<rank>.p<pid>.<n>.tsv" when it stops: one line per protocol step,
"t_ns  mark  slot  epoch  peer", CLOCK_MONOTONIC (one clock for the processes of a machine, so the
files of one machine can be compared with each other). The proxy's state machine takes a dispatch's
steps in this order, so the parts below add up to its transfer (`counts_to_landed`):

  dispatch, per (rank, slot, epoch):
    pack after COUNTS   d_counts_out -> first d_priv_post: our packer still packing after it published
                        the counts (the send kernel's packing), and the proxy's reaction to d_packed
    posting             first d_priv_post -> last d_priv_posted: the PRIV write calls themselves
    peers' COUNTS       -> d_counts_in: the slowest remote peer's COUNTS still to come
    OVER out            -> d_over_out: a combine posted meanwhile, our OVER writes, the offsets published
    rows: peer late     -> the last remote peer's start of its PRIV post to us (its file), when that
                        came after our OVER out: the peer had not posted yet (its pack, its skew);
                        at most up to d_rows_in (a peer that sends us no rows writes us nothing)
    rows: wire          -> d_rows_in: from the later of the two to every peer's PRIV and OVER rows seen
                        (the peer's post call, the transport and its progress, our polling)
    landing             -> d_landed: the landing copy or fence, if any, and raising the flag
  combine, per (rank, slot, epoch):
    posting             c_comb_post -> c_comb_posted (before `comb_to_landed` starts)
    rows: peer late     c_comb_posted -> the last remote peer's start of its COMB post, when later
    rows: wire          -> c_comb_in
    landing             -> c_landed
A model's loop (benchmarks/layers.py through the proxy) is also cut per layer (cycle_parts: the
transfers, the kernels noticing them, the local compute, the next layer's send), and
`python -m benchlib.proxy_timeline PREFIX --skip N` prints both from the files.
"""

from __future__ import annotations

import glob
import statistics
from collections import defaultdict
from typing import Dict, List, Optional, Tuple

DISPATCH_PARTS = ("pack after COUNTS", "posting", "peers' COUNTS", "OVER out", "rows: peer late", "rows: wire",
                  "landing")
COMBINE_PARTS = ("posting", "rows: peer late", "rows: wire", "landing")

Marks = Dict[Tuple[str, int, int], List[Tuple[int, int]]]  # (mark, slot, epoch) -> [(t_ns, peer)]


def read(prefix: str) -> Dict[int, Marks]:
    """{rank: {(mark, slot, epoch): [(t_ns, peer), ...]}} from every file of `prefix` (all files of
    a rank merged: a process may have run several communicators under one prefix)."""
    out: Dict[int, Marks] = {}
    for path in sorted(glob.glob(glob.escape(prefix) + ".r*.tsv")):
        with open(path) as f:
            head = f.readline().split()
            if head[:5] != ["#", "jax_moe_a2a", "proxy", "timeline", "rank"]:
                raise ValueError(f"{path}: not a proxy timeline (header {' '.join(head)!r})")
            marks = out.setdefault(int(head[5]), defaultdict(list))
            for line in f:
                t, mark, slot, epoch, peer = line.split("\t")
                marks[(mark, int(slot), int(epoch))].append((int(t), int(peer)))
    return out


def _first(m: Marks, mark, z, e):
    v = m.get((mark, z, e))
    return min(t for t, _ in v) if v else None


def _last(m: Marks, mark, z, e, to=None):
    """The latest time of `mark`; with `to`, only marks about peer `to` or about every peer (-1)."""
    v = [t for t, p in m.get((mark, z, e), ()) if to is None or p in (to, -1)]
    return max(v) if v else None


def dispatch_parts(by_rank: Dict[int, Marks], since_ns: Optional[int] = None) -> List[Dict[str, float]]:
    """Per (rank, slot, epoch) whose dispatch landed: the parts above in µs, and "transfer".
    since_ns: only steps whose COUNTS went out at or after it (e.g. the timed iterations' start)."""
    rows = []
    for r, m in by_rank.items():
        for (mark, z, e) in [k for k in m if k[0] == "d_landed"]:
            t = {k: _first(m, k, z, e) for k in ("d_counts_out", "d_priv_post", "d_counts_in", "d_over_out",
                                                  "d_rows_in", "d_landed")}
            posted = _last(m, "d_priv_posted", z, e)
            if any(v is None for v in t.values()) or posted is None:
                continue  # a step cut by close() or not recorded
            if since_ns is not None and t["d_counts_out"] < since_ns:
                continue
            peers = [_last(pm, "d_priv_post", z, e, to=r) for p, pm in by_rank.items() if p != r]
            peer_post = max((v for v in peers if v is not None), default=None)
            over = t["d_over_out"]
            # a peer that sent us no rows posts nothing we wait for (an empty PRIV or OVER is not
            # written), so its posts may come after our rows landed: late only up to rows-in
            late = min(max(0, peer_post - over), t["d_rows_in"] - over) if peer_post is not None else 0
            parts = {"pack after COUNTS": t["d_priv_post"] - t["d_counts_out"], "posting": posted - t["d_priv_post"],
                     "peers' COUNTS": t["d_counts_in"] - posted, "OVER out": over - t["d_counts_in"],
                     "rows: peer late": late, "rows: wire": t["d_rows_in"] - over - late,
                     "landing": t["d_landed"] - t["d_rows_in"], "transfer": t["d_landed"] - t["d_counts_out"]}
            rows.append({k: v / 1e3 for k, v in parts.items()})
    return rows


def combine_parts(by_rank: Dict[int, Marks], since_ns: Optional[int] = None) -> List[Dict[str, float]]:
    """Per (rank, slot, epoch) whose combine landed: the parts above in µs, and "transfer"
    (c_comb_posted -> c_landed, the proxy's comb_to_landed); since_ns as in dispatch_parts (the
    combine's post)."""
    rows = []
    for r, m in by_rank.items():
        for (mark, z, e) in [k for k in m if k[0] == "c_landed"]:
            t = {k: _first(m, k, z, e) for k in ("c_comb_post", "c_comb_posted", "c_comb_in", "c_landed")}
            if any(v is None for v in t.values()):
                continue
            if since_ns is not None and t["c_comb_post"] < since_ns:
                continue
            peers = [_last(pm, "c_comb_post", z, e, to=r) for p, pm in by_rank.items() if p != r]
            peer_post = max((v for v in peers if v is not None), default=None)
            late = max(0, peer_post - t["c_comb_posted"]) if peer_post is not None else 0
            parts = {"posting": t["c_comb_posted"] - t["c_comb_post"], "rows: peer late": late,
                     "rows: wire": t["c_comb_in"] - t["c_comb_posted"] - late,
                     "landing": t["c_landed"] - t["c_comb_in"], "transfer": t["c_landed"] - t["c_comb_posted"]}
            rows.append({k: v / 1e3 for k, v in parts.items()})
    return rows


def summarize(by_rank: Dict[int, Marks], since_ns: Optional[int] = None) -> Dict[str, Dict]:
    """{"dispatch" | "combine": {"steps": n, "p50_us": {part: p50 over every rank's steps},
    "mean_us": {...}}} over the steps that started at or after since_ns (None: all). The p50s of
    the parts need not add up to the p50 of the transfer; their means do."""
    out = {}
    for op, rows, parts in (("dispatch", dispatch_parts(by_rank, since_ns), DISPATCH_PARTS),
                            ("combine", combine_parts(by_rank, since_ns), COMBINE_PARTS)):
        if not rows:
            out[op] = {"steps": 0}
            continue
        keys = parts + ("transfer",)
        out[op] = {"steps": len(rows),
                   "p50_us": {k: statistics.median(r[k] for r in rows) for k in keys},
                   "mean_us": {k: statistics.fmean(r[k] for r in rows) for k in keys}}
    return out


def named(summary: Dict[str, Dict], op: str) -> Dict[str, float]:
    """One op's mean transfer grouped by cause (means, so that they add up to the mean transfer):
    our packer after it published ("pack after COUNTS"), the peers ("peers' COUNTS", "rows: peer
    late"), the proxy's own calls (posting, OVER out, landing: they may wait behind the transport's
    copies) and the rows on the wire."""
    m = summary[op]["mean_us"]
    if op == "dispatch":
        return {"our packer": m["pack after COUNTS"], "peers": m["peers' COUNTS"] + m["rows: peer late"],
                "proxy calls": m["posting"] + m["OVER out"] + m["landing"], "rows": m["rows: wire"]}
    # the combine's transfer starts after its posting
    return {"peers": m["rows: peer late"], "proxy calls": m["landing"], "rows": m["rows: wire"]}


def describe(summary: Dict[str, Dict], raw_wire_us: Optional[Dict[str, Optional[float]]] = None) -> List[str]:
    """Report lines: each op's parts, p50 (mean) µs over every rank's steps; with raw_wire_us ({op:
    one raw write of one peer's message, µs}) also the transfer by cause and the rows against it."""
    lines = []
    for op, parts in (("dispatch", DISPATCH_PARTS), ("combine", COMBINE_PARTS)):
        s = summary.get(op, {})
        if not s.get("steps"):
            lines.append(f"  timeline {op}: no complete steps recorded")
            continue
        body = " | ".join(f"{k} {s['p50_us'][k]:.1f} ({s['mean_us'][k]:.1f})" for k in parts)
        lines.append(f"  timeline {op} (p50 (mean) µs over {s['steps']} steps of every rank): {body} "
                     f"= transfer {s['p50_us']['transfer']:.1f} ({s['mean_us']['transfer']:.1f})")
        raw = (raw_wire_us or {}).get(op)
        if raw:
            g = named(summary, op)
            lines.append(f"    by cause (means): " + " + ".join(f"{k} {v:.1f}" for k, v in g.items())
                         + f" = {s['mean_us']['transfer']:.1f} µs; rows / one raw write of a peer's message "
                           f"({raw:.1f} µs) = {g['rows'] / raw:.2f}x")
    return lines


CYCLE_PARTS = ("dispatch transfer", "to dispatch_recv", "to combine post", "combine posting", "combine transfer",
               "to combine_recv", "to next COUNTS")


def cycle_parts(by_rank: Dict[int, Marks], skip: int = 0) -> List[Dict[str, float]]:
    """A model's loop (dispatch, local compute, combine, next layer's dispatch) cut per rank into
    what the proxy saw, µs, one row per dispatch whose combine landed and whose next dispatch sent
    its COUNTS (the last of a run has no next), after the first `skip` of each rank:
      dispatch transfer   d_counts_out -> d_landed (the parts above)
      to dispatch_recv    -> d_consumed: our dispatch_recv kernel noticed the landing and consumed
      to combine post     -> c_comb_post: the local compute and our combine_send kernel's packing
      combine posting     -> c_comb_posted
      combine transfer    -> c_landed
      to combine_recv     -> c_consumed: our combine_recv kernel noticed
      to next COUNTS      -> the next d_counts_out: the next layer's router and dispatch_send up to
                             its counts (and the proxy's reaction)
    and "period" (one d_counts_out to the next): the parts add up to it. A combine belongs to the
    dispatch of its (slot, epoch)."""
    rows = []
    for r, m in by_rank.items():
        starts = sorted((_first(m, "d_counts_out", z, e), z, e) for (mark, z, e) in m if mark == "d_counts_out")
        for i, (t0, z, e) in enumerate(starts[:-1]):
            if i < skip:
                continue
            t = [t0] + [_first(m, k, z, e) for k in ("d_landed", "d_consumed", "c_comb_post", "c_comb_posted",
                                                     "c_landed", "c_consumed")]
            nxt = starts[i + 1][0]
            if any(v is None for v in t) or nxt < t[-1]:
                continue  # cut by close(), or the next dispatch overlapped this one's combine (several in flight)
            t.append(nxt)
            row = {k: (t[j + 1] - t[j]) / 1e3 for j, k in enumerate(CYCLE_PARTS)}
            row["period"] = (nxt - t0) / 1e3
            rows.append(row)
    return rows


def describe_cycle(rows: List[Dict[str, float]]) -> List[str]:
    """One report line: each cycle part's p50 (mean) µs and the period they add up to (means)."""
    if not rows:
        return ["  timeline cycle: no complete layer recorded (dispatches overlapping their combines are left out)"]
    body = " | ".join(f"{k} {statistics.median(r[k] for r in rows):.1f} ({statistics.fmean(r[k] for r in rows):.1f})"
                      for k in CYCLE_PARTS)
    return [f"  timeline cycle (p50 (mean) µs over {len(rows)} layers of every rank): {body} = period "
            f"{statistics.median(r['period'] for r in rows):.1f} ({statistics.fmean(r['period'] for r in rows):.1f})"]


def main(argv=None) -> int:
    """python -m benchlib.proxy_timeline PREFIX [--skip N]: every rank's files of PREFIX cut into
    the transfers' parts and a model loop's cycle (the first N layers of each rank left out)."""
    import argparse
    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("prefix")
    p.add_argument("--skip", type=int, default=0, help="leave out each rank's first N dispatches (warm-up)")
    a = p.parse_args(argv)
    by_rank = read(a.prefix)
    if not by_rank:
        print(f"no timeline files at {a.prefix}.r*.tsv")
        return 1
    since = None
    if a.skip:  # the transfers from the (skip+1)-th COUNTS of the latest-starting rank on
        firsts = [sorted(t for (mark, z, e), v in m.items() if mark == "d_counts_out" for t, _ in v)
                  for m in by_rank.values()]
        since = max(f[min(a.skip, len(f) - 1)] for f in firsts if f)
    for line in describe(summarize(by_rank, since)) + describe_cycle(cycle_parts(by_rank, a.skip)):
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
