"""`jax.lax.ragged_all_to_all`'s documented semantics built from dense all_to_all, for XLA:CPU
(which lacks ragged-all-to-all), so that the ragged backend's index logic runs on the CPU suites.
Test-only: the library never uses it. Inconsistent arguments (send_sizes != the all_to_all of the
receivers' recv_sizes, or a slice out of bounds) poison the whole output with NaN (or -1 for
integers), so that a wrong plan fails the oracle comparison instead of passing by luck.

Enable for a whole pytest run with JAX_MOE_A2A_RAGGED_EMULATE=1 (tests/conftest.py), or for one
test with `with emulated(): ...`. Either registers, under the name "ragged", the library's
ragged backend with this function as its collective (`RaggedBackend(collective=...)`), through the
public backend registry: nothing in the library is patched.
"""

import contextlib

import jax
import jax.numpy as jnp

from jax_moe_a2a import backends
from jax_moe_a2a.backends.ragged import RaggedBackend


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


def _emulated_backend():
    return RaggedBackend(collective=emulated_ragged_all_to_all)


def install():
    """Registers the ragged backend over the emulation (available everywhere) for the rest of the
    process. Returns the registration it replaced."""
    return backends.register("ragged", _emulated_backend, lambda: None)


@contextlib.contextmanager
def emulated():
    """The emulation inside the block (a communicator made there keeps it); the previous "ragged"
    registration comes back at its end."""
    previous = install()
    try:
        yield
    finally:
        backends.register("ragged", *previous)
