#!/usr/bin/env bash
# Sets up everything and runs the main job: the dispatch/combine benchmark of a DeepSeek-V3-shaped
# MoE layer on every available backend (8 CPU devices in one process, or the GPUs when present).
# Extra arguments go to `python -m jax_moe_a2a.bench` (e.g. --quick, --backend reference).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
python -m jax_moe_a2a.bench --out "${BENCH_OUT:-bench-out}" "$@"
