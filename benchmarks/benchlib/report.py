"""Tables and PNG plots of the halves and layer benchmarks' results (plain Python: no JAX)."""

from __future__ import annotations

import json
import os

from . import HALVES

SHAPE_ORDER = ("decode", "prefill")


def _shapes(rows):
    return sorted({r["shape"] for r in rows}, key=lambda s: SHAPE_ORDER.index(s) if s in SHAPE_ORDER else 9)


def _shape_note(rows, shape):
    r = next((r for r in rows if r["shape"] == shape and "spec" in r), None)
    if r is None:
        return shape
    s = r["spec"]
    return (f"{shape}: T={s['T']} H={s['H']} E={s['E']} K={s['K']}, {r['ranks']} ranks"
            + (f", x {r['x_dtype']}" if r.get("x_dtype") else "")
            + (f", rows received as {s['recv_dtype']}" if s.get("recv_dtype") else "")
            + (", scaled down for CPUs" if r.get("scaled") else ""))


def _ok(r):
    return "timings" in r and not str(r.get("check", "")).startswith("FAILED")


def print_halves(out: dict) -> None:
    rows = out["results"]
    meta = out.get("meta", {})
    print(f"\n== halves: p50/p99 µs per half, one jitted call each from Python (wall), max over ranks; "
          f"{meta.get('platform', '?')} ({meta.get('device_kind', '?')}), {meta.get('iters', '?')} iterations ==")
    for b, why in out.get("skipped", {}).items():
        print(f"skipped {b}: {why}")
    anchor = out.get("anchor") or {}
    if anchor.get("error"):
        print(f"pplx anchor: not merged ({anchor['error']})")
    hdr = (f"{'backend':<18} {'check':<5} " + " ".join(f"{h:>15}" for h in HALVES)
           + f" {'vs ref':>7} {'disp GB/s':>9} {'comb GB/s':>9} {'buffer MiB':>10}")
    for shape in _shapes(rows):
        mine = [r for r in rows if r["shape"] == shape]
        print(f"\n-- {_shape_note(mine, shape)}")
        print(hdr)
        ref = next((r for r in mine if r["backend"] == "reference" and _ok(r)), None)
        for r in mine:
            if "timings" not in r:
                print(f"{r['backend']:<18} {'-':<5} {r.get('error', '')[:160]}")
                continue
            t = r["timings"]
            chk = "ok" if r["check"] == "ok" else ("skip" if r["check"] == "skipped" else "FAIL")
            cells = " ".join(f"{t[h]['p50_us']:>7.0f}/{t[h]['p99_us']:<7.0f}" for h in HALVES)
            tot = t["dispatch"]["p50_us"] + t["combine"]["p50_us"]
            vs = (f"{(ref['timings']['dispatch']['p50_us'] + ref['timings']['combine']['p50_us']) / tot:>6.2f}x"
                  if ref and tot else f"{'':>7}")
            g = r.get("goodput_GBps", {})
            print(f"{r['backend'] + ' (wall)':<18} {chk:<5} {cells} {vs} {g.get('dispatch', 0):>9.2f} "
                  f"{g.get('combine', 0):>9.2f} {r['buffer_bytes_per_rank'] / 2**20:>10.1f}")
            kt = r.get("kernel_timings")
            if kt:  # CUDA-event time of each half's kernel alone
                cells = " ".join(f"{kt[h]['p50_us']:>7.1f}/{kt[h]['p99_us']:<7.1f}" for h in HALVES[:4])
                kg = r.get("kernel_goodput_GBps", {})
                print(f"{r['backend'] + ' (kernel)':<18} {'':<5} {cells} {'':>31} {'':>7} "
                      f"{kg.get('dispatch', 0):>9.2f} {kg.get('combine', 0):>9.2f}")
            kt_turns = r.get("kernel_turns")
            if kt_turns:  # the same with the GPU to itself (processes taking turns)
                cells = " ".join(f"{kt_turns[h]['p50_us']:>7.1f}/{kt_turns[h]['p99_us']:<7.1f}" for h in HALVES[:4])
                print(f"{r['backend'] + ' (turns)':<18} {'':<5} {cells}")
            a = r.get("anchor_row")
            if a:
                h = a["halves"]
                cells = " ".join(f"{h[x]['p50_us']:>7.1f}/{h[x]['p99_us']:<7.1f}" if x in h else f"{'-':>15}"
                                 for x in HALVES[:4])
                print(f"{'pplx ' + a['kernel']:<18} {str(a['check'])[:5]:<5} {cells}")
                ours = kt or t
                what = "kernel" if kt else "wall"
                cells = " ".join(f"{ours[x]['p50_us'] / h[x]['p50_us']:>14.2f}x" if x in h and h[x]['p50_us']
                                 else f"{'-':>15}" for x in HALVES[:4])
                print(f"{'  ours/pplx p50':<18} {what[:5]:<5} {cells}")
        if any("kernel_timings" in r for r in mine):
            mode = meta.get("kernel_timing", "1")
            print("(kernel) rows: CUDA events around our kernel alone (JAX_MOE_A2A_KERNEL_TIMING="
                  f"{mode}{', each launch behind a GPU-side barrier' if str(mode) in ('1', 'True') else ''}, "
                  "command buffers off)")
        if any("kernel_turns" in r for r in mine):
            print("(turns) rows: the same CUDA-event times with the processes taking turns, one kernel on the GPU "
                  "at a time (--turns)")
        if any(r.get("anchor_row") for r in mine):
            print(f"pplx rows: pplx-kernels {anchor.get('meta', {}).get('pplx_commit', '')} at the same shape and "
                  f"process count, PE 0's CUDA-event times (pplx_N.json of the anchor kit); ratios > 1: ours slower")
    print()
    for line in fastest_lines(rows, lambda r: r["timings"]["dispatch"]["p50_us"] + r["timings"]["combine"]["p50_us"],
                              "dispatch + combine p50 (wall)"):
        print(line)


