"""Helpers to place independent work between a send half and its recv half."""

from __future__ import annotations

import jax


def overlap(handle, work_fn, *args):
    """Runs `work_fn(*args)` while `handle` (a send half's result) is in flight.

    An optimisation barrier ties the work's inputs to the handle, so XLA schedules the work after
    the send and, because the recv consumes the barrier's handle output, before the recv.
    Returns (handle, work_fn(*args)); pass the returned handle to the recv half.
    """
    handle, args = jax.lax.optimization_barrier((handle, args))
    result = work_fn(*args)
    handle, result = jax.lax.optimization_barrier((handle, result))
    return handle, result
