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


def _count_range(counts, default) -> str:
    """'7' or '5-50': the sample counts of a run's records (--min-time makes them differ)."""
    c = sorted({int(n) for n in counts if n})
    if not c:
        return str(default if default is not None else "?")
    return str(c[0]) if len(c) == 1 else f"{c[0]}-{c[-1]}"


def _pair_us(r, q):
    """dispatch + combine µs of a halves record at percentile q (10, 50, 90); records written before
    p10/p90 were kept give their p50 (no spread)."""
    t = r["timings"]
    return sum(t[op].get(f"p{q}_us", t[op]["p50_us"]) for op in ("dispatch", "combine"))


def ratio_spread(ref_lo, ref_mid, ref_hi, lo, mid, hi):
    """(ratio, low, high) of ref / this: the middle values' ratio and the widest the spreads allow
    (ref's low over this one's high, ref's high over this one's low); None where undefined."""
    if not (mid and lo and hi):
        return None
    return ref_mid / mid, ref_lo / hi, ref_hi / lo


def _fmt_ratio(rs, width=0):
    if rs is None:
        return f"{'':>{width}}"
    if rs[1] == rs[2]:   # one sample each: no spread to give
        return f"{rs[0]:.2f}x".rjust(width)
    return f"{rs[0]:.2f}x ({rs[1]:.2f}-{rs[2]:.2f})".rjust(width)


def _vs_ref_words(rs):
    if rs[1] == rs[2]:
        return f", {rs[0]:.2f}x the reference backend (one sample: no spread)"
    return f", {rs[0]:.2f}x the reference backend ({rs[1]:.2f}-{rs[2]:.2f}x within the spread)"


def halves_ratio(ref, r):
    """ref / r of dispatch + combine: p50 over p50, spread p10..p90 against p90..p10."""
    return ratio_spread(_pair_us(ref, 10), _pair_us(ref, 50), _pair_us(ref, 90),
                        _pair_us(r, 10), _pair_us(r, 50), _pair_us(r, 90))