def fastest_lines(rows, key, what):
    lines = []
    for shape in _shapes(rows):
        ok = [r for r in rows if r["shape"] == shape and _ok(r)]
        if not ok:
            continue
        best = min(ok, key=key)
        ref = next((r for r in ok if r["backend"] == "reference"), None)
        vs = f", {key(ref) / key(best):.2f}x the reference backend" if ref and best is not ref and key(best) else ""
        lines.append(f"fastest at {shape}: {best['backend']} ({key(best):.0f} µs {what}{vs})")
    return lines


def _unit(max_us):
    """(factor, unit) for a plot axis: ms when the bars reach 20 ms."""
    return (1e-3, "ms") if max_us >= 2e4 else (1.0, "µs")


def plot_halves(out: dict, out_dir: str) -> list:
    """One panel per shape: p50 bars with p99 whiskers per half and backend, linear axis."""
    rows = [r for r in out["results"] if "timings" in r]
    if not rows:
        return []
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    shapes = _shapes(rows)
    backends = sorted({r["backend"] for r in rows})
    fig, axes = plt.subplots(len(shapes), 1, figsize=(11, 4.2 * len(shapes)), squeeze=False)
    for ax, shape in zip(axes[:, 0], shapes):
        width = 0.8 / max(1, len(backends))
        mine = [r for r in rows if r["shape"] == shape]
        scale, unit = _unit(max(r["timings"][h]["p99_us"] for r in mine for h in HALVES))
        for i, b in enumerate(backends):
            r = next((r for r in mine if r["backend"] == b), None)
            if r is None:
                continue
            p50 = np.array([r["timings"][h]["p50_us"] for h in HALVES]) * scale
            p99 = np.array([r["timings"][h]["p99_us"] for h in HALVES]) * scale
            x = np.arange(len(HALVES)) + (i - (len(backends) - 1) / 2) * width
            ax.bar(x, p50, width, label=b)
            ax.errorbar(x, p50, yerr=[np.zeros_like(p50), np.maximum(0, p99 - p50)], fmt="none", ecolor="black",
                        capsize=2, lw=0.8)
        ax.set_xticks(np.arange(len(HALVES)))
        ax.set_xticklabels(HALVES)
        ax.set_title(_shape_note(rows, shape))
        ax.set_ylabel(f"{unit} per call (bar p50, whisker p99)")
        ax.set_ylim(bottom=0)
        ax.grid(axis="y", alpha=0.3)
        ax.legend()
    return [_save_figure(fig, out, "halves (wall)", out_dir, "halves.png")]


