#!/usr/bin/env bash
# Sets up everything and runs the main job: the dispatch/combine benchmark of a DeepSeek-V3-shaped
# MoE layer on every available backend (8 CPU devices in one process, or the GPUs when present).
# Extra arguments go to `python -m jax_moe_a2a.bench` (e.g. --quick, --backend reference).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
OUT_DIR=$(mkdir -p "${BENCH_OUT:-bench-out}" && cd "${BENCH_OUT:-bench-out}" && pwd)
# run outside the source tree, so that the installed package (with its compiled _C) is imported
cd "$(mktemp -d)" && python -m jax_moe_a2a.bench --out "$OUT_DIR" "$@"
