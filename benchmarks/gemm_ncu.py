"""One call of a grouped-GEMM case between cuProfilerStart/Stop, for Nsight Compute (issue 31).

    ncu --clock-control none --profile-from-start off --set full \
        python benchmarks/gemm_ncu.py --case decode --experts 8

Cases (shapes as benchmarks/gemm.py: H = 7168, F = 2048, fp8 e4m3 rows with 1x128 scales x fp8
weights with 128x128 scales):
  decode   1,024 rows (uniform over --experts L), the native fp8 MLP (gate+up + SwiGLU, down)
  prefill  32,768 rows over L = 32, the native fp8 MLP
  dense    XLA's fp8 dense dot of the prefill MLP's FLOPs ([32768, 7168] x [7168, 6144] -> bf16)
Each case is compiled and run twice first; only the third call is inside the profiled range, so
every kernel ncu reports is one launch of that call (the setup kernels and the epilogue included).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys

import numpy as np

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gemm as bench  # noqa: E402  (benchmarks/gemm.py: the same inputs and functions)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--case", choices=("decode", "prefill", "dense"), default="decode")
    ap.add_argument("--experts", type=int, default=8, help="decode: local experts L")
    ap.add_argument("--rows", type=int, default=1024, help="decode: rows")
    args = ap.parse_args(argv)
    from jax_moe_a2a import gemm_ffi

    rng = np.random.default_rng(0)
    key = jax.random.PRNGKey(0)
    native_fp8 = bench.mlp_fns(gemm_ffi)[0]
    H, F = bench.H, bench.F
    if args.case == "dense":
        rows = 4096 * 8
        ka, kb = jax.random.split(key)
        a = jax.random.uniform(ka, (rows, H), jnp.float32, -1, 1).astype(bench.FP8)
        b = jax.random.uniform(kb, (H, 3 * F), jnp.float32, -1, 1).astype(bench.FP8)
        f = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=bench.BF16))
        call = lambda: f(a, b)  # noqa: E731
    else:
        L, rows = (args.experts, args.rows) if args.case == "decode" else (32, 4096 * 8)
        sizes = bench.sizes_uniform(rng, L, rows)
        xq, xs = bench.quantize_rows(jnp.asarray(rng.normal(size=(rows, H)).astype(np.float32)))
        kg, kd = jax.random.split(key)
        wgu, wgus = bench.fp8_weights(kg, (L, 2 * F, H))
        wd, wds = bench.fp8_weights(kd, (L, H, F))
        gs = jnp.asarray(sizes)
        print(f"{args.case}: L={L} rows={rows} max rows per expert {int(sizes.max())}", flush=True)
        call = lambda: native_fp8(xq, wgu, wd, gs, xs, wgus, wds)  # noqa: E731
    for _ in range(2):
        jax.block_until_ready(call())
    cuda = ctypes.CDLL("libcuda.so.1")
    cuda.cuProfilerStart()
    jax.block_until_ready(call())
    cuda.cuProfilerStop()
    print("profiled one call", flush=True)


if __name__ == "__main__":
    main()
