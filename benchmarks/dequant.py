"""XLA's fp8 dequantisation on its own: what an expert that computes in bf16 pays to read got.x.

Rows [R, H] e4m3 with their f32 scales [R, H / 128] (default: the EP = 1 decode layer's 1,024
received rows of H = 7,168) to bf16, in three forms (jax_moe_a2a.dequantize_fp8's repeat, a
reshape, in bf16: not exact) and a plain convert; `--calls` calls unrolled in one jit, µs per
call, p50 (min) over `--repeats`. Spec.recv_dtype (docs/api.md) removes this pass from a layer.

    python benchmarks/dequant.py [--rows 1024] [--hidden 7168]
"""

from __future__ import annotations

import argparse
import time


def main(argv=None):
    p = argparse.ArgumentParser(prog="python benchmarks/dequant.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=7168, help="a multiple of 128")
    p.add_argument("--calls", type=int, default=20, help="calls unrolled in one jit")
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    rows, h, block = args.rows, args.hidden, 128
    q = jax.random.normal(jax.random.PRNGKey(0), (rows, h)).astype(jnp.float8_e4m3fn)
    s = jax.random.uniform(jax.random.PRNGKey(1), (rows, h // block), jnp.float32)

    def repeat(q, s):  # jax_moe_a2a.dequantize_fp8, then the cast an identity expert does
        return (q.astype(jnp.float32) * jnp.repeat(s, block, axis=-1)[..., :h]).astype(jnp.bfloat16)

    def reshape(q, s):
        return (q.reshape(rows, h // block, block).astype(jnp.float32) * s[..., None]).reshape(rows, h).astype(
            jnp.bfloat16)

    def in_bf16(q, s):
        return (q.reshape(rows, h // block, block).astype(jnp.bfloat16)
                * s.astype(jnp.bfloat16)[..., None]).reshape(rows, h)

    def convert(q, s):
        del s
        return q.astype(jnp.bfloat16)

    ref = np.asarray(jax.jit(repeat)(q, s)).astype(np.float32)
    for name, f in (("repeat", repeat), ("reshape", reshape), ("in bf16", in_bf16), ("convert only", convert)):
        err = float(np.abs(np.asarray(jax.jit(f)(q, s)).astype(np.float32) - ref).max())
        # every call on other scales, all outputs kept: nothing is shared or left out by XLA
        step = jax.jit(lambda q, s, f=f: [f(q, s * (1 + i)) for i in range(args.calls)])
        jax.block_until_ready(step(q, s))
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            for _ in range(10):
                r = step(q, s)
            jax.block_until_ready(r)
            times.append((time.perf_counter() - t0) / (10 * args.calls) * 1e6)
        print(f"{name:14s} {np.median(times):7.2f} us/call (min {min(times):.2f})  max |diff| vs repeat {err:g}")


if __name__ == "__main__":
    main()
