"""Counters and debug checks of executed dispatches: the host callbacks behind
`Communicator.stats()` (collect_stats) and debug=True's `DroppedRowsError`.

The callbacks hold a `Counters` (small, no reference to the communicator): the compiled step keeps
them, and the jit caches keep the step for the life of the process."""

from __future__ import annotations

import logging
import threading

import jax
import jax.extend.core as _jex
import jax.numpy as jnp
import numpy as np
from jax.interpreters import ad, mlir
# No public API for these (jax 0.10, 0.11): jax.debug.callback's effect and lowering, and the
# remat rule table (as in commcall.py).
from jax._src import debugging as _jdebug
from jax._src.interpreters import partial_eval as _pe

from .errors import DroppedRowsError
from .routing import routed_pairs

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

    def add(self, dropped, overflow, masked, clamped=0):
        with self._lock:
            self._values["dispatches"] += 1
            self._values["dropped"] += int(dropped)
            self._values["overflow"] += int(overflow)
            self._values["masked"] += int(masked)
            self._values["clamped"] += int(clamped)

    def record_error(self, err):
        """Keeps a DroppedRowsError a debug check raised (at most 64), for take_errors."""
        with self._lock:
            if len(self._errors) < 64:
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


@jax.custom_jvp
def _gate_float(a, gate):
    """a (any float dtype and shape) with gate ([] int32, zero at run time) added to its bits:
    the same values, data-dependent on gate."""
    dt = jnp.dtype(a.dtype)
    bits = jnp.dtype(f"uint{8 * dt.itemsize}")
    return jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(a, bits) + gate.astype(bits), dt)


@_gate_float.defjvp
def _gate_float_jvp(primals, tangents):
    # The gate changes no value: a's tangent passes through (the bit round trip has no
    # derivative, and without this rule debug=True zeroed the gradients of the pure-JAX backends).
    return _gate_float(*primals), tangents[0]


def after(gate, tree):
    """`tree` with every array made data-dependent on the int32 scalar `gate` (zero at run time,
    unknown to XLA): integers get gate added, floats the same on their bits. Arrays of any shape
    and dtype, returned with theirs; differentiable (a float array's tangent passes through)."""
    def one(a):
        dt = jnp.dtype(a.dtype)
        if jnp.issubdtype(dt, jnp.integer):
            return a + gate.astype(dt)
        return _gate_float(a, gate)
    return jax.tree_util.tree_map(one, tree)


# ---- the counting callback: jax.debug.callback, never recomputed by jax.checkpoint -------------
# jax.debug.callback is staged on both sides of remat on purpose (it shows the recomputation):
# under jax.checkpoint the counters then counted every dispatch twice (the forward's, and the
# rematerialised one in the backward pass). This primitive is the same host callback (the same
# effect and lowering) with commcall's rule for our calls instead: it runs once, in the forward.
_count_p = _jex.Primitive("jax_moe_a2a_count")
_count_p.multiple_results = True


def _count_impl(*args, callback):
    callback(*args)
    return []


def _count_abstract_eval(*avals, callback):
    del avals, callback
    return [], {_jdebug.debug_effect}


def _count_lowering(ctx, *args, callback):
    return _jdebug.debug_callback_lowering(ctx, *args, effect=_jdebug.debug_effect, partitioned=False,
                                           callback=callback)


def _count_jvp(primals, tangents, *, callback):
    del tangents  # integer counts: nothing to differentiate
    return _count_p.bind(*primals, callback=callback), []


def _count_never_recompute(saveable, unks_in, inst_in, eqn):
    """Under remat: with every input known, on the known (forward) side only, never staged again;
    with an unknown input, staged (its known inputs residuals)."""
    del saveable
    if not any(unks_in):
        return eqn, None, [], [], []
    res = [v for v, inst in zip(eqn.invars, inst_in) if type(v) is _jex.Var and not inst]
    return None, eqn, [], [], res


_count_p.def_impl(_count_impl)
_count_p.def_effectful_abstract_eval(_count_abstract_eval)
mlir.register_lowering(_count_p, _count_lowering)
ad.primitive_jvps[_count_p] = _count_jvp
_pe.partial_eval_jaxpr_custom_rules[_count_p] = _count_never_recompute


