"""pplx-kernels' halves at the decode shape, from the anchor kit (carried to the GPU machine as
.devdeps/pplx_anchor): its run.sh writes pplx_N.json for N processes on one GPU.

Kernel families and what they anchor: `intra-sync` (CUDA IPC, plus a barrier before combine
send; `intra` without it) is the anchor of our cuda backend, `inter` (NVSHMEM) of our nvshmem
backend. The numbers are PE 0's CUDA-event times of each half (pplx's loop); ours are CUDA-event
times too, max over ranks."""

from __future__ import annotations

import json
import os

ANCHOR_OF = {"cuda": ("intra-sync", "intra"), "nvshmem": ("inter",)}
KEYS = ("dispatch_send", "dispatch_recv", "combine_send", "combine_recv")


def load(folder: str, num_processes: int) -> dict:
    """{"file", "rows": [{"kernel", "anchor_of", "num_pes", "tokens", "hidden", "check", "halves": {half: stats}}]}
    for pplx_<num_processes>.json in `folder` ({"error": ...} when absent or unreadable)."""
    path = os.path.join(folder, f"pplx_{num_processes}.json")
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        return {"file": path, "error": f"{type(e).__name__}: {e}", "rows": []}
    rows = []
    for r in data.get("results", []):
        if r.get("m_mode") != "fixed":  # m = T on every rank, as in our benchmark
            continue
        of = next((b for b, kernels in ANCHOR_OF.items() if r.get("kernel") in kernels), None)
        halves = {h: {k: r[h]["pe0"][k] for k in ("p50_us", "p99_us", "mean_us", "stddev_us")}
                  for h in KEYS if h in r}
        rows.append({"kernel": r.get("kernel"), "anchor_of": of, "num_pes": r.get("num_pes"),
                     "tokens": r.get("tokens_per_rank"), "hidden": r.get("hidden"), "experts": r.get("num_experts"),
                     "topk": r.get("topk"), "check": r.get("check"), "halves": halves})
    meta = {k: data.get(k) for k in ("pplx_commit", "device", "nvshmem", "num_pes")}
    return {"file": path, "meta": meta, "rows": rows}


def best_row(anchor: dict, backend: str, spec: dict) -> "dict | None":
    """The anchor row for our backend at our shape (T, H, E, K equal), preferring intra-sync."""
    for kernel in ANCHOR_OF.get(backend, ()):
        for r in anchor.get("rows", []):
            if (r["kernel"] == kernel and r["tokens"] == spec["T"] and r["hidden"] == spec["H"]
                    and r["experts"] == spec["E"] and r["topk"] == spec["K"]):
                return r
    return None
