"""jax_moe_a2a"""
