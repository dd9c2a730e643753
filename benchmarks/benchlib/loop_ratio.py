"""Issue 35's end-to-end measure from benchmarks/layers.py results: the proxy path's loop (dispatch
+ combine per layer as a model runs them) against the raw exchange of the bytes its proxies wrote
(measured in the same processes: layers.py --raw-wire) plus the same loop on the path without a
wire (the NVLink path on GPUs, the node-local path on CPUs):

    ratio = proxy loop µs/layer / (raw exchange µs + local loop µs/layer)

by the loops' medians, and by their repeats' minima (loops drift between process starts).

One layers.py result (an element of layers.json's "results") holds per_layer_us {p50, min, ...};
a proxied one also raw_exchange {op: {p50_us, bytes_max, ...}}, and with --env-variants env
("NODE_SIZE=1", the variable's prefix dropped) and round (from 0).

Command line (scripts/gpu_proxy_mps.sh's layers stage and scripts/gpu_check.sh's cpuproxy stage):
    python -m benchlib.loop_ratio gpu PROXY_JSON NVLINK_JSON
    python -m benchlib.loop_ratio cpu PREFIX ROUNDS N
`gpu` prints a line per proxied result (each variant and round) against the NVLink loop; `cpu`
reads PREFIX-same/layers.json (both paths as variants of one process, NODE_SIZE=1 and NODE_SIZE=N)
and PREFIX-local<r> / PREFIX-proxied<r> (separate process starts, r = 1..ROUNDS).
"""

from __future__ import annotations

import json
import sys
from typing import List, Optional

from benchlib import raw_exchange


def wire_us(proxied: dict) -> float:
    """The raw exchange of one layer's bytes: the dispatch's and the combine's p50 µs, summed."""
    return raw_exchange.total_us(proxied["raw_exchange"])


def ratio(proxied: dict, local: dict, minima: bool = False) -> float:
    """proxy loop / (raw exchange + local loop), by the medians (or the repeats' minima)."""
    k = "min" if minima else "p50"
    return proxied["per_layer_us"][k] / (wire_us(proxied) + local["per_layer_us"][k])


def describe(proxied: dict, local: dict, local_name: str, minima: bool = True) -> str:
    """One line: the parts and the ratio; minima: the ratio by the repeats' minima beside it."""
    a, b, w = proxied["per_layer_us"]["p50"], local["per_layer_us"]["p50"], wire_us(proxied)
    text = (f"proxy loop {a:.1f} µs/layer / (raw exchange {w:.1f} + {local_name} loop {b:.1f}) = "
            f"{ratio(proxied, local):.2f}x")
    if minima:
        text += f"; by the repeats' minima {ratio(proxied, local, minima=True):.2f}x"
    return text


def gpu_lines(proxy_results: List[dict], nvlink: dict) -> List[str]:
    """A line per proxied result (each --env-variants variant and round) against the NVLink loop."""
    out = []
    for px in proxy_results:
        tag = f" [{px['env']}, round {px['round'] + 1}]" if "env" in px else ""
        parts = ", ".join(f"{op} {v['p50_us']:.1f} µs, {v['bytes_max'] / 1e6:.2f} MB" for op, v in px["raw_exchange"].items())
        out.append(f"issue 35, N = {px['ranks']}{tag}: {describe(px, nvlink, 'NVLink', minima=False)} ({parts})")
    return out


def _load(path: str) -> List[dict]:
    with open(path) as f:
        return json.load(f)["results"]


def cpu_lines(prefix: str, rounds: int, n: int) -> List[str]:
    """The cpuproxy stage's lines: per round, the one-process pair (variants NODE_SIZE=1 / =n of
    PREFIX-same) and the n-process proxied loop against the one-process node-local loop. A missing
    or broken result gives an "n/a" line naming why, not an exception."""
    out = []
    try:
        res = _load(f"{prefix}-same/layers.json")
        for r in range(rounds):
            px = next(x for x in res if x.get("round") == r and x.get("env") == "NODE_SIZE=1")
            loc = next(x for x in res if x.get("round") == r and x.get("env") == f"NODE_SIZE={n}")
            out.append(f"issue 35 (CPU), N = {n}, same process, round {r + 1}: {describe(px, loc, 'node-local')}")
    except Exception as e:  # a run that failed or timed out: say so, keep going
        out.append(f"issue 35 (CPU), same process: n/a ({type(e).__name__}: {e})")
    for r in range(1, rounds + 1):
        try:
            loc, px = _load(f"{prefix}-local{r}/layers.json")[0], _load(f"{prefix}-proxied{r}/layers.json")[0]
            out.append(f"issue 35 (CPU), N = {n}, {n} processes against one, round {r}: {describe(px, loc, 'node-local')}")
        except Exception as e:
            out.append(f"issue 35 (CPU), processes, round {r}: n/a ({type(e).__name__}: {e})")
    return out


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        if argv[:1] == ["gpu"] and len(argv) == 3:
            lines = gpu_lines(_load(argv[1]), _load(argv[2])[0])
        elif argv[:1] == ["cpu"] and len(argv) == 4:
            lines = cpu_lines(argv[1], int(argv[2]), int(argv[3]))
        else:
            print(__doc__.split("Command line")[1], file=sys.stderr)
            return 2
    except Exception as e:  # the GPU form: one missing file ends it, named
        lines = [f"issue 35 ratio: n/a ({type(e).__name__}: {e})"]
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
