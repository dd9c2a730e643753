"""Slot tracking: which buffer slots have a dispatch in flight in each trace being built, so that
a second dispatch_send on a busy slot is refused at trace time, and the slot's next use is ordered
after its last exchange (docs/overlap.md). No other module of ours."""

from __future__ import annotations

import threading
import weakref

import jax

try:
    from jax.extend.core import get_opaque_trace_state as _get_opaque_trace_state
except ImportError:  # pragma: no cover - JAX versions without it: no slot check
    _get_opaque_trace_state = None


def _trace_state():
    """An opaque token of the trace being built (jit, shard_map body, custom_vjp rule, ...), or
    None outside any trace or where JAX lacks the API. Equal for calls in one trace only."""
    try:
        return _get_opaque_trace_state(convention="jax_moe_a2a")
    except Exception:  # pragma: no cover - JAX versions without it: no slot check
        return None


def _trace_of(state):
    """The trace of `state` while it lives, else None (also where JAX does not say)."""
    ref = getattr(state, "_trace_ref", None)
    return ref() if callable(ref) else None


def _alive(state) -> bool:
    ref = getattr(state, "_trace_ref", None)
    return not callable(ref) or ref() is not None  # where JAX does not say: taken as alive


def _enclosing(state) -> list:
    """The traces enclosing the one of `state`, nearest first (`parent_trace`, jax 0.10, 0.11), or
    [] where JAX does not say."""
    trace = _trace_of(state)
    out = []
    while trace is not None and len(out) < 1000:
        trace = getattr(trace, "parent_trace", None)
        if trace is not None:
            out.append(trace)
    return out


class _PerTrace:
    """A table per trace being built ({slot: value}), for the last MAX_TRACES traces still alive.
    Callers hold `lock` around `table` and every use of the table it returns."""

    MAX_TRACES = 64

    def __init__(self):
        self.lock = threading.Lock()
        self.traces = []  # [(trace state, {slot: value})], oldest first

    def table(self, state, create: bool):
        """The table of the trace of `state` (a new empty one with create=True, else None when
        there is none); drops the tables of traces that are gone."""
        self.traces = [(t, d) for t, d in self.traces if _alive(t)]
        for t, d in self.traces:
            if t == state:
                return d
        if not create:
            return None
        d = {}
        self.traces.append((state, d))
        del self.traces[:-self.MAX_TRACES]
        return d


class SlotTracker:
    """Which slots have a dispatch in flight in each trace being built: from dispatch_send until
    the combine_recv on that slot (a combine on another slot frees the dispatch's slot at its
    combine_send and holds its own slot until its combine_recv) (docs/overlap.md: each slot runs dispatch_send, dispatch_recv,
    combine_send, combine_recv before its next dispatch_send). A second dispatch_send on a busy
    slot in the same trace would hang the FFI backends (it waits for the peers' dispatch_recv of
    the first, which XLA may order after it) or mix up routing state, so it is refused at trace
    time. Keyed by the trace, not the communicator: one communicator serves many traces (jit
    retraces, grad's forward and backward, remat, custom_vjp rules), each checked on its own. The
    custom_vjp rules (jax_moe_a2a/autodiff.py) call the communicator's halves untracked: JAX traces
    them at times it picks, and the one-shot call is tracked in the caller's trace instead."""

    def __init__(self):
        self._tables = _PerTrace()  # {slot: True while a dispatch or combine holds it}

    def _state(self):
        return _trace_state()

    def open(self, slot: int, num_slots: int):
        state = self._state()
        if state is None:
            return
        with self._tables.lock:
            self._open(state, slot, num_slots)

    def move(self, from_slot: int, slot: int, num_slots: int):
        """A combine_send on `slot` for the dispatch on `from_slot` (slot != from_slot): refused
        (ValueError naming the free slots) when `slot` has a dispatch or another combine in flight
        in this trace; else the dispatch's slot is done (its rows are read back) and `slot` is
        held by this combine until its combine_recv closes it (one step: no other thread's
        open or close comes between the check and the update)."""
        state = self._state()
        if state is None:
            return
        with self._tables.lock:
            busy = self._tables.table(state, create=False)
            if busy is not None and slot in busy:
                free = [z for z in range(num_slots) if z not in busy or z == from_slot]
                raise ValueError(
                    f"slot {slot}: combine_send(slot={slot}) onto a slot that is in use in this trace (a "
                    f"dispatch or a combine on slot {slot} has not reached its combine_recv yet); the "
                    f"combine would wait for that slot to be freed. Combine on a free slot (free: {free}, "
                    f"the dispatch's own slot {from_slot} among them; Spec.slots={num_slots}) or finish "
                    f"the other cycle on slot {slot} first")
            self._close(state, from_slot)
            self._open(state, slot, num_slots)

    def close(self, slot: int):
        """The cycle holding `slot` in this trace is over (combine_recv; or combine_send on
        another slot, for the dispatch's)."""
        state = self._state()
        if state is None:
            return
        with self._tables.lock:
            self._close(state, slot)

    def _open(self, state, slot: int, num_slots: int):
        """open() under the lock."""
        busy = self._tables.table(state, create=True)
        if slot in busy:
            free = [z for z in range(num_slots) if z not in busy]
            raise ValueError(
                f"slot {slot}: a dispatch on slot {slot} is still in flight in this trace (dispatch_send "
                f"without the combine_recv on that slot yet); a slot runs dispatch_send, dispatch_recv, "
                f"combine_send, combine_recv before its next dispatch_send. Use another slot "
                f"({'free: ' + str(free) if free else 'none free: raise Spec.slots'}, Spec.slots={num_slots}) "
                f"or finish the first dispatch's combine first")
        busy[slot] = True

    def _close(self, state, slot: int):
        """close() under the lock."""
        busy = self._tables.table(state, create=False)
        if busy is not None and slot in busy:
            busy.pop(slot)
            return
        # Not open in this trace: a cycle that began in an enclosing trace ends in a nested
        # one (e.g. the combine inside a jax.checkpoint body). Free it in the nearest
        # enclosing trace that holds it; where none does (JAX does not say which traces
        # enclose this one, or the cycle began in a trace apart from them), in every trace
        # that holds it, rather than refuse the next dispatch there.
        holding = [(_trace_of(t), d) for t, d in self._tables.traces if slot in d]
        for trace in _enclosing(state):
            for tr, d in holding:
                if tr is trace:
                    d.pop(slot)
                    return
        for _, d in self._tables.traces:
            d.pop(slot, None)


