"""Benchmarks: `python -m jax_moe_a2a.bench` (dispatch/combine), `python -m jax_moe_a2a.bench.engine` (TransferEngine)."""