# --- layers ------------------------------------------------------------------------------------
def _placement(r):
    """The shared expert's placement of a layer record: overlap, after or none."""
    return r.get("placement") or ("overlap" if r["overlap"] else ("after" if r.get("shared", True) else "none"))


def _variant(r):
    return (r["experts"], _placement(r), r["cmdbuf"])


def print_layers(out: dict) -> None:
    rows = out["results"]
    meta = out.get("meta", {})
    first = next((r for r in rows if "per_layer_us" in r), {})
    print(f"\n== layers: µs per MoE layer (dispatch -> experts -> combine), {first.get('layers', '?')} layers "
          f"unrolled in one jax.jit, {first.get('steps', '?')} back-to-back steps per repeat, p50 (min) over "
          f"{first.get('repeats', '?')} repeats; {meta.get('platform', '?')} ({meta.get('device_kind', '?')}) ==")
    for b, why in out.get("skipped", {}).items():
        print(f"skipped {b}: {why}")
    for shape in _shapes(rows):
        mine = [r for r in rows if r["shape"] == shape]
        print(f"\n-- {_shape_note(mine, shape)}; experts F={mine[0].get('ffn', '?')}; dispatch {mine[0].get('dispatch_dtype', 'fp8')}; routing {mine[0].get('routing', 'fixed')}")
        print(f"{'backend':<11} {'experts':<11} {'shared':<10} {'cmdbuf':<6} {'µs/layer p50':>12} {'(min)':>9} "
              f"{'vs ref':>7} {'vs plain':>8} {'GB/s':>7} {'enqueue':>8}")
        for r in mine:
            if "per_layer_us" not in r:
                print(f"{r['backend']:<11} {r.get('experts', ''):<11} {'':<10} {r.get('cmdbuf', ''):<6} "
                      f"{r.get('error', '')[:150]}")
                continue
            ref = next((q for q in mine if q["backend"] == "reference" and _variant(q) == _variant(r)
                        and "per_layer_us" in q), None)
            plain = next((q for q in mine if q["backend"] == "plain" and _variant(q) == _variant(r)
                          and "per_layer_us" in q), None)
            us = r["per_layer_us"]["p50"]
            vs = f"{ref['per_layer_us']['p50'] / us:>6.2f}x" if ref and r["backend"] != "plain" else f"{'':>7}"
            vp = f"{us / plain['per_layer_us']['p50']:>7.2f}x" if plain and r["backend"] != "plain" else f"{'':>8}"
            gb = f"{r['GBps']:>7.2f}" if r.get("GBps") else f"{'':>7}"
            shared = _placement(r)
            enq = f"{r['enqueue_us_per_layer']:>8.1f}" if r.get("enqueue_us_per_layer") is not None else f"{'':>8}"
            print(f"{r['backend']:<11} {r['experts']:<11} {shared:<10} {r['cmdbuf']:<6} {us:>12.1f} "
                  f"{r['per_layer_us']['min']:>9.1f} {vs} {vp} {gb} {enq}")
    print("vs ref: the reference backend's time / this one's (> 1: faster); vs plain: this time / the plain-XLA "
          "layer's (the same local compute without communication: the cost of the exchange); GB/s: dispatch + "
          "combine payload per rank / layer time; enqueue: µs per layer the host took to hand the steps to "
          "the runtime (p50; near µs/layer: the host sets the pace)")
    print()
    traced = [r for r in rows if (r.get("device") or {}).get("busy_us") is not None]
    if traced:
        print("device trace (--trace; µs per layer): busy = the union of kernel intervals, span = first kernel "
              "start to last kernel end / steps, gap = span - busy (device idle: the host sets the pace)")
        for r in traced:
            d = r["device"]
            print(f"  {r['backend']:<11} {r['shape']:<8} {r['experts']:<11} {_placement(r):<10} {r['cmdbuf']:<6} "
                  f"busy {d['busy_us']:>8.1f}  span {d['span_us']:>8.1f}  gap {d['gap_us']:>8.1f}")
            for k in d["kernels"][:8]:
                print(f"      {k['us']:>8.2f} µs  x{k['calls_per_step']:<5g} {k['name']}")
    for line in layer_fastest(rows):
        print(line)


