"""PNG plots of a results.json: p50 bars with p99 whiskers per half, one panel per shape."""

from __future__ import annotations

import os

HALVES = ("dispatch_send", "dispatch_recv", "combine_send", "combine_recv", "dispatch", "combine")


def plot(results: dict, out_dir: str) -> list:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    rows = [r for r in results["results"] if "timings" in r]
    shapes = sorted({r["shape"] for r in rows}, key=lambda s: ["decode", "prefill"].index(s)
                    if s in ("decode", "prefill") else 9)
    if not shapes:
        return []
    backends = sorted({r["backend"] for r in rows})
    fig, axes = plt.subplots(1, len(shapes), figsize=(7 * len(shapes), 4.5), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        width = 0.8 / max(1, len(backends))
        for i, b in enumerate(backends):
            r = next((r for r in rows if r["shape"] == shape and r["backend"] == b), None)
            if r is None:
                continue
            p50 = [r["timings"].get(h, {}).get("p50_us", 0) for h in HALVES]
            p99 = [r["timings"].get(h, {}).get("p99_us", 0) for h in HALVES]
            x = np.arange(len(HALVES)) + i * width
            ax.bar(x, p50, width, label=b)
            ax.errorbar(x, p50, yerr=[np.zeros(len(p50)), np.maximum(0, np.subtract(p99, p50))],
                        fmt="none", ecolor="black", capsize=3)
        ax.set_xticks(np.arange(len(HALVES)) + 0.4 - width / 2)
        ax.set_xticklabels(HALVES, rotation=25, ha="right")
        spec = rows[0]["spec"] if rows else {}
        r0 = next(r for r in rows if r["shape"] == shape)
        ax.set_title(f"{shape}: T={r0['spec']['T']} H={r0['spec']['H']} E={r0['spec']['E']} "
                     f"K={r0['spec']['K']}, {r0['ranks']} ranks")
        ax.set_ylabel("latency, µs (bar p50, whisker p99)")
        ax.set_yscale("log")
        ax.legend()
        del spec
    meta = results.get("meta", {})
    fig.suptitle(f"jax_moe_a2a on {meta.get('platform', '?')} ({meta.get('device_kind', '?')}), "
                 f"{meta.get('date', '')} commit {meta.get('commit', '?')}")
    fig.tight_layout()
    path = os.path.join(out_dir, "latency.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]
