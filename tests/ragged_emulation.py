"""`jax.lax.ragged_all_to_all`'s documented semantics built from dense all_to_all, for XLA:CPU
(which lacks ragged-all-to-all), so that the ragged backend's index logic runs on the CPU suites.
Test-only: the library never uses it. Inconsistent arguments (send_sizes != the all_to_all of the
receivers' recv_sizes, or a slice out of bounds) poison the whole output with NaN (or -1 for
integers), so that a wrong plan fails the oracle comparison instead of passing by luck.

Enable for a whole pytest run with JAX_MOE_A2A_RAGGED_EMULATE=1 (tests/conftest.py), or with
`use_emulation(monkeypatch)`.
"""

import jax
import jax.numpy as jnp


def _a2a(x, axis_name):
    return jax.lax.all_to_all(x, axis_name, 0, 0, tiled=True)


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                               axis_name, axis_index_groups=None):
    assert axis_index_groups is None
    rows_in = operand.shape[0]
    j = jnp.arange(rows_in)
    # Slice i of this sender, padded to rows_in rows: [K, rows_in, ...].
    take = input_offsets[:, None] + j[None, :]
    blocks = operand[jnp.clip(take, 0, rows_in - 1)]
    sent = _a2a(blocks, axis_name)                       # slice i now: from rank i // (K / N)
    where = _a2a(output_offsets, axis_name)              # where each received slice starts here
    sizes_sent = _a2a(send_sizes, axis_name)
    bad = (jnp.any(sizes_sent != recv_sizes) | jnp.any(input_offsets + send_sizes > rows_in)
           | jnp.any(where + recv_sizes > output.shape[0]) | jnp.any(input_offsets < 0) | jnp.any(where < 0))
    dst = jnp.where(j[None, :] < recv_sizes[:, None], where[:, None] + j[None, :], output.shape[0])
    result = output.at[dst.reshape(-1)].set(sent.reshape(-1, *operand.shape[1:]), mode="drop")
    poison = jnp.nan if jnp.issubdtype(output.dtype, jnp.floating) else -1
    return jnp.where(bad, jnp.full_like(result, poison), result)


def _available(platforms=None):
    return None


def install(setattr_fn=setattr):
    """Makes the ragged backend use the emulation and count as available (for the session with
    the default setattr, or for one test with pytest's monkeypatch.setattr)."""
    from jax_moe_a2a.backends import ragged
    setattr_fn(ragged, "COLLECTIVE", emulated_ragged_all_to_all)
    setattr_fn(ragged, "unavailable_reason", _available)


def use_emulation(monkeypatch):
    """The emulation for one test."""
    install(monkeypatch.setattr)