def layer_fastest(rows):
    lines = []
    for shape in _shapes(rows):
        ok = [r for r in rows if r["shape"] == shape and "per_layer_us" in r and r["backend"] != "plain"]
        if not ok:
            continue
        # the layer with real experts (grouped: fp8 SwiGLU through expert_mlp) is the headline
        for experts in sorted({r["experts"] for r in ok}, key=lambda e: (e != "grouped", e)):
            sel = [r for r in ok if r["experts"] == experts]
            best = min(sel, key=lambda r: r["per_layer_us"]["p50"])
            ref = [r for r in sel if r["backend"] == "reference" and _variant(r) == _variant(best)]
            vs = (f", {ref[0]['per_layer_us']['p50'] / best['per_layer_us']['p50']:.2f}x the reference backend"
                  if ref and best["backend"] != "reference" else "")
            xla = [r for r in rows if r["shape"] == shape and r["backend"] == "plain" and "per_layer_us" in r
                   and r["experts"] == "ragged_dot" and _placement(r) == _placement(best)
                   and r["cmdbuf"] == best["cmdbuf"]]
            if experts == "grouped" and xla:
                vs += (f", {xla[0]['per_layer_us']['p50'] / best['per_layer_us']['p50']:.2f}x the plain-XLA layer "
                       f"with bf16 ragged_dot experts")
            if best.get("expert_impl"):
                vs += f"; expert GEMMs: {best['expert_impl']}"
            shared = {"overlap": "shared expert overlapped", "after": "shared expert after combine",
                      "none": "no shared expert"}[_placement(best)]
            lines.append(f"fastest MoE layer at {shape}, {experts} experts: {best['backend']} "
                         f"({best['per_layer_us']['p50']:.1f} µs/layer, {shared}, command buffers {best['cmdbuf']}{vs})")
    return lines


def plot_layers(out: dict, out_dir: str) -> list:
    rows = [r for r in out["results"] if "per_layer_us" in r]
    if not rows:
        return []
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    shapes = _shapes(rows)
    backends = sorted({r["backend"] for r in rows}, key=lambda b: (b == "plain", b))
    fig, axes = plt.subplots(len(shapes), 1, figsize=(11, 4.2 * len(shapes)), squeeze=False)
    for ax, shape in zip(axes[:, 0], shapes):
        mine = [r for r in rows if r["shape"] == shape]
        variants = sorted({_variant(r) for r in mine})
        scale, unit = _unit(max(r["per_layer_us"]["p50"] for r in mine))
        width = 0.8 / max(1, len(backends))
        for i, b in enumerate(backends):
            vals = []
            for v in variants:
                r = next((r for r in mine if r["backend"] == b and _variant(r) == v), None)
                vals.append(r["per_layer_us"]["p50"] * scale if r else np.nan)
            x = np.arange(len(variants)) + (i - (len(backends) - 1) / 2) * width
            ax.bar(x, vals, width, label=b)
        ax.set_xticks(np.arange(len(variants)))
        ax.set_xticklabels([f"{e}\nshared {o}\ncmdbuf {c}" for e, o, c in variants], fontsize=8)
        ax.set_title(_shape_note(mine, shape))
        ax.set_ylabel(f"{unit} per layer (p50)")
        ax.set_ylim(bottom=0)
        ax.grid(axis="y", alpha=0.3)
        ax.legend()
    return [_save_figure(fig, out, "MoE layer", out_dir, "layers.png")]


def _save_figure(fig, out, what, out_dir, name):
    """Titles the figure with the run's platform, device, date and commit, writes out_dir/name."""
    import matplotlib.pyplot as plt
    meta = out.get("meta", {})
    fig.suptitle(f"jax_moe_a2a {what} on {meta.get('platform', '?')} ({meta.get('device_kind', '?')}), "
                 f"{meta.get('date', '')} commit {meta.get('commit', '?')}")
    fig.tight_layout()
    path = os.path.join(out_dir, name)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_and_show(out, out_dir, name, print_fn, plot_fn, no_plot):
    """out_dir/name (the run's JSON), the table on stdout, the plots unless no_plot."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, name)
    with open(path, "w") as f:
        json.dump(out, f, indent=2)
    print_fn(out)
    pngs = [] if no_plot else plot_fn(out, out_dir)
    print(f"wrote {path} " + " ".join(pngs))
