"""The main job (scripts/bench.sh): the MoE layer benchmark (the library's models.moe_block, L layers
in one jit, each routing its own input; the headline: the layer with real experts, router ->
dispatch -> `grouped` = fp8 SwiGLU experts through jax_moe_a2a.expert_mlp -> combine, next to the
plain-XLA layer (models.local_moe_block) with bf16 ragged_dot experts; identity experts isolate the
exchange), then the halves benchmark, on every available backend; writes results.json, layers.png
and halves.png into --out.

    python benchmarks/bench.py [--quick] [--backend host,reference] [--shape decode]
                               [--anchor-json DIR] [--routing per-layer|fixed]

On CPUs both run in this process (8 CPU devices, shapes scaled down). On GPUs the layer benchmark
runs once with XLA command buffers on and once off (a child process each: XLA_FLAGS must be set
before JAX starts), and the halves benchmark runs in a child with command buffers off and
JAX_MOE_A2A_KERNEL_TIMING=1 (CUDA-event kernel times of the cuda and nvshmem backends). Under
mpirun, run benchmarks/layers.py and benchmarks/halves.py directly.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import benchlib
import halves
import layers
from benchlib import report


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python benchmarks/bench.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    halves.add_common_args(p)
    p.add_argument("--anchor-json", default=os.environ.get("JAX_MOE_A2A_ANCHOR_JSON"),
                   help="folder with the pplx anchor kit's pplx_N.json (default $JAX_MOE_A2A_ANCHOR_JSON)")
    p.add_argument("--cmdbuf", default="auto", help="layer benchmark's command-buffer settings (see layers.py)")
    p.add_argument("--routing", default="per-layer", choices=("per-layer", "fixed"),
                   help="layer benchmark's routing (see layers.py); default per-layer: every layer routes its "
                        "input with models.moe_block's router, as a model runs")
    return p.parse_args(argv)


def layers_argv(args) -> list:
    """The layer benchmark's arguments: the common ones and the routing."""
    return common_argv(args) + ["--routing", args.routing]


def common_argv(args) -> list:
    out = ["--shape", args.shape, "--seed", str(args.seed), "--out", args.out]
    for flag, v in (("--backend", args.backend), ("--ranks", args.ranks), ("--tokens", args.tokens),
                    ("--hidden", args.hidden), ("--cpu-devices", args.cpu_devices)):
        if v:
            out += [flag, str(v)]
    return out + (["--quick"] if args.quick else [])


def halves_child(args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "halves.json")
        cmd = [sys.executable, os.path.join(benchlib.BENCH_DIR, "halves.py"), *common_argv(args), "--json-out", path,
               "--progress-label", "[halves] "]
        if args.anchor_json:
            cmd += ["--anchor-json", args.anchor_json]
        env = layers.with_cmdbuf_env("off")
        env.setdefault("JAX_MOE_A2A_KERNEL_TIMING", "1")
        rc = subprocess.run(cmd, env=env).returncode
        if not os.path.exists(path):
            raise SystemExit(f"bench: the halves benchmark failed (exit {rc})")
        with open(path) as f:
            return json.load(f)


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if benchlib.mpi_world()[1] > 1:
        raise SystemExit("bench.py runs one process; under mpirun run benchmarks/layers.py and benchmarks/halves.py")
    variants = layers.cmdbuf_variants(args.cmdbuf)
    if len(variants) > 1:  # GPUs: child processes
        lay = layers.run_children(layers_argv(args), variants, args.out)
        hal = halves_child(args)
    else:
        if variants:
            os.environ["XLA_FLAGS"] = layers.with_cmdbuf_env(variants[0])["XLA_FLAGS"]
        jax = benchlib.setup_runtime(args.cpu_devices)
        largs = layers.parse_args(layers_argv(args))
        lay = layers.run(jax, largs, "[layers] ")
        hargs = halves.parse_args(common_argv(args) + (["--anchor-json", args.anchor_json] if args.anchor_json else []))
        hal = halves.run(jax, hargs, "[halves] ")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "results.json")
    with open(path, "w") as f:
        json.dump({"layers": lay, "halves": hal}, f, indent=2)
    report.print_layers(lay)
    report.print_halves(hal)
    pngs = [] if args.no_plot else report.plot_layers(lay, args.out) + report.plot_halves(hal, args.out)
    print(f"\nwrote {path} " + " ".join(pngs))
    print("\n".join(["", "summary:"] + report.layer_fastest(lay["results"])))
    bad = halves.failed(hal) or any("error" in r for r in lay["results"])
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