def count(callback, *args):
    """callback(*args) on the host (args: int32 [] arrays, as numpy/JAX values) each time the
    compiled step runs this point of its forward pass; once per execution under jax.checkpoint
    (never rematerialised), unlike jax.debug.callback."""
    _count_p.bind(*args, callback=callback)


# One row per rank of what its debug check found (int32): the table every rank's check reads.
_RANK, _DROPPED, _OVERFLOW, _CLAMPED, _GIVEN, _TOKEN, _K, _ID, _KIND, _BOUND = range(10)
_COLUMNS = 10
# _KIND of a bad pair: a physical id (no expert map; outside [0, E) or a repeat, by its value), or
# a LOGICAL id (with an expert map): outside [0, E_logical), without a replica, or a repeat.
_PHYSICAL, _LOGICAL_RANGE, _NO_REPLICA, _LOGICAL_REPEAT = range(4)


def first_bad_pair(spec, topk_ids, num_tokens, rank, logical_ids=None, num_logical: int = 0):
    """(token, k, id, kind, bound) [5] int32 of this rank's first pair with a bad expert id (the
    pairs it sends: t % tp == rank % tp), or all -1. topk_ids [T, K] int32 physical (after the
    expert map, before the rank mask); num_tokens [] int32; rank [] int32. logical_ids: [T, K]
    int32 as given to an expert map (then `id` is the pair's logical id, and kind says why:
    outside [0, num_logical), no replica, or a repeat; bound = num_logical), or None (`id` is
    physical, bound = E)."""
    _, bad = routed_pairs(spec, topk_ids, num_tokens)
    t, k = topk_ids.shape
    bad = bad & (jnp.arange(t)[:, None] % spec.tp_size == rank % spec.tp_size)
    flat = bad.reshape(-1)
    i = jnp.argmax(flat).astype(jnp.int32)
    found = flat[i]
    pid = topk_ids.reshape(-1)[i]
    if logical_ids is None:
        ident, kind, bound = pid, jnp.int32(_PHYSICAL), spec.num_experts
    else:
        ident = logical_ids.reshape(-1)[i].astype(jnp.int32)
        kind = jnp.where((ident < 0) | (ident >= num_logical), _LOGICAL_RANGE,
                         jnp.where(pid == spec.num_experts, _NO_REPLICA, _LOGICAL_REPEAT))
        bound = num_logical
    row = jnp.stack([i // k, i % k, ident, jnp.asarray(kind, jnp.int32), jnp.int32(bound)])
    return jnp.where(found, row, -1).astype(jnp.int32)


def describe(table, num_experts: int, max_tokens: int) -> str:
    """The one message of a failed debug check, from the table [R, 10] int32 of the ranks that
    decided together: the first rank at fault, what it did (a bad id: which token, which id as
    the caller gave it, logical with an expert map, and why; rows past capacity; num_tokens out
    of range), and the totals."""
    table = np.asarray(table).reshape(-1, _COLUMNS)
    at_fault = [row for row in table if row[_DROPPED] or row[_OVERFLOW] or row[_CLAMPED]]
    parts = []
    if at_fault:
        row = at_fault[0]
        r = int(row[_RANK])
        if row[_DROPPED]:
            e, kind, bound = int(row[_ID]), int(row[_KIND]), int(row[_BOUND])
            if kind in (_LOGICAL_RANGE, _NO_REPLICA, _LOGICAL_REPEAT):
                why = {_LOGICAL_RANGE: f"is outside [0, {bound}) (the expert map's logical experts)",
                       _NO_REPLICA: "has no replica in the expert map",
                       _LOGICAL_REPEAT: "repeats an earlier id of its token"}[kind]
                parts.append(f"rank {r}, token {int(row[_TOKEN])}: logical expert {e} {why}")
            else:
                why = (f"is outside [0, {num_experts})" if not 0 <= e < num_experts else
                       "repeats an earlier id of its token")
                parts.append(f"rank {r}, token {int(row[_TOKEN])}: expert id {e} {why}")
        if row[_OVERFLOW]:
            parts.append(f"rank {r} received {int(row[_OVERFLOW])} row(s) past recv_capacity")
        if row[_CLAMPED]:
            parts.append(f"rank {r}: num_tokens {int(row[_GIVEN])} is outside [0, {max_tokens}] (clamped)")
    total = table[:, [_DROPPED, _OVERFLOW, _CLAMPED]].sum(axis=0)
    return (f"jax_moe_a2a (debug=True): {'; '.join(parts)}. In all ranks: {int(total[0])} dropped pair(s), "
            f"{int(total[1])} overflow row(s), {int(total[2])} clamped num_tokens")


class _QuietCallbackFailures(logging.Filter):
    """Drops JAX's log record of a host callback that raised our DroppedRowsError: every rank's
    check raises it (so that every rank stops), and JAX logs each with its traceback (about 12
    lines a rank); the error itself reaches the caller (`Communicator.checked`, `check`)."""

    def filter(self, record):
        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, DroppedRowsError)


_QUIET = _QuietCallbackFailures()
logging.getLogger("jax._src.callback").addFilter(_QUIET)  # once, at import (not at every trace)


def record(counters: Counters, dropped, overflow, masked=None, clamped=None, *, tokens_given=None,
           detail=None, rank=None, spec=None, collect: bool, debug: bool, gather_axis=None):
    """Counts one executed dispatch of this rank on the host (collect) and, with debug, raises
    DroppedRowsError when it dropped pairs, overflowed, or was given a num_tokens outside [0, T]
    (never for masked pairs: they are expected).

    dropped, overflow, masked, clamped (1 when num_tokens was clamped): [] int32 of this rank
    (masked, clamped None: 0); tokens_given: [] int32 num_tokens as given, or None. With debug:
    detail, first_bad_pair's [5] int32; rank [] int32; spec; gather_axis: the EP axis over which every rank decides together
    (Backend.debug_psum; the ranks' rows are gathered so that every rank raises the same
    message), or None (each rank decides alone).
    Returns (`dropped`, gate): `dropped` threaded through the debug check so XLA cannot drop the
    check, and with debug an int32 zero that only the check produces (else None)."""
    zero = jnp.zeros((), jnp.int32)
    masked = zero if masked is None else masked
    clamped = zero if clamped is None else clamped
    given = zero if tokens_given is None else tokens_given
    if collect or debug:  # counted once per executed dispatch, also under jax.checkpoint (`count`)
        count(lambda d, o, m, c: counters.add(d, o, m, c), dropped, overflow, masked, clamped)
    if not debug:
        return dropped, None
    # A pure callback whose result is used: the error surfaces at the outputs. Every rank raises,
    # or none: the ranks' rows are gathered (where XLA's collectives run), so every rank sees what
    # every rank found. A rank left running would wait for the stopped one, in XLA's next
    # collective (pure-JAX backends; XLA:CPU aborts the process after its rendezvous timeout) or
    # in the next FFI half (until timeout_s, several times over: the host backend with
    # recv_capacity overflow on one rank took minutes). Overflow is counted at the receiver and
    # bad ids at the sender, so no rank sees the others' counts without it.
    row = jnp.concatenate([jnp.stack([rank.astype(jnp.int32), dropped, overflow, clamped, given]), detail])
    table = jax.lax.all_gather(row, gather_axis) if gather_axis is not None else row[None]
    num_experts, max_tokens = spec.num_experts, spec.max_tokens_per_rank

    def check(d, tab):  # the counts are in the table (and counted by `count` above)
        tab = np.asarray(tab).reshape(-1, _COLUMNS)
        if tab[:, [_DROPPED, _OVERFLOW, _CLAMPED]].any():
            err = DroppedRowsError(describe(tab, num_experts, max_tokens))
            counters.record_error(err)  # kept here: this check may be rematerialised, `count` is not
            raise err
        return np.int32(d), np.int32(0)

    i32 = jax.ShapeDtypeStruct((), jnp.int32)
    return jax.pure_callback(check, (i32, i32), dropped, table)


__all__ = ["Counters", "after", "record", "first_bad_pair", "describe", "logger"]