def print_halves(out: dict) -> None:
    rows = out["results"]
    meta = out.get("meta", {})
    print(f"\n== halves: p50/p99 µs per half, one jitted call each from Python (wall), max over ranks; "
          f"{meta.get('platform', '?')} ({meta.get('device_kind', '?')}), "
          f"{_count_range([t.get('iters') for r in rows for t in r.get('timings', {}).values()], meta.get('iters'))} "
          "iterations ==")
    print("vs ref: the reference backend's dispatch + combine p50 / this one's (> 1: faster), and in "
          "parentheses the range its p10..p90 spread allows (ref p10 / this p90 .. ref p90 / this p10)")
    for b, why in out.get("skipped", {}).items():
        print(f"skipped {b}: {why}")
    anchor = out.get("anchor") or {}
    if anchor.get("error"):
        print(f"pplx anchor: not merged ({anchor['error']})")
    hdr = (f"{'backend':<18} {'check':<5} " + " ".join(f"{h:>15}" for h in HALVES)
           + f" {'vs ref (p10-p90 range)':>24} {'disp GB/s':>9} {'comb GB/s':>9} {'buffer MiB':>10}")
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
            vs = _fmt_ratio(halves_ratio(ref, r) if ref and ref is not r else None, 24)
            g = r.get("goodput_GBps", {})
            print(f"{r['backend'] + ' (wall)':<18} {chk:<5} {cells} {vs} {g.get('dispatch', 0):>9.2f} "
                  f"{g.get('combine', 0):>9.2f} {r['buffer_bytes_per_rank'] / 2**20:>10.1f}")
            kt = r.get("kernel_timings")
            if kt:  # CUDA-event time of each half's kernel alone
                cells = " ".join(f"{kt[h]['p50_us']:>7.1f}/{kt[h]['p99_us']:<7.1f}" for h in HALVES[:4])
                kg = r.get("kernel_goodput_GBps", {})
                print(f"{r['backend'] + ' (kernel)':<18} {'':<5} {cells} {'':>31} {'':>24} "
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
    for line in fastest_lines(rows, lambda r: _pair_us(r, 50), "dispatch + combine p50 (wall)", halves_ratio):
        print(line)


def fastest_lines(rows, key, what, ratio):
    """One line per shape naming the fastest backend by key(record), with ratio(ref, best):
    (ratio, low, high) against the reference backend."""
    lines = []
    for shape in _shapes(rows):
        ok = [r for r in rows if r["shape"] == shape and _ok(r)]
        if not ok:
            continue
        best = min(ok, key=key)
        ref = next((r for r in ok if r["backend"] == "reference"), None)
        rs = ratio(ref, best) if ref and best is not ref else None
        vs = _vs_ref_words(rs) if rs else ""
        lines.append(f"fastest at {shape}: {best['backend']} ({key(best):.0f} µs {what}{vs})")
    return lines


def _unit(max_us):
    """(factor, unit) for a plot axis: ms when the bars reach 20 ms."""
    return (1e-3, "ms") if max_us >= 2e4 else (1.0, "µs")


def plot_halves(out: dict, out_dir: str) -> list:
    """One panel per shape: p50 bars with p10..p90 whiskers per half and backend, on a log axis
    (on CPUs the backends differ by 10x and more: a linear axis hides the fast ones)."""
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
        iters = set()
        for i, b in enumerate(backends):
            r = next((r for r in mine if r["backend"] == b), None)
            if r is None:
                continue
            t = r["timings"]
            p50 = np.array([t[h]["p50_us"] for h in HALVES]) * scale
            p10 = np.array([t[h].get("p10_us", t[h]["p50_us"]) for h in HALVES]) * scale
            p90 = np.array([t[h].get("p90_us", t[h]["p50_us"]) for h in HALVES]) * scale
            iters.update(t[h].get("iters", 0) for h in HALVES)
            x = np.arange(len(HALVES)) + (i - (len(backends) - 1) / 2) * width
            ref = next((q for q in mine if q["backend"] == "reference" and _ok(q)), None)
            rs = halves_ratio(ref, r) if ref and ref is not r and _ok(r) else None
            ax.bar(x, p50, width, label=b + (f" ({_fmt_ratio(rs)} vs reference)" if rs else ""))
            ax.errorbar(x, p50, yerr=[np.maximum(0, p50 - p10), np.maximum(0, p90 - p50)], fmt="none",
                        ecolor="black", capsize=2, lw=0.8)
        ax.set_yscale("log")
        ax.set_xticks(np.arange(len(HALVES)))
        ax.set_xticklabels(HALVES)
        ax.set_title(_shape_note(rows, shape))
        n = "/".join(str(i) for i in sorted(iters)) or "?"
        ax.set_ylabel(f"{unit} per call, log scale\n(bar p50, whisker p10-p90 of {n} iterations)")
        ax.grid(axis="y", which="both", alpha=0.3)
        ax.legend(fontsize=8)
    return [_save_figure(fig, out, "halves (wall)", out_dir, "halves.png")]


# --- layers ------------------------------------------------------------------------------------
def _placement(r):
    """The shared expert's placement of a layer record: overlap, after or none."""
    return r.get("placement") or ("overlap" if r["overlap"] else ("after" if r.get("shared", True) else "none"))


def _variant(r):
    return (r["experts"], _placement(r), r["cmdbuf"], r.get("env"), r.get("round"))


def print_layers(out: dict) -> None:
    rows = out["results"]
    meta = out.get("meta", {})
    first = next((r for r in rows if "per_layer_us" in r), {})
    print(f"\n== layers: µs per MoE layer (dispatch -> experts -> combine), {first.get('layers', '?')} layers "
          f"unrolled in one jax.jit, {first.get('steps', '?')} back-to-back steps per repeat, p50 (min) over "
          f"{_count_range([r.get('repeats') for r in rows], meta.get('repeats'))} repeats; "
          f"{meta.get('platform', '?')} ({meta.get('device_kind', '?')}) ==")
    for b, why in out.get("skipped", {}).items():
        print(f"skipped {b}: {why}")
    for shape in _shapes(rows):
        mine = [r for r in rows if r["shape"] == shape]
        print(f"\n-- {_shape_note(mine, shape)}; experts F={mine[0].get('ffn', '?')}; dispatch {mine[0].get('dispatch_dtype', 'fp8')}; routing {mine[0].get('routing', 'fixed')}")
        print(f"{'backend':<11} {'experts':<11} {'shared':<10} {'cmdbuf':<6} {'µs/layer p50':>12} {'(min)':>9} "
              f"{'vs ref (min-max range)':>24} {'vs plain':>8} {'GB/s':>7} {'enqueue':>8}")
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
            vs = _fmt_ratio(layer_ratio(ref, r) if ref and ref is not r and r["backend"] != "plain" else None, 24)
            vp = f"{us / plain['per_layer_us']['p50']:>7.2f}x" if plain and r["backend"] != "plain" else f"{'':>8}"
            gb = f"{r['GBps']:>7.2f}" if r.get("GBps") else f"{'':>7}"
            shared = _placement(r)
            enq = f"{r['enqueue_us_per_layer']:>8.1f}" if r.get("enqueue_us_per_layer") is not None else f"{'':>8}"
            print(f"{r['backend']:<11} {r['experts']:<11} {shared:<10} {r['cmdbuf']:<6} {us:>12.1f} "
                  f"{r['per_layer_us']['min']:>9.1f} {vs} {vp} {gb} {enq}"
                  + ("  NOT FINITE" if r.get("finite") is False else "")
                  + (f"  [{r['env']}, round {r['round'] + 1}]" if "env" in r else ""))
    print("vs ref: the reference backend's p50 / this one's (> 1: faster), and in parentheses the range "
          "the repeats' spread allows (ref min / this max .. ref max / this min); vs plain: this time / the plain-XLA "
          "layer's (the same local compute without communication: the cost of the exchange); GB/s: dispatch + "
          "combine payload per rank / layer time; enqueue: µs per layer the host took to hand the steps to "
          "the runtime (p50; near µs/layer: the host sets the pace); NOT FINITE: the layers' output held "
          "NaN or inf (rows that route wherever top_k puts NaN: not a model's timing)")
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
            rs = layer_ratio(ref[0], best) if ref and best["backend"] != "reference" else None
            vs = _vs_ref_words(rs) if rs else ""
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
            if any(r.get("finite") is False for r in sel + xla):
                vs += "; WARNING: a layer's output was not finite, so its routing was not a model's"
            lines.append(f"fastest MoE layer at {shape}, {experts} experts: {best['backend']} "
                         f"({best['per_layer_us']['p50']:.1f} µs/layer, {shared}, command buffers {best['cmdbuf']}{vs})")
    return lines


def layer_ratio(ref, r):
    """ref / r per layer: p50 over p50, spread min..max against max..min over the repeats."""
    a, b = ref["per_layer_us"], r["per_layer_us"]
    return ratio_spread(a["min"], a["p50"], a.get("max", a["p50"]), b["min"], b["p50"], b.get("max", b["p50"]))


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
        variants = sorted({_variant(r) for r in mine}, key=lambda v: tuple("" if x is None else str(x) for x in v))
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
        ax.set_xticklabels([f"{e}\nshared {o}\ncmdbuf {c}" + (f"\n{env} #{rnd + 1}" if env else "")
                            for e, o, c, env, rnd in variants], fontsize=8)
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
