"""Grouped expert GEMMs alone (issue 31): the native kernels (jax_moe_a2a.gemm_ffi) next to what a
JAX user can write, and the floors, all measured in one run on one GPU.

    python benchmarks/gemm.py [--out results/gemm.json] [--cases decode,prefill] [--trials 7]

Decode: 1,024 received rows, DeepSeek-V3 expert shapes (H = 7168, F = 2048), L = 256, 32, 8 local
experts (rows spread uniformly at random over them), the whole expert MLP: gate+up GEMM with the
SwiGLU epilogue, then down. Per L:
  native fp8   fp8 e4m3 rows (1x128 scales) x fp8 weights (128x128 scales), h re-quantised to fp8
               (ragged layout, and expert_major [L, C, H] with C = 4 x the mean rows per expert)
  native bf16  bf16 x bf16, h bf16 (ragged)
  ragged_dot   jax.lax.ragged_dot_general over the ragged rows, bf16 (what XLA offers)
  einsum       the expert_major einsum [L, C, H] x [L, N, H], bf16
  hbm floor    the weights' bytes read once at the bandwidth of a device copy measured on those
               same bytes (copy time / 2: a copy reads and writes each byte)
Prefill: 4,096 tokens x top-8 = 32,768 rows over L = 32 experts, the same MLP, next to XLA's dense
dot of the same FLOPs and dtype ([32768, 7168] x [7168, 6144]: bf16, and fp8 e4m3 x e4m3 -> bf16,
XLA's fp8 dot through cuBLASLt with no block scales), and the fp8 MLP's parts (gate+up, SwiGLU,
down) each timed alone against XLA's fp8 dense dot of that GEMM's own shape.

Timing: each measurement enqueues `reps` jitted calls back to back (one dispatch per MLP) and
blocks once; a trial is that wall time / reps; p50 and [min, max] over `trials` trials.
--chain N (default 4) also times N fp8 MLPs with their own weights in one jit, per MLP (no
executable boundary, no weights left in L2 by the previous call); --trace adds the JAX profiler's
device view of the fp8 MLP (single and chained): busy time, idle gaps and each kernel's time with
the idle just before it, per MLP, and the MLP's busy time in bursts of 10 after 0.3 s idle (a cool
board, against back to back: what the power limit costs; GPUs only). The fp8 MLPs and XLA's dense
dots also report the board's SM clock and power over their timing (benchlib/gpu_clock.py,
nvidia-smi): back to back the decode MLP can run at the 700 W limit, below the boost clock.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

import numpy as np

import jax
import jax.numpy as jnp

from benchlib import gpu_clock

FP8, BF16 = jnp.float8_e4m3fn, jnp.bfloat16
H, F = 7168, 2048


def timeit(fn, *args, trials=7, reps=None, target_s=0.05, max_reps=200):
    out = fn(*args)
    jax.block_until_ready(out)
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    one = time.perf_counter() - t0
    if reps is None:
        reps = int(max(3, min(max_reps, target_s / max(one, 1e-6))))
    samples = []
    for _ in range(trials):
        t0 = time.perf_counter()
        for _ in range(reps):  # one stream: the last call ends after all the others
            out = fn(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - t0) / reps)
        del out
    us = np.asarray(samples) * 1e6
    return {"p50_us": float(np.median(us)), "min_us": float(us.min()), "max_us": float(us.max()),
            "trials": trials, "reps": reps}


def timeit_board(fn, *args, trials=7, target_s=0.25):
    """timeit, with the GPU's SM clock and power over the measurement (benchlib/gpu_clock.py) in
    r["board"]: back-to-back decode GEMMs can reach the board's power limit and run below the boost
    clock, and the ratios of such a run say so. Each trial runs the calls back to back for about
    target_s (up to 5,000 calls), so the board's state settles as in a model's steady state and
    the 20 ms samples see it (at timeit's default, 200 calls of a decode MLP are ~35 ms). The first
    call (tracing, compiling, XLA's autotuning of a dense dot: seconds of an idle GPU at its boost
    clock) runs before the log starts, so the samples are the timed calls' only."""
    jax.block_until_ready(fn(*args))
    with gpu_clock.ClockLog() as log:
        r = timeit(fn, *args, trials=trials, target_s=target_s, max_reps=5000)
    r["board"] = log.summary()
    return r


def fp8_weights(key, shape):
    """Random e4m3 weights [L, N, K] and positive 128x128 block scales [L, N/128, K/128]."""
    k1, k2 = jax.random.split(key)
    w = jax.random.uniform(k1, shape, jnp.float32, -2, 2).astype(FP8)
    s = jax.random.uniform(k2, (shape[0], shape[1] // 128, shape[2] // 128), jnp.float32, 0.002, 0.02)
    return w, s


def bf16_weights(key, shape):
    return (jax.random.normal(key, shape, jnp.float32) * 0.02).astype(BF16)


def sizes_uniform(rng, L, rows):
    return np.bincount(rng.integers(0, L, size=rows), minlength=L).astype(np.int32)


def to_expert_major(x, sizes, C):
    """Ragged rows -> [L, C, ...] (rows past C dropped; C is chosen above every count here)."""
    L = len(sizes)
    out = np.zeros((L, C) + x.shape[1:], x.dtype)
    off = 0
    for l, s in enumerate(sizes):
        out[l, :s] = x[off:off + s]
        off += s
    return out


def copy_floor(nbytes):
    """Device copy of nbytes (read + write each byte once): (result, bytes/s of reading once)."""
    a = jnp.zeros((nbytes // 4,), jnp.uint32) + jnp.uint32(0x01020304)
    f = jax.jit(lambda v: v ^ jnp.uint32(0x5A5A5A5A))
    r = timeit(f, a)
    del a
    r["read_once_us"] = r["p50_us"] / 2
    r["copy_GBps"] = 2 * nbytes / (r["p50_us"] * 1e-6) / 1e9
    return r


def mlp_fns(gemm_ffi):
    def native_mlp(x, wgu, wd, gs, xs, wgus, wds, quant):
        h, hs = gemm_ffi.grouped_gemm_swiglu(x, wgu, gs, x_scale=xs, w_scale=wgus, quantize_hidden=quant)
        return gemm_ffi.grouped_gemm(h, wd, gs, x_scale=hs, w_scale=wds)

    native_fp8 = jax.jit(lambda x, wgu, wd, gs, xs, wgus, wds: native_mlp(x, wgu, wd, gs, xs, wgus, wds, True))
    native_bf16 = jax.jit(lambda x, wgu, wd, gs: native_mlp(x, wgu, wd, gs, None, None, None, False))

    dn = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((1,), (2,)), ((), ())), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])

    def ragged_mlp(x, wgu, wd, gs):
        gu = jax.lax.ragged_dot_general(x, wgu, gs, dn, preferred_element_type=jnp.float32)
        g, u = gu[:, :F], gu[:, F:]
        h = (jax.nn.silu(g) * u).astype(BF16)
        return jax.lax.ragged_dot_general(h, wd, gs, dn, preferred_element_type=jnp.float32).astype(BF16)

    def einsum_mlp(x, wgu, wd):
        gu = jnp.einsum("lch,lnh->lcn", x, wgu, preferred_element_type=jnp.float32)
        g, u = gu[..., :F], gu[..., F:]
        h = (jax.nn.silu(g) * u).astype(BF16)
        return jnp.einsum("lcf,lhf->lch", h, wd, preferred_element_type=jnp.float32).astype(BF16)

    return native_fp8, native_bf16, jax.jit(ragged_mlp), jax.jit(einsum_mlp)


def quantize_rows(x):
    from jax_moe_a2a.quant import quantize_fp8_jax
    return quantize_fp8_jax(x, 128)


# The chained measurement's weights stay under this many bytes (fp8): L = 8 takes 4 MLPs, L = 32 2,
# L = 256 none.
CHAIN_BYTES = 4 << 30


def chained_fp8(native_fp8, n):
    """n fp8 MLPs with their own weights in one jit, as a model runs its layers: each MLP's kernels
    follow the previous one's on the stream with no executable boundary (launch and first-round
    costs overlap as inside a model), and no weight byte is in L2 from the previous call."""
    def f(x, gs, xs, layers):
        return [native_fp8(x, wgu, wd, gs, xs, wgus, wds) for (wgu, wd, wgus, wds) in layers]
    return jax.jit(f)


def short_kernel_name(name: str) -> str:
    """A kernel's name without its namespaces, template arguments and parameters (mangled names:
    the first identifier ending in 'kernel', else the last identifier)."""
    if name.startswith("_Z"):  # Itanium mangling: identifiers are <length><chars>
        ids, i = [], 2
        while i < len(name):
            m = re.match(r"\d+", name[i:])
            if m is None:
                i += 1
                continue
            j = i + m.end()
            ident = name[j:j + int(m.group())]
            if re.fullmatch(r"[A-Za-z_]\w*", ident):
                ids.append(ident)
                i = j + len(ident)
            else:
                i = j
        named = [x for x in ids if x.endswith("kernel")]
        return named[0] if named else (ids[-1] if ids else name)
    base = re.split(r"[<(]", name.replace("(anonymous namespace)", ""), maxsplit=1)[0]
    parts = base.split("::")[-1].split()
    return parts[-1] if parts else name


def traced(run_step, steps, per=1):
    """The device's busy time, idle gaps and kernels per MLP while run_step runs back to back
    (benchlib/trace.py: the JAX profiler's GPU stream lines), kernel names shortened. Unfused (L = 8)
    the MLP's two GEMMs are one kernel instance (the swap-AB kernel, bf16 out): one row, x2 a step."""
    from benchlib import trace
    out = trace.device_profile(run_step, steps=steps, per=per)
    for k in out.get("kernels", []):
        k["name"] = short_kernel_name(k["name"])
    return out


def fp8_parts(gemm_ffi, xq, xs, wgu8, wgus, wd8, wds, gs, trials, board=False):
    """Where the fp8 MLP's time goes, each part jitted and timed alone: the gate+up GEMM (gu as the
    MLP writes it: gemm_ffi.gu_dtype), the SwiGLU kernel (h fp8 with 1x128 scales), the down GEMM.
    xq e4m3 [R, H], xs f32 [R, H/128], wgu8 e4m3 [L, 2F, H], wd8 e4m3 [L, H, F] with their block
    scales, gs int32 [L]. board: time with the SM clock and power beside (timeit_board: prefill runs
    power-capped, and each part's clock tells how much of its ratio is the cap's)."""
    t = timeit_board if board else timeit
    res = {}
    gu_dt = gemm_ffi.gu_dtype(True)
    gate_up = jax.jit(lambda x, w, g, s1, s2: gemm_ffi.grouped_gemm(x, w, g, x_scale=s1, w_scale=s2, out_dtype=gu_dt))
    res["native_fp8_gate_up"] = t(gate_up, xq, wgu8, gs, xs, wgus, trials=trials)
    gu = gate_up(xq, wgu8, gs, xs, wgus)
    sw = jax.jit(lambda g: gemm_ffi.swiglu(g, quantize_hidden=True))
    res["native_swiglu_fp8"] = t(sw, gu, trials=trials)
    h, hs = sw(gu)
    del gu
    down = jax.jit(lambda x, w, g, s1, s2: gemm_ffi.grouped_gemm(x, w, g, x_scale=s1, w_scale=s2))
    res["native_fp8_down"] = t(down, h, wd8, gs, hs, wds, trials=trials)
    return res


def decode_case(L, rows, trials, gemm_ffi, rng, key, native_only=False, fp8_only=False, chain=4, trace=False):
    native_fp8, native_bf16, ragged_mlp, einsum_mlp = mlp_fns(gemm_ffi)
    sizes = sizes_uniform(rng, L, rows)
    C = max(int(4 * rows // L), int(sizes.max()))
    x32 = rng.normal(size=(rows, H)).astype(np.float32)
    xb = jnp.asarray(x32).astype(BF16)
    xq, xs = quantize_rows(jnp.asarray(x32))
    gs = jnp.asarray(sizes)
    kg, kd = jax.random.split(key)
    res = {"L": L, "rows": rows, "C": C, "max_rows_per_expert": int(sizes.max())}
    wgu8, wgus = fp8_weights(kg, (L, 2 * F, H))
    wd8, wds = fp8_weights(kd, (L, H, F))
    fp8_bytes = L * 3 * F * H
    res["fp8_weight_bytes"] = fp8_bytes
    res["native_fp8_ragged"] = timeit_board(native_fp8, xq, wgu8, wd8, gs, xs, wgus, wds, trials=trials)
    if trace:
        res["trace_fp8"] = traced(lambda: native_fp8(xq, wgu8, wd8, gs, xs, wgus, wds), steps=5)

        def burst():  # a cool board: 0.3 s idle, then 10 MLPs (the power limit's share of the time)
            time.sleep(0.3)
            out = None
            for _ in range(10):
                out = native_fp8(xq, wgu8, wd8, gs, xs, wgus, wds)
            return jax.block_until_ready(out)
        res["trace_fp8_bursts"] = traced(burst, steps=5, per=10)
    n = min(chain, CHAIN_BYTES // fp8_bytes)
    if n >= 2:  # the same MLP n times in one jit, each with its own weights: per MLP
        layers = [(wgu8, wd8, wgus, wds)]
        for i in range(1, n):
            kgi, kdi = jax.random.split(jax.random.fold_in(key, i))
            (a, sa), (b, sb) = fp8_weights(kgi, (L, 2 * F, H)), fp8_weights(kdi, (L, H, F))
            layers.append((a, b, sa, sb))
        chained = chained_fp8(native_fp8, n)
        r = timeit_board(chained, xq, gs, xs, layers, trials=trials)
        res["native_fp8_ragged_chained"] = {k: (v / n if k.endswith("_us") else v) for k, v in r.items()} | {"chain": n}
        if trace:
            res["trace_fp8_chained"] = traced(lambda: chained(xq, gs, xs, layers), steps=3, per=n)
        del layers
    if not fp8_only:
        xq_em = jnp.asarray(to_expert_major(np.asarray(xq.astype(jnp.float32)), sizes, C)).astype(FP8)
        xs_em = jnp.asarray(to_expert_major(np.asarray(xs), sizes, C))
        res["native_fp8_expert_major"] = timeit(native_fp8, xq_em, wgu8, wd8, gs, xs_em, wgus, wds, trials=trials)
        del xq_em, xs_em
    res.update(fp8_parts(gemm_ffi, xq, xs, wgu8, wgus, wd8, wds, gs, trials))
    del wgu8, wd8
    res["hbm_fp8"] = copy_floor(fp8_bytes)
    if fp8_only:  # a configuration sweep: the fp8 MLP, its parts and its floor only
        return res
    res["bf16_weight_bytes"] = 2 * fp8_bytes

    def bf16_part():
        wgu = bf16_weights(kg, (L, 2 * F, H))
        wd = bf16_weights(kd, (L, H, F))
        res["native_bf16_ragged"] = timeit(native_bf16, xb, wgu, wd, gs, trials=trials)
        if not native_only:
            res["ragged_dot_bf16"] = timeit(ragged_mlp, xb, wgu, wd, gs, trials=max(3, trials // 2))
            xb_em = jnp.asarray(to_expert_major(np.asarray(xb.astype(jnp.float32)), sizes, C)).astype(BF16)
            res["einsum_bf16_expert_major"] = timeit(einsum_mlp, xb_em, wgu, wd, trials=trials)
        del wgu, wd
        res["hbm_bf16"] = copy_floor(2 * fp8_bytes)

    fits(bf16_part, res, "bf16", 2 * fp8_bytes)
    return res


def fits(part, res, name, weight_bytes):
    """Runs part(); where the device runs out of memory (L = 256's bf16 weights, 22.5 GB, and their
    copy floor's two copies do not fit an 80 GB H100 beside the fp8 case), drops what part() recorded
    of `name` and says so in res[name + "_skipped"] instead of ending the benchmark."""
    before = set(res)
    try:
        part()
    except Exception as e:  # jax.errors.JaxRuntimeError: RESOURCE_EXHAUSTED
        if "RESOURCE_EXHAUSTED" not in str(e) and "out of memory" not in str(e).lower():
            raise
        for k in set(res) - before:
            del res[k]
        res[name + "_skipped"] = (f"out of device memory ({weight_bytes / 1e9:.1f} GB of {name} weights): "
                                  f"{str(e).splitlines()[0][:160]}")


def with_tflops(r, flops):
    """r (a timing dict with p50_us) with r["tflops"] = flops / its p50 added; r itself, returned."""
    r["tflops"] = flops / (r["p50_us"] * 1e-6) / 1e12
    return r


def dense_dot(M, K, N, dtype, trials):
    ka, kb = jax.random.split(jax.random.PRNGKey(7))
    a = jax.random.uniform(ka, (M, K), jnp.float32, -1, 1).astype(dtype)
    b = jax.random.uniform(kb, (K, N), jnp.float32, -1, 1).astype(dtype)
    f = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=BF16))
    try:
        r = timeit_board(f, a, b, trials=trials)
    except Exception as e:  # XLA may not offer this dtype's dot
        return {"error": f"{type(e).__name__}: {e}"[:300]}
    return with_tflops(r, 2 * M * K * N)


def prefill_case(trials, gemm_ffi, rng, key, tokens=4096, topk=8, L=32, fp8_only=False):
    native_fp8, native_bf16, ragged_mlp, _ = mlp_fns(gemm_ffi)
    rows = tokens * topk
    sizes = sizes_uniform(rng, L, rows)
    flops = 2 * rows * 3 * F * H
    x32 = jax.random.normal(jax.random.PRNGKey(3), (rows, H), jnp.float32)
    xq, xs = quantize_rows(x32)
    xb = x32.astype(BF16)
    del x32
    gs = jnp.asarray(sizes)
    kg, kd = jax.random.split(key)
    res = {"L": L, "rows": rows, "flops": flops}
    wgu8, wgus = fp8_weights(kg, (L, 2 * F, H))
    wd8, wds = fp8_weights(kd, (L, H, F))
    res["native_fp8_ragged"] = with_tflops(
        timeit_board(native_fp8, xq, wgu8, wd8, gs, xs, wgus, wds, trials=trials), flops)
    # the parts, each against XLA's fp8 dense dot of its own shape: which GEMM holds the ratio down,
    # and what the SwiGLU kernel adds (the MLP's ratio counts all three against one dense dot)
    res.update(fp8_parts(gemm_ffi, xq, xs, wgu8, wgus, wd8, wds, gs, trials, board=True))
    for part, (k, n) in (("native_fp8_gate_up", (H, 2 * F)), ("native_fp8_down", (F, H))):
        with_tflops(res[part], 2 * rows * k * n)
    # the SwiGLU kernel's floor: a device copy moving the bytes it moves (reads gu bf16 [rows, 2F],
    # writes h e4m3 [rows, F] and its f32 scales [rows, F/128]); a copy reads and writes each byte
    res["swiglu_floor"] = copy_floor((rows * 2 * F * 2 + rows * F + rows * (F // 128) * 4) // 2)
    del wgu8, wd8
    res["dense_dot_fp8_gate_up_shape"] = dense_dot(rows, H, 2 * F, FP8, trials)
    res["dense_dot_fp8_down_shape"] = dense_dot(rows, F, H, FP8, trials)
    if fp8_only:  # a configuration sweep: the fp8 MLP next to XLA's fp8 dense dot
        del xb, xq
        res["dense_dot_fp8"] = dense_dot(rows, H, 3 * F, FP8, trials)
        return res
    wgu = bf16_weights(kg, (L, 2 * F, H))
    wd = bf16_weights(kd, (L, H, F))
    res["native_bf16_ragged"] = with_tflops(timeit(native_bf16, xb, wgu, wd, gs, trials=trials), flops)
    res["ragged_dot_bf16"] = with_tflops(timeit(ragged_mlp, xb, wgu, wd, gs, trials=max(3, trials // 2)), flops)
    del wgu, wd, xb, xq
    res["dense_dot_bf16"] = dense_dot(rows, H, 3 * F, BF16, trials)
    res["dense_dot_fp8"] = dense_dot(rows, H, 3 * F, FP8, trials)
    return res


def _fmt(r):
    return f"{r['p50_us']:9.1f} [{r['min_us']:.1f}, {r['max_us']:.1f}]" if r and "p50_us" in r else "        n/a"


def report(out):
    lines = []
    for d in out.get("decode", []):
        hb8 = d["hbm_fp8"]["read_once_us"]
        n8 = d["native_fp8_ragged"]
        lines.append(f"decode L={d['L']:3d} rows={d['rows']} C={d['C']} (p50 us [min, max])")
        lines.append(f"  native fp8 ragged        {_fmt(n8)}   x{n8['p50_us'] / hb8:.2f} of fp8 weights' HBM time {hb8:.1f} us"
                     f" (copy {d['hbm_fp8']['copy_GBps']:.0f} GB/s)")
        if "board" in n8:
            lines.append(f"    {gpu_clock.describe(n8['board'])}")
        if "native_fp8_ragged_chained" in d:
            c8 = d["native_fp8_ragged_chained"]
            lines.append(f"  native fp8, {c8['chain']} in a jit {_fmt(c8)}   x{c8['p50_us'] / hb8:.2f} (per MLP, each with its own weights)")
            if "board" in c8:
                lines.append(f"    {gpu_clock.describe(c8['board'])}")
        for key, what in (("trace_fp8", "one MLP per call"), ("trace_fp8_chained", "chained"),
                          ("trace_fp8_bursts", "bursts of 10 after 0.3 s idle")):
            t = d.get(key)
            if not t:
                continue
            if t.get("busy_us") is None:
                lines.append(f"    device trace ({what}): {t.get('why')}")
                continue
            if key == "trace_fp8_bursts":  # the span holds the idle pauses: busy time only
                lines.append(f"    device trace ({what}), per MLP: busy {t['busy_us']:.1f} us (against back to back "
                             f"above: the power limit's share)")
                continue
            lines.append(f"    device trace ({what}), per MLP: busy {t['busy_us']:.1f}, span {t['span_us']:.1f}, "
                         f"idle {t['gap_us']:.1f} us")
            for k in t["kernels"]:
                lines.append(f"      {k['name']:<28s} {k['us']:8.1f} us  x{k['calls_per_step']:g}  idle before {k['idle_before_us']:6.1f}")
        if "native_fp8_expert_major" in d:
            n8e = d["native_fp8_expert_major"]
            lines.append(f"  native fp8 expert_major  {_fmt(n8e)}   x{n8e['p50_us'] / hb8:.2f}")
        if "native_fp8_down" in d:
            sw = f" swiglu {_fmt(d['native_swiglu_fp8'])}," if "native_swiglu_fp8" in d else ""
            lines.append(f"    parts: gate+up {_fmt(d['native_fp8_gate_up'])} (floor {hb8 * 2 / 3:.1f}),"
                         f"{sw} down {_fmt(d['native_fp8_down'])} (floor {hb8 / 3:.1f})")
        if d.get("bf16_skipped"):
            lines.append(f"  bf16 baselines skipped: {d['bf16_skipped']}")
        if "native_bf16_ragged" not in d or "hbm_bf16" not in d:  # a configuration sweep (--fp8-only)
            continue
        hb16 = d["hbm_bf16"]["read_once_us"]
        n16 = d["native_bf16_ragged"]
        rd, es = d.get("ragged_dot_bf16"), d.get("einsum_bf16_expert_major")
        lines.append(f"  native bf16 ragged       {_fmt(n16)}   x{n16['p50_us'] / hb16:.2f} of bf16 weights' HBM time {hb16:.1f} us")
        if rd:
            lines.append(f"  ragged_dot bf16          {_fmt(rd)}   native bf16 is {rd['p50_us'] / n16['p50_us']:.1f}x faster,"
                         f" native fp8 {rd['p50_us'] / n8['p50_us']:.1f}x")
        if es:
            lines.append(f"  einsum bf16 expert_major {_fmt(es)}   x{es['p50_us'] / hb16:.2f} of bf16 HBM time")
    p = out.get("prefill")
    if p:
        lines.append(f"prefill L={p['L']} rows={p['rows']} ({p['flops'] / 1e12:.2f} TFLOP per MLP)")
        for name in ("native_fp8_ragged", "native_bf16_ragged", "ragged_dot_bf16", "dense_dot_bf16", "dense_dot_fp8"):
            if name not in p:
                continue
            r = p[name]
            if "p50_us" in r:
                lines.append(f"  {name:22s} {_fmt(r)}  {r['tflops']:.0f} TFLOP/s")
                if "board" in r:
                    lines.append(f"    {gpu_clock.describe(r['board'])}")
            else:
                lines.append(f"  {name:22s} {r.get('error')}")
        for n, d in (("native_bf16_ragged", "dense_dot_bf16"), ("native_fp8_ragged", "dense_dot_fp8"),
                     ("native_fp8_ragged", "dense_dot_bf16")):
            if "tflops" in p.get(n, {}) and "tflops" in p.get(d, {}):
                lines.append(f"  {n} / {d}: {p[n]['tflops'] / p[d]['tflops']:.2f}x throughput")
        if "native_fp8_down" in p:
            lines.append("  the fp8 MLP's parts, each jitted alone, against XLA's fp8 dense dot of its shape:")
            for part, dense in (("native_fp8_gate_up", "dense_dot_fp8_gate_up_shape"), ("native_swiglu_fp8", None),
                                ("native_fp8_down", "dense_dot_fp8_down_shape")):
                r = p[part]
                line = f"    {part[7:]:12s} {_fmt(r)}"
                dd = p.get(dense, {}) if dense else {}
                if part == "native_swiglu_fp8" and "swiglu_floor" in p:
                    fl = p["swiglu_floor"]["p50_us"]
                    line += f"  x{r['p50_us'] / fl:.2f} its floor ({fl:.1f} us: a device copy moving its bytes)"
                if "tflops" in r and "tflops" in dd:
                    line += (f"  {r['tflops']:.0f} TFLOP/s against {dd['tflops']:.0f} ({_fmt(dd).strip()}):"
                             f" {r['tflops'] / dd['tflops']:.2f}x")
                lines.append(line)
                for who, x in (("ours", r), ("dense", dd)):
                    if "board" in x:
                        lines.append(f"      {who}: {gpu_clock.describe(x['board'])}")
            total = sum(p[k]["p50_us"] for k in ("native_fp8_gate_up", "native_swiglu_fp8", "native_fp8_down"))
            lines.append(f"    parts' sum {total:.1f} us against the MLP's {p['native_fp8_ragged']['p50_us']:.1f}")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="results/gemm.json")
    ap.add_argument("--cases", default="decode,prefill")
    ap.add_argument("--experts", default="256,32,8")
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--trials", type=int, default=7)
    ap.add_argument("--native-only", action="store_true", help="decode: skip the XLA baselines")
    ap.add_argument("--chain", type=int, default=4,
                    help="decode: also time this many fp8 MLPs (own weights each) in one jit, per MLP, where their weights "
                         "fit CHAIN_BYTES (1: not)")
    ap.add_argument("--trace", action="store_true",
                    help="decode: also trace the fp8 MLP (and the chained ones) with the JAX profiler: per MLP the "
                         "device's busy time, idle gaps and each kernel's time and the idle before it, and the MLP's busy "
                         "time in bursts of 10 after 0.3 s idle (GPUs only)")
    ap.add_argument("--fp8-only", action="store_true",
                    help="a configuration sweep: the native fp8 MLP (and its parts) with its floor / XLA's fp8 dot only")
    ap.add_argument("--variants", default="",
                    help="a configuration sweep in this process: ';'-separated JAX_MOE_A2A_GEMM_TILE_M values "
                         "(jax_moe_a2a.gemm_ffi.parse_tuning), each timed with --fp8-only on --cases (a fresh jit per case, so each "
                         "traces its workspace under its own setting)")
    a = ap.parse_args(argv)
    from jax_moe_a2a import gemm_ffi
    why = gemm_ffi.native_reason()
    if why is not None:
        print(f"gemm benchmark: the native kernels cannot run here: {why}")
        return 0
    rng = np.random.default_rng(0)
    key = jax.random.PRNGKey(0)
    dev = jax.devices()[0]
    out = {"tile_m": os.environ.get("JAX_MOE_A2A_GEMM_TILE_M", "auto"), "device": dev.device_kind, "jax": jax.__version__, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "commit": os.environ.get("GIT_COMMIT", ""), "decode": []}
    cases = a.cases.split(",")
    if a.variants:
        out["variants"] = {}
        for v in a.variants.split(";"):
            os.environ["JAX_MOE_A2A_GEMM_TILE_M"] = v
            res = {"decode": []}
            if "decode" in cases:
                for L in [int(e) for e in a.experts.split(",")]:
                    res["decode"].append(decode_case(L, a.rows, a.trials, gemm_ffi, rng, key, True, True, a.chain, a.trace))
            if "prefill" in cases:
                res["prefill"] = prefill_case(a.trials, gemm_ffi, rng, key, fp8_only=True)
            out["variants"][v] = res
            print(f"--- variant JAX_MOE_A2A_GEMM_TILE_M={v}\n{report(res)}", flush=True)
        os.environ.pop("JAX_MOE_A2A_GEMM_TILE_M")
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
        return 0
    if "decode" in cases:
        for L in [int(v) for v in a.experts.split(",")]:
            out["decode"].append(decode_case(L, a.rows, a.trials, gemm_ffi, rng, key, a.native_only, a.fp8_only, a.chain, a.trace))
            print(report({"decode": out["decode"][-1:]}), flush=True)
    if "prefill" in cases:
        out["prefill"] = prefill_case(a.trials, gemm_ffi, rng, key, fp8_only=a.fp8_only)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    print("=" * 100)
    print(report(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
