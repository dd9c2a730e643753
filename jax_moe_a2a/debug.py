"""Counters and debug checks of executed dispatches: the host callbacks behind
`Communicator.stats()` (collect_stats) and debug=True's `DroppedRowsError`.

The callbacks hold a `Counters` (small, no reference to the communicator): the compiled step keeps
them, and the jit caches keep the step for the life of the process."""

from __future__ import annotations

import logging
import threading

import jax
import jax.numpy as jnp
import numpy as np

from .errors import DroppedRowsError

# The library's messages go through this logger (never print); configure it with `logging`.
logger = logging.getLogger("jax_moe_a2a")


class Counters:
    """Thread-safe counters of one communicator's executed dispatches (docs/api.md, `stats()`),
    and the DroppedRowsErrors its debug checks raised in this process (at most 64 kept)."""

    FIELDS = ("dispatches", "dropped", "overflow", "masked", "clamped")

    def __init__(self):
        self._lock = threading.Lock()
        self._values = dict.fromkeys(self.FIELDS, 0)
        self._errors = []

    def add(self, dropped, overflow, masked, clamped=0, err=None):
        with self._lock:
            self._values["dispatches"] += 1
            self._values["dropped"] += int(dropped)
            self._values["overflow"] += int(overflow)
            self._values["masked"] += int(masked)
            self._values["clamped"] += int(clamped)
            if err is not None and len(self._errors) < 64:
                self._errors.append(err)

    def snapshot(self) -> dict:
        with self._lock:
            return dict(self._values)

    def reset(self):
        with self._lock:
            self._values = dict.fromkeys(self.FIELDS, 0)

    def take_errors(self) -> list:
        """The recorded errors, oldest first, forgotten here."""
        with self._lock:
            errors, self._errors = self._errors, []
        return errors


def after(gate, tree):
    """`tree` with every array made data-dependent on the int32 scalar `gate` (zero at run time,
    unknown to XLA): integers get gate added, floats the same on their bits."""
    def one(a):
        dt = jnp.dtype(a.dtype)
        if jnp.issubdtype(dt, jnp.integer):
            return a + gate.astype(dt)
        bits = jnp.dtype(f"uint{8 * dt.itemsize}")
        return jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(a, bits) + gate.astype(bits), dt)
    return jax.tree_util.tree_map(one, tree)


def record(counters: Counters, dropped, overflow, masked=None, clamped=None, *, tokens_given=None,
           max_tokens: int = 0, collect: bool, debug: bool, psum_axis=None):
    """Counts one executed dispatch of this rank on the host (collect) and, with debug, raises
    DroppedRowsError when it dropped pairs, overflowed, or was given a num_tokens outside [0, T]
    (never for masked pairs: they are expected).

    dropped, overflow, masked, clamped (1 when num_tokens was clamped): [] int32 of this rank
    (masked, clamped None: 0); tokens_given: [] int32 num_tokens as given, or None; max_tokens: T
    (for the message). psum_axis: with
    debug, the EP axis over which every rank decides together (Backend.debug_psum), or None.
    Returns (`dropped`, gate): `dropped` threaded through the debug check so XLA cannot drop the
    check, and with debug an int32 zero that only the check produces (else None)."""
    zero = jnp.zeros((), jnp.int32)
    masked = zero if masked is None else masked
    clamped = zero if clamped is None else clamped
    given = zero if tokens_given is None else tokens_given
    if collect and not debug:
        jax.debug.callback(lambda d, o, m, c: counters.add(d, o, m, c), dropped, overflow, masked, clamped)
    if not debug:
        return dropped, None
    # A pure callback whose result is used: the error surfaces at the outputs. Every rank raises,
    # or none: a psum of the counts decides for all (where XLA's collectives run). A rank left
    # running would wait for the stopped one, in XLA's next collective (pure-JAX backends; XLA:CPU
    # aborts the process after its rendezvous timeout) or in the next FFI half (until timeout_s,
    # several times over: the host backend with recv_capacity overflow on one rank took minutes).
    # Overflow is counted at the receiver and bad ids at the sender, so no rank sees the others'
    # counts without it.
    bad = dropped + overflow + clamped  # this rank's
    if psum_axis is not None:
        bad = jax.lax.psum(bad, psum_axis)

    def check(d, o, m, c, g, b):
        err = None
        if int(b):
            err = DroppedRowsError(
                f"jax_moe_a2a: dispatch dropped {int(d)} pair(s) with bad expert ids and {int(o)} row(s) "
                f"past recv_capacity on this rank, {int(b)} in all ranks (debug=True)"
                + (f"; num_tokens {int(g)} is outside [0, {max_tokens}] (clamped)" if int(c) else ""))
        counters.add(d, o, m, c, err)
        if err is not None:
            logger.error("%s", err)
            raise err
        return np.int32(d), np.int32(0)

    i32 = jax.ShapeDtypeStruct((), jnp.int32)
    return jax.pure_callback(check, (i32, i32), dropped, overflow, masked, clamped, given, bad)


__all__ = ["Counters", "after", "record", "logger"]