class SlotToken:
    """The result of the last exchange on one slot traced so far in one trace (a forward combine,
    or a backward exchange of the custom_vjp rules, jax_moe_a2a/autodiff.py), which the next
    backward exchange on the slot is ordered after (`after=`), and which dispatch's routing the
    slot holds. `get` returns the token only in the trace that set it (a tracer of another trace
    must not be used there)."""

    __slots__ = ("_state", "_token", "cycle", "dispatched", "__weakref__")

    def __init__(self):
        self._state, self._token = None, None
        # cycle: the identity of the latest dispatch received on the slot in this trace;
        # dispatched: the cycle whose route the slot's latest dispatch (forward, or a backward
        # one of the rules) had, i.e. whose routing state the slot holds then (the host
        # backend's combine offsets), or None.
        self.cycle, self.dispatched = None, None

    def set(self, token):
        """token: any array (or pytree of arrays) of the trace being built."""
        self._state, self._token = _trace_state(), token

    def get(self):
        """The last token set in the trace being built, else None."""
        if self._token is None or self._state is None or self._state != _trace_state():
            return None
        return self._token


class SlotOrder:
    """Each slot's `SlotToken` in each trace being built, held weakly: the custom_vjp rules that
    set or read a slot's token hold it (they live as long as JAX needs them), so that the FFI
    backends' backward exchanges on a slot run one after another, after the forward's last
    exchange there, in the order they are traced (reverse program order), whatever their
    cotangents depend on."""

    def __init__(self):
        self._tables = _PerTrace()  # {slot: weakref.ref(SlotToken)}

    def token(self, slot: int) -> SlotToken:
        """The token of `slot` in the trace being built (a fresh one outside any trace)."""
        state = _trace_state()
        if state is None:
            return SlotToken()
        with self._tables.lock:
            d = self._tables.table(state, create=True)
            tok = d[slot]() if slot in d else None
            if tok is None:
                tok = SlotToken()
                d[slot] = weakref.ref(tok)
            return tok


class SlotChain:
    """The last exchange traced on each slot in each trace being built, which the slot's next use
    in that trace runs after: `dispatch_send` on the slot, or a `combine_send` onto it from
    another slot's dispatch, takes it as part of `after=`. XLA orders custom calls only through
    data: two layers of one jit on one slot that share no data (independent micro-batches, or a
    layer whose input does not come from the previous one) could run side by side, and the FFI
    backends' second dispatch_send waited for the peers' FREE of the first until timeout_s.
    Recorded: a combine_recv's output (for its slot), and a combine_send onto another slot's
    handle (for the dispatch's slot, free from there on). SlotTracker refuses the uses it cannot
    order (a second dispatch on a slot before the first's combine_recv is traced).

    Held weakly (a tracer holds its trace; holding it would keep every traced program alive): a
    result the caller dropped orders nothing, as before. Only the trace that recorded a value
    sees it (a tracer of another trace must not be used there)."""

    def __init__(self):
        self._tables = _PerTrace()  # {slot: weakref.ref(array of that trace)}

    def record(self, slot: int, value):
        """value: an array of the trace being built (or a pytree: its first leaf) that the slot's
        next use must follow."""
        state = _trace_state()
        leaves = jax.tree.leaves(value)
        if state is None or not leaves:
            return
        try:
            ref = weakref.ref(leaves[0])
        except TypeError:  # a concrete value (outside jit): nothing to order
            return
        with self._tables.lock:
            self._tables.table(state, create=True)[slot] = ref

    def follow(self, slot: int, after):
        """`after` extended by the slot's last exchange in the trace being built (when there is
        one still alive): what the slot's next send takes as `after=`."""
        state = _trace_state()
        if state is None:
            return after
        with self._tables.lock:
            d = self._tables.table(state, create=False)
            prev = None if d is None or slot not in d else d[slot]()
        if prev is None:
            return after
        return prev if after is None else (after, prev)


__all__ = ["SlotTracker", "SlotToken", "SlotOrder", "SlotChain"]
