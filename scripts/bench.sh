#!/usr/bin/env bash
# Sets up everything and runs the main job: the MoE layer benchmark (the library's
# jax_moe_a2a.models.moe_block, L layers in one jax.jit, each routing its own input, every available
# backend next to a plain-XLA layer; the headline is the layer with real experts: router -> dispatch
# -> fp8 SwiGLU experts through jax_moe_a2a.expert_mlp -> combine, against plain XLA with bf16
# ragged_dot experts) and the dispatch/combine halves benchmark of
# a DeepSeek-V3-shaped layer (8 CPU devices in one process, shapes scaled down, or the GPUs when
# present). Extra arguments go to `python benchmarks/bench.py` (e.g. --quick, --backend reference,
# --shape decode, --anchor-json DIR). Results: bench-out/results.json, layers.png, halves.png.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
OUT_DIR=$(mkdir -p "${BENCH_OUT:-bench-out}" && cd "${BENCH_OUT:-bench-out}" && pwd)
# A file of benchmarks/ run as a script imports the installed jax_moe_a2a (with its compiled _C):
# its folder, not the repository root, is first on sys.path.
python benchmarks/bench.py --out "$OUT_DIR" "$@"
