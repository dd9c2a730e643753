"""The communicator: validates every call at trace time and forwards it to a backend.

Use it inside `jax.shard_map` over the EP axis; every array argument is one rank's shard. On a
mesh with more axes than the EP axis (e.g. ("dp", "ep")), every position along the other axes is
an independent EP group: its ranks exchange only among themselves (see `Communicator.groups`).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import weakref
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from . import backends as _backends
from . import runtime as _runtime
from .backends.base import Ctx
from .config import COMMON_OPTIONS, Config, check_options  # noqa: F401 (check_options: re-exported)
from .eplb import ExpertMap, check_expert_map, map_ids
from .groups import ep_groups, local_members
from .quant import dequantize_fp8
from .spec import FP8_DTYPES, INPUT_DTYPES, COMBINE_DTYPES, Spec
from .types import CombineHandle, DispatchHandle, Dispatched, Route

_COMM_IDS = itertools.count(1)
# The library's messages go through this logger (never print); configure it with `logging`.
logger = logging.getLogger("jax_moe_a2a")


def _shape_err(arg: str, expected, got) -> ValueError:
    return ValueError(f"{arg}: expected {expected}, got {got}")


def _after(gate, tree):
    """`tree` with every array made data-dependent on the int32 scalar `gate` (zero at run time,
    unknown to XLA): integers get gate added, floats the same on their bits."""
    def one(a):
        dt = jnp.dtype(a.dtype)
        if jnp.issubdtype(dt, jnp.integer):
            return a + gate.astype(dt)
        bits = jnp.dtype(f"uint{8 * dt.itemsize}")
        return jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(a, bits) + gate.astype(bits), dt)
    return jax.tree_util.tree_map(one, tree)


class PeerFailure(str):
    """What the host backend recorded when a half failed: the text of the first failure (it is a
    str, so code that reads `last_error()` as text keeps working; also `.message`) and `missing`
    (sorted ranks that timed-out waits named, over this process's ranks and EP groups).
    `missing` is a hint, not the set of dead ranks: a survivor that failed earlier in the same
    step never sent what the others waited for, so it is named too."""

    def __new__(cls, message: str, missing):
        self = super().__new__(cls, message)
        self.missing = tuple(sorted(set(int(r) for r in missing)))
        return self

    @property
    def message(self) -> str:
        return str.__str__(self)

    def __repr__(self):
        return f"PeerFailure({self.message!r}, missing={self.missing})"


class DroppedRowsError(RuntimeError):
    """debug=True: a dispatch dropped pairs (bad expert ids) or overflowed a receive buffer.

    The check runs inside the compiled step (a host callback), and JAX reports an exception
    raised there as `jax.errors.JaxRuntimeError` (INTERNAL), not as this class: Python has no
    way to make `except DroppedRowsError` match that error. Run the step inside
    `with comm.checked():`, which re-raises it as DroppedRowsError, or call `comm.check()`."""


def _trace_state():
    """An opaque token of the trace being built (jit, shard_map body, custom_vjp rule, ...), or
    None outside any trace or where JAX lacks the API. Equal for calls in one trace only."""
    try:
        from jax.extend.core import get_opaque_trace_state
        return get_opaque_trace_state(convention="jax_moe_a2a")
    except Exception:  # pragma: no cover - JAX versions without it: no slot check
        return None


def _alive(state) -> bool:
    ref = getattr(state, "_trace_ref", None)
    return ref is None or not callable(ref) or ref() is not None


class _SlotTracker:
    """Which slots have a dispatch in flight in each trace being built: from dispatch_send until
    the combine_recv on that slot (docs/overlap.md: each slot runs dispatch_send, dispatch_recv,
    combine_send, combine_recv before its next dispatch_send). A second dispatch_send on a busy
    slot in the same trace would hang the FFI backends (it waits for the peers' dispatch_recv of
    the first, which XLA may order after it) or mix up routing state, so it is refused at trace
    time. Keyed by the trace, not the communicator: one communicator serves many traces (jit
    retraces, grad's forward and backward, remat, custom_vjp rules), each checked on its own."""

    MAX_TRACES = 64

    def __init__(self):
        self._lock = threading.Lock()
        self._traces = []  # [(trace state, {slot: True while a dispatch is in flight})]
        self._local = threading.local()

    @contextlib.contextmanager
    def suppressed(self):
        """No tracking inside: the custom_vjp rules of the one-shot ops (jax_moe_a2a/autodiff.py)
        trace their halves in traces of their own, at times JAX picks; the one-shot call is
        tracked in the caller's trace instead."""
        self._local.depth = getattr(self._local, "depth", 0) + 1
        try:
            yield
        finally:
            self._local.depth -= 1

    def _state(self):
        return None if getattr(self._local, "depth", 0) else _trace_state()

    def _find(self, state, create):
        self._traces = [(t, d) for t, d in self._traces if _alive(t)]
        for t, d in self._traces:
            if t == state:
                return d
        if not create:
            return None
        d = {}
        self._traces.append((state, d))
        del self._traces[:-self.MAX_TRACES]
        return d

    def open(self, slot: int, num_slots: int):
        state = self._state()
        if state is None:
            return
        with self._lock:
            busy = self._find(state, create=True)
            if slot in busy:
                free = [z for z in range(num_slots) if z not in busy]
                raise ValueError(
                    f"slot {slot}: a dispatch on slot {slot} is still in flight in this trace (dispatch_send "
                    f"without the combine_recv on that slot yet); a slot runs dispatch_send, dispatch_recv, "
                    f"combine_send, combine_recv before its next dispatch_send. Use another slot "
                    f"({'free: ' + str(free) if free else 'none free: raise Spec.slots'}, Spec.slots={num_slots}) "
                    f"or finish the first dispatch's combine first")
            busy[slot] = True

    def close(self, slot: int):
        state = self._state()
        if state is None:
            return
        with self._lock:
            busy = self._find(state, create=False)
            if busy is not None:
                busy.pop(slot, None)
                return
            # No dispatch in this trace: a cycle that began in an enclosing trace ends in a nested
            # one (e.g. the combine inside a jax.checkpoint body). Free the slot where it is open.
            for _, d in self._traces:
                d.pop(slot, None)


class Communicator:
    """One MoE all-to-all over one mesh axis (or a tuple of axes). Create with `jax_moe_a2a.init`.

    Attributes: spec, mesh, axis, num_ranks (ranks of one EP group), backend_name, debug,
    timeout_s, group_axes (the mesh's other axes), num_groups, groups (devices [G, N]: row g is
    EP group g in rank order; see `ep_groups`), config (the `jax_moe_a2a.config.Config` the
    backend was opened with), options (the backend options as given).

    The backend is opened from (config, mesh, axis) and never sees the communicator; its
    diagnostics come through `proxy_stats`, `kernel_seconds`, `last_error`, `buffer_regions` and
    `diagnostics`.
    """

    def __init__(self, spec: Spec, mesh, axis, backend: str = "auto", *, debug: bool = False,
                 timeout_s: float = 60.0, collect_stats: Optional[bool] = None, **options):
        if not isinstance(spec, Spec):
            raise ValueError(f"spec: expected a jax_moe_a2a.Spec, got {type(spec).__name__}")
        self.group_axes, self.groups = ep_groups(mesh, axis)
        self.spec = spec
        self.mesh = mesh
        self.axis = axis
        self.num_groups, self.num_ranks = (int(v) for v in self.groups.shape)
        spec.check_ranks(self.num_ranks)
        if timeout_s <= 0:
            raise ValueError(f"timeout_s: expected > 0, got {timeout_s}")
        self.debug = bool(debug)
        self.timeout_s = float(timeout_s)
        if collect_stats is None:  # a host callback per dispatch: fine on CPUs, a stream sync on GPUs
            collect_stats = all(d.platform == "cpu" for d in mesh.devices.flat)
        self.collect_stats = bool(collect_stats) or self.debug
        self._backend = _backends.create(backend)
        self.backend_name = self._backend.name
        self.options = dict(options)  # Config.build refuses a name the backend does not declare
        self.config = Config.build(spec, self.num_ranks, self._backend, timeout_s=self.timeout_s,
                                   options=self.options)
        self.comm_id = next(_COMM_IDS)
        self._call_ids = itertools.count(1)
        self._lock = threading.Lock()
        self._stats = {"dispatches": 0, "dropped": 0, "overflow": 0, "masked": 0}
        self._slots = _SlotTracker()
        self._errors = []  # DroppedRowsErrors the debug check raised in this process, for check()
        try:
            self._backend.open(self.config, mesh, axis, self.comm_id)
        except BaseException:
            self._backend.close()  # what a failed open created (idempotent)
            raise
        # The backend's native state lives as long as the communicator (or until close()).
        self._finalizer = weakref.finalize(self, self._backend.close)
        # repr(self), not self: a handler that keeps records (pytest's, a memory handler) would keep
        # the communicator alive through the record's arguments
        logger.info("jax_moe_a2a: %s (requested backend %r, options %s, debug=%s, collect_stats=%s)", repr(self),
                    backend, self.options, self.debug, self.collect_stats)

    def __repr__(self):
        groups = f", groups={self.num_groups} over {self.group_axes!r}" if self.num_groups > 1 else ""
        return (f"Communicator(backend={self.backend_name!r}, ranks={self.num_ranks}, axis={self.axis!r}{groups}, "
                f"{self.spec.describe()})")

    def local_members(self) -> dict:
        """{group: [ranks within the group]} of this process's devices (groups without local
        devices left out), both ascending."""
        return local_members(self.groups)

    # ---- helpers -----------------------------------------------------------------------------
    def _ctx(self) -> Ctx:
        try:
            rank = jax.lax.axis_index(self.axis)
        except NameError as e:
            raise ValueError(
                f"jax_moe_a2a ops must run inside jax.shard_map over axis {self.axis!r}") from e
        return Ctx(self.spec, self.num_ranks, self.axis, rank.astype(jnp.int32), self.comm_id,
                   next(self._call_ids), self.config, self.group_axes)

    def _check_slot(self, slot):
        if isinstance(slot, bool) or not isinstance(slot, (int, np.integer)) or not 0 <= slot < self.spec.slots:
            raise ValueError(f"slot: expected an int in [0, {self.spec.slots}), got {slot!r}")
        return int(slot)

    def _check_mine(self, arg: str, obj):
        if getattr(obj, "comm_id", None) != self.comm_id:
            raise ValueError(f"{arg}: was produced by another communicator (spec or mesh mismatch); "
                             f"expected comm_id {self.comm_id}, got {getattr(obj, 'comm_id', None)}")

    def _num_tokens(self, num_tokens):
        t = self.spec.max_tokens_per_rank
        if num_tokens is None:
            return jnp.int32(t)
        if isinstance(num_tokens, (int, np.integer)) and not isinstance(num_tokens, bool):
            if not 0 <= num_tokens <= t:
                raise ValueError(f"num_tokens: expected 0 <= num_tokens <= {t}, got {num_tokens}")
            return jnp.int32(num_tokens)
        n = jnp.asarray(num_tokens)
        if n.size != 1 or not jnp.issubdtype(n.dtype, jnp.integer):
            raise ValueError(f"num_tokens: expected an integer scalar (shape () or (1,)), got "
                             f"{n.dtype}{list(n.shape)}")
        return jnp.clip(n.reshape(()).astype(jnp.int32), 0, t)

    def _validate_dispatch(self, x, topk_ids, topk_weights, x_scale):
        s = self.spec
        t, h, k = s.max_tokens_per_rank, s.hidden, s.experts_per_token
        if tuple(x.shape) != (t, h):
            raise _shape_err("x", f"shape [T, H] = {[t, h]} (one rank's shard)", list(x.shape))
        xd = np.dtype(x.dtype)
        if xd in FP8_DTYPES:
            if not s.is_fp8:
                raise ValueError(f"x: fp8 input needs Spec.dispatch_dtype fp8, spec has {s.dispatch_dtype}")
            if x_scale is None:
                raise ValueError("x_scale: required when x is already fp8, shape [T, ceil(H / scale_block)] f32")
            if tuple(x_scale.shape) != (t, s.num_scales) or np.dtype(x_scale.dtype) != np.float32:
                raise _shape_err("x_scale", f"float32{[t, s.num_scales]}", f"{x_scale.dtype}{list(x_scale.shape)}")
        elif xd not in INPUT_DTYPES:
            raise ValueError(f"x: expected dtype bf16, f16, f32 (or fp8 with x_scale), got {xd}")
        elif x_scale is not None:
            raise ValueError("x_scale: only valid with fp8 x")
        if tuple(topk_ids.shape) != (t, k):
            raise _shape_err("topk_ids", f"shape [T, K] = {[t, k]}", list(topk_ids.shape))
        if np.dtype(topk_ids.dtype) != np.int32:
            raise _shape_err("topk_ids", "dtype int32", topk_ids.dtype)
        if tuple(topk_weights.shape) != (t, k):
            raise _shape_err("topk_weights", f"shape [T, K] = {[t, k]}", list(topk_weights.shape))
        if np.dtype(topk_weights.dtype) != np.float32:
            raise _shape_err("topk_weights", "dtype float32", topk_weights.dtype)

    def _record_stats(self, dropped, overflow, masked=None):
        """Counts drops/overflow (and pairs the rank mask stopped) on the host (collect_stats) and,
        with debug=True, raises (never for masked pairs: they are expected).
        Returns (`dropped`, gate): `dropped` threaded through the debug check so XLA cannot drop
        the check, and with debug=True an int32 zero that only the check produces (else None)."""
        masked = jnp.zeros((), jnp.int32) if masked is None else masked
        # The callbacks hold the communicator weakly: the compiled step keeps them (and the jit
        # caches keep the step), so a strong reference would keep the communicator, its engines
        # and their progress threads alive for the life of the process (a test suite under mpirun
        # gained two threads per test and spent more time waking them than computing).
        comm_ref = weakref.ref(self)

        def record(d, o, m=0, err=None):
            self_ = comm_ref()
            if self_ is None:  # a step compiled for a communicator since collected
                return
            with self_._lock:
                self_._stats["dispatches"] += 1
                self_._stats["dropped"] += int(d)
                self_._stats["overflow"] += int(o)
                self_._stats["masked"] += int(m)
                if err is not None and len(self_._errors) < 64:
                    self_._errors.append(err)

        if self.collect_stats and not self.debug:
            jax.debug.callback(record, dropped, overflow, masked)
        if self.debug:  # a pure callback whose result is used: the error surfaces at the outputs
            # Every rank raises, or none: a psum of the counts decides for all (where XLA's collectives
            # run: Backend.debug_psum; not on the GPU FFI backends). A rank left running
            # would wait for the stopped one, in XLA's next collective (pure-JAX backends; XLA:CPU
            # aborts the process after its rendezvous timeout) or in the next FFI half (until
            # timeout_s, several times over: the host backend with recv_capacity overflow on one
            # rank took minutes). Overflow is counted at the receiver and bad ids at the sender,
            # so no rank sees the others' counts without it.
            bad = dropped + overflow  # this rank's
            if self._backend.debug_psum:  # every rank raises, or none (see Backend.debug_psum)
                bad = jax.lax.psum(bad, self.axis)

            def check(d, o, b, m):
                # (the communicator only inside record(): this frame, which the error's traceback
                # keeps, must not hold it)
                err = None
                if int(b):
                    err = DroppedRowsError(
                        f"jax_moe_a2a: dispatch dropped {int(d)} pair(s) with bad expert ids and {int(o)} row(s) "
                        f"past recv_capacity on this rank, {int(b)} in all ranks (debug=True)")
                record(d, o, m, err)
                if err is not None:
                    logger.error("%s", err)
                    raise err
                return np.int32(d), np.int32(0)

            i32 = jax.ShapeDtypeStruct((), jnp.int32)
            dropped, gate = jax.pure_callback(check, (i32, i32), dropped, overflow, bad, masked)
            return dropped, gate
        return dropped, None

    # ---- the four halves ---------------------------------------------------------------------
    def _map_experts(self, topk_ids, expert_map, rank_mask=None):
        """Logical ids -> physical ids by `expert_map` (jax_moe_a2a/eplb.py), or unchanged; with
        a rank mask, replicas on masked ranks are skipped while a live one exists."""
        if expert_map is None:
            return topk_ids
        check_expert_map(expert_map)
        group = self._ctx().rank // self.spec.tp_size
        alive = None if rank_mask is None else rank_mask != 0
        with jax.named_scope("a2a_expert_map"):
            return map_ids(expert_map, topk_ids, group, self.spec.num_experts, alive, self.num_ranks)

    def _check_rank_mask(self, rank_mask):
        """rank_mask -> int32 [N] (1 = alive) or None. A concrete all-alive mask (NumPy, a list,
        a committed jax.Array) is None: the same program as no mask, so every backend takes it.
        Otherwise the backend must honour masks (Backend.rank_mask_unsupported)."""
        if rank_mask is None:
            return None
        n = self.num_ranks
        if not hasattr(rank_mask, "shape") or not hasattr(rank_mask, "dtype"):
            rank_mask = np.asarray(rank_mask)  # a list or tuple
        shape, dtype = tuple(rank_mask.shape), np.dtype(rank_mask.dtype)
        if shape != (n,):
            raise _shape_err("rank_mask", f"shape [N] = [{n}] (one flag per EP rank)", list(shape))
        if dtype != np.bool_ and not np.issubdtype(dtype, np.integer):
            raise _shape_err("rank_mask", "dtype bool or an integer (nonzero = alive)", dtype)
        try:
            concrete = np.asarray(rank_mask)
        except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError, TypeError):
            concrete = None
        if concrete is not None and concrete.dtype != object and bool(np.all(concrete != 0)):
            return None
        reason = self._backend.rank_mask_unsupported()
        if reason is not None:
            raise ValueError(f"rank_mask is not supported by the {self.backend_name} backend yet: {reason}")
        if concrete is not None and concrete.dtype != object and not bool(np.any(concrete != 0)):
            raise ValueError("rank_mask: every rank is masked (at least the calling ranks must be alive)")
        return (jnp.asarray(rank_mask) != 0).astype(jnp.int32)

    def _mask_ids(self, ctx, topk_ids, n, mask):
        """(physical ids with the pairs the mask stops set to E, masked [] int32): a pair is stopped
        when its expert's rank or its sender (the tp member g * tp + t % tp; this rank for its own
        tokens) is masked; counted when routed and this rank sends it. The backend sees E, drops
        the pair and counts it as dropped: the caller subtracts `masked` from that count. Every tp
        member stops the same pairs of the group's tokens, so none reads back a combine row that
        a masked member never sent."""
        from .backends.pure_jax import routed_pairs
        s = self.spec
        alive = mask != 0
        l_count = s.local_experts(self.num_ranks)
        routed, _ = routed_pairs(s, topk_ids, n)
        in_range = (topk_ids >= 0) & (topk_ids < s.num_experts)
        dest = jnp.clip(topk_ids, 0, s.num_experts - 1) // l_count
        tok = jnp.arange(topk_ids.shape[0], dtype=jnp.int32)
        sender = ctx.rank // s.tp_size * s.tp_size + tok % s.tp_size
        stop = in_range & ~(alive[dest] & alive[sender][:, None])
        mine = (tok % s.tp_size == ctx.rank % s.tp_size)[:, None]
        masked = jnp.sum(routed & stop & mine, dtype=jnp.int32)
        return jnp.where(stop, jnp.int32(s.num_experts), topk_ids).astype(jnp.int32), masked

    def dispatch_send(self, x, topk_ids, topk_weights, num_tokens=None, *, slot: int = 0,
                      x_scale=None, after=None, expert_map: Optional[ExpertMap] = None,
                      rank_mask=None) -> DispatchHandle:
        """Starts sending this rank's tokens to the ranks hosting their experts.

        Args:
          x: [T, H] bf16/f16/f32, or float8_e4m3fn with `x_scale` [T, ceil(H/scale_block)] f32.
          topk_ids: [T, K] int32 expert ids in [0, E); -1 = not routed; others dropped+counted.
          topk_weights: [T, K] f32 router weights (used by combine).
          num_tokens: [] int32 device scalar (or int); rows at or past it are ignored. Default T.
          slot: buffer slot in [0, Spec.slots) (static).
          after: optional array this send must run after. XLA orders the halves only through data;
            two uses of one slot that share no data (e.g. a backward pass reusing the forward's
            slot) need it.
          expert_map: optional `ExpertMap` (redundant experts, EPLB): topk_ids are then LOGICAL
            expert ids, each pair sent to one replica (jax_moe_a2a/eplb.py has the rule); the
            backend and `got.group_sizes` see PHYSICAL experts (Spec.num_experts of them).
          rank_mask: optional [N] bool or integer device array over the EP ranks (nonzero = alive),
            replicated (shard_map in_spec P()), the same on every live rank; pass it as an argument
            of the jitted step, so that a new mask reuses the compiled step. Pairs whose expert
            lives on a masked rank are not sent (with `expert_map`, a live replica is chosen
            first); they are counted in `got.num_masked` and `stats()['masked']`, never as
            dropped (debug=True does not raise for them). No half waits for, or writes to, a
            masked rank; a masked rank that still runs sends and receives nothing, and its
            combine output is 0 (or `out`). The combine halves take the mask from `got`. A
            concrete all-alive mask is the same as none. Backends: reference, ragged (send-side
            only: their XLA collectives still need every process), host (also skips masked peers;
            not with proxied=True), cuda (its kernels skip masked peers; not with node_size < N),
            nvshmem (its kernels skip masked peers; their per-source row counters stand still
            while a rank is masked). docs/api.md.
        Returns: a DispatchHandle for `dispatch_recv`.
        """
        slot = self._check_slot(slot)
        self._validate_dispatch(x, topk_ids, topk_weights, x_scale)
        mask = self._check_rank_mask(rank_mask)
        topk_ids = self._map_experts(topk_ids, expert_map, mask)
        n = self._num_tokens(num_tokens)
        ctx = self._ctx()
        self._slots.open(slot, self.spec.slots)
        with jax.named_scope("a2a_dispatch_send"):
            send_ids, masked = topk_ids, None
            if mask is not None:
                send_ids, masked = self._mask_ids(ctx, topk_ids, n, mask)
            extra = {} if mask is None else {"rank_mask": mask}
            arrays, route_arrays, dropped = self._backend.dispatch_send(
                ctx, x, x_scale, send_ids, topk_weights, n, slot, after=after,
                **(extra if self._backend.takes_rank_mask else {}))
        # topk_ids: the physical ids before the mask (the combine's backward dispatch re-applies it)
        route = Route(topk_weights.astype(jnp.float32), n, dict(route_arrays, topk_ids=topk_ids, **extra),
                      self.comm_id)
        arrays = dict(arrays, _dropped=dropped if masked is None else dropped - masked)
        if masked is not None:
            arrays["_masked"] = masked
        return DispatchHandle(arrays, route, slot, self.comm_id)

    def dispatch_recv(self, handle: DispatchHandle) -> Dispatched:
        """Waits for this rank's incoming tokens and lays them out (see `Dispatched`)."""
        if not isinstance(handle, DispatchHandle):
            raise ValueError(f"handle: expected the DispatchHandle from dispatch_send, got {type(handle).__name__}")
        self._check_mine("handle", handle)
        ctx = self._ctx()
        arrays = dict(handle.arrays)
        dropped = arrays.pop("_dropped")
        masked = arrays.pop("_masked", None)
        with jax.named_scope("a2a_dispatch_recv"):
            x, scale, sizes, weights, src, overflow, route_arrays = self._backend.dispatch_recv(
                ctx, arrays, handle.route.arrays, handle.slot)
            if self.spec.recv_dtype is not None and scale is not None:  # the backend returned fp8 rows
                x, scale = dequantize_fp8(x, scale, self.spec.scale_block).astype(self.spec.recv_dtype), None
        dropped, gate = self._record_stats(dropped, overflow, masked)
        if self.debug:  # what follows the dispatch (the combine's communication too) waits for the check
            # An optimisation barrier orders XLA's schedule, but XLA:CPU runs thunks as soon as their
            # buffers are ready: only a data dependency keeps a rank whose check raised from
            # entering the combine's all_to_all alone (which aborted the process after 40 s).
            x, scale, weights, src, route_arrays = _after(gate, (x, scale, weights, src, route_arrays))
            dropped, x, weights, route_arrays = jax.lax.optimization_barrier((dropped, x, weights, route_arrays))
        route = Route(handle.route.topk_weights, handle.route.num_tokens, route_arrays, self.comm_id)
        return Dispatched(x, scale, sizes, weights, src, dropped, overflow, route, handle.slot, self.comm_id,
                          num_masked=masked)

    def combine_send(self, y, got: Dispatched, *, slot: Optional[int] = None, after=None) -> CombineHandle:
        """Starts sending expert outputs back to their tokens' ranks.

        Args:
          y: expert outputs in `got.x`'s layout ([R, H] or [L, C, H]), bf16/f16/f32. They travel
            in their own dtype when it is no wider than Spec.combine_dtype, else they are cast to
            Spec.combine_dtype first (the combine buffers are sized for it; set combine_dtype
            f32 to send f32 outputs exactly). Accumulation is f32 either way.
          got: the `Dispatched` of the matching dispatch.
          slot: buffer slot (default: the dispatch's).
        """
        if not isinstance(got, Dispatched):
            raise ValueError(f"got: expected the Dispatched from dispatch_recv, got {type(got).__name__}")
        self._check_mine("got", got)
        slot = got.slot if slot is None else self._check_slot(slot)
        if slot != got.slot:  # the dispatch's slot is done once its rows are read back here
            self._slots.close(got.slot)
        expected = tuple(self.spec.recv_shape(self.num_ranks)) + (self.spec.hidden,)
        if tuple(y.shape) != expected:
            raise _shape_err("y", f"shape {list(expected)} (the layout of got.x)", list(y.shape))
        if np.dtype(y.dtype) not in COMBINE_DTYPES:
            raise _shape_err("y", "dtype bf16, f16 or f32", y.dtype)
        wire = self.spec.combine_wire_dtype(y.dtype)
        if wire != np.dtype(y.dtype):  # the combine buffers hold rows of Spec.combine_dtype
            y = y.astype(wire)
        ctx = self._ctx()
        with jax.named_scope("a2a_combine_send"):
            arrays = self._backend.combine_send(ctx, y, got.route, slot, after=after, from_slot=got.slot)
        return CombineHandle(arrays, got.route, slot, self.comm_id)

    def combine_recv(self, handle: CombineHandle, out=None):
        """Waits for the expert outputs and reduces them.

        Returns [T, H] in Spec.combine_dtype: for t < num_tokens, sum over routed pairs of
        weight * expert output (f32 accumulation), plus `out[t]` when `out` is given; rows at or
        past num_tokens are 0, or `out` unchanged.
        """
        if not isinstance(handle, CombineHandle):
            raise ValueError(f"handle: expected the CombineHandle from combine_send, got {type(handle).__name__}")
        self._check_mine("handle", handle)
        return self._combine_recv(handle, out)

    def _combine_recv(self, handle, out, pairs=False):
        s = self.spec
        if out is not None and tuple(out.shape) != (s.max_tokens_per_rank, s.hidden):
            raise _shape_err("out", f"shape [T, H] = {[s.max_tokens_per_rank, s.hidden]}", list(out.shape))
        ctx = self._ctx()
        self._slots.close(handle.slot)
        with jax.named_scope("a2a_combine_recv"):
            res = self._backend.combine_recv(ctx, handle.arrays, handle.route, handle.slot, out, pairs=pairs)
        mask = handle.route.arrays.get("rank_mask")
        if mask is None:
            return res
        # A masked rank's tokens are not produced: 0, or `out` (its own pairs were stopped at the
        # send; with tp_size > 1 its group members' expert outputs would still reach it).
        me = mask[ctx.rank] != 0
        acc, rows = (res if pairs else (res, None))
        base = jnp.zeros_like(acc) if out is None else out.astype(acc.dtype)
        acc = jnp.where(me, acc, base)
        return (acc, jnp.where(me, rows, 0.0)) if pairs else acc

    # ---- one-shot ----------------------------------------------------------------------------
    def dispatch(self, x, topk_ids, topk_weights, num_tokens=None, *, slot: int = 0, x_scale=None,
                 expert_map: Optional[ExpertMap] = None, rank_mask=None) -> Dispatched:
        """dispatch_send then dispatch_recv; differentiable w.r.t. x and topk_weights.
        expert_map: as in dispatch_send (topk_ids logical, mapped to physical replicas).
        rank_mask: as in dispatch_send ([N] bool/int, nonzero = alive; combine takes it from got)."""
        if self._backend.autodiff or x_scale is not None:
            return self.dispatch_recv(self.dispatch_send(x, topk_ids, topk_weights, num_tokens, slot=slot,
                                                         x_scale=x_scale, expert_map=expert_map,
                                                         rank_mask=rank_mask))
        from . import autodiff
        slot = self._check_slot(slot)
        self._validate_dispatch(x, topk_ids, topk_weights, x_scale)
        n = self._num_tokens(num_tokens)
        self._ctx()  # outside shard_map: the error names it, before the slot is marked busy
        # ids carry no gradient: map them outside the custom_vjp; its rules (and the combine's
        # backward re-dispatch from route.arrays["topk_ids"]) then see physical ids only
        mask = self._check_rank_mask(rank_mask)
        topk_ids = self._map_experts(topk_ids, expert_map, mask)
        self._slots.open(slot, self.spec.slots)
        with self._slots.suppressed():
            return autodiff.dispatch(self, x, topk_ids, topk_weights, n, slot, mask)

    def combine(self, y, got: Dispatched, out=None, *, slot: Optional[int] = None):
        """combine_send then combine_recv; differentiable w.r.t. y, the router weights and out."""
        if self._backend.autodiff:
            return self.combine_recv(self.combine_send(y, got, slot=slot), out=out)
        from . import autodiff
        if not isinstance(got, Dispatched):
            raise ValueError(f"got: expected the Dispatched from dispatch_recv, got {type(got).__name__}")
        slot = got.slot if slot is None else self._check_slot(slot)
        with self._slots.suppressed():
            res = autodiff.combine(self, y, got, out, slot)
        self._slots.close(got.slot)
        if slot != got.slot:
            self._slots.close(slot)
        return res

    # ---- introspection -----------------------------------------------------------------------
    def buffer_bytes(self) -> int:
        """Communication buffer bytes per rank (all slots), as the backend computes them (C++ for
        the native backends; the cuda backend counts its device memory, not the remote_* pinned
        host buffers that buffer_regions also lists)."""
        return int(self._backend.buffer_bytes(self.config))

    def buffer_regions(self) -> dict:
        """{region: bytes per rank, all slots} of the backend's communication buffers (e.g. the
        cuda backend's shared_counts, shared_dispatch_rows, shared_combine_rows, private_staging,
        private_scratch, and remote_* with peers on other nodes). See docs/api.md."""
        return dict(self._backend.buffer_regions(self.config))

    def proxy_stats(self) -> dict:
        """Counters of this process's proxy threads ({rank: dict}, or {(group, rank): dict} on a
        mesh with several EP groups): the cuda backend's inter-node path, the host backend's
        proxied mode; {} for a backend without proxies. Keys: docs/api.md."""
        return self._backend.proxy_stats()

    def kernel_seconds(self, half: str):
        """Seconds the last kernel of `half` ("dispatch_send", ..., "combine_recv") took on the
        slowest local rank (GPU backends, with JAX_MOE_A2A_KERNEL_TIMING=1 set at init); None when
        not recorded or not a kernel backend."""
        if half not in ("dispatch_send", "dispatch_recv", "combine_send", "combine_recv"):
            raise ValueError(f"half: expected dispatch_send, dispatch_recv, combine_send or combine_recv, got {half!r}")
        return self._backend.kernel_seconds(half)

    def diagnostics(self) -> dict:
        """What the backend resolved at init: {"backend": name, ...} plus e.g. the cuda backend's
        node_size and the fabric provider in use, the host backend's engine, provider, proxied."""
        return {"backend": self.backend_name, **self._backend.diagnostics()}

    def stats(self) -> dict:
        """Counters gathered from executed dispatches of this process's ranks (collect_stats=True):
        dispatches (rank-calls), dropped pairs (bad expert ids), overflow rows (past
        recv_capacity), masked pairs (not sent because of the rank mask: expected); plus buffer bytes per rank and the backend."""
        with self._lock:
            out = dict(self._stats)
        out.update(backend=self.backend_name, num_ranks=self.num_ranks, collecting=self.collect_stats,
                   buffer_bytes_per_rank=self.buffer_bytes(),
                   recv_rows=self.spec.recv_rows(self.num_ranks))
        return out

    def last_error(self):
        """A failure the backend recorded out of band, or None. The cuda backend's kernels end a
        wait for a peer that never arrives by recording which ranks are missing and ending the
        step without data (combine output NaN); the next call raises it, and this returns it
        (text). The host backend: a `PeerFailure` (message, missing ranks) after a half failed
        (a timeout names the ranks it waited for in vain), until `recover`."""
        return self._backend.last_error()

    def recover(self, rank_mask):
        """Elastic EP: makes this communicator usable again after a peer failure (host backend).

        After a step fails because a peer died (its halves time out naming the ranks they waited
        for: `last_error().missing`), every surviving process calls `recover` with the same
        concrete mask ([N] bool/int, nonzero = survivor: the dead ranks masked), with no step of
        this communicator in flight (after the failed step's error was raised), whether or not
        its own step failed. It flushes this process's writes (dropping the errors of writes to
        the dead ranks), exchanges every slot's epochs among the survivors through the
        transport, drops every stale arrival of the failed step, sets each slot to the
        survivors' highest epochs, and barriers (docs/protocol.md "Recovery"). Then the same
        communicator and the same compiled step go on with `rank_mask` passed to dispatch_send
        (the recover mask or a subset of it). Bounded by timeout_s: when a rank the mask keeps
        does not join (it is dead too, or did not call recover), it raises TimeoutError naming
        it (jax_moe_a2a.transfer.TransferTimeoutError) and the communicator stays failed; call
        recover again with a corrected mask. A masked rank of this process takes no part. The
        ops themselves keep refusing a failed communicator ("unusable after an earlier
        failure") until recover succeeds. Backends: host (inline mode); reference and ragged
        keep no state between steps (a no-op after the mask checks); cuda, nvshmem and the host
        backend with proxied=True raise NotImplementedError (cuda and nvshmem take a mask for a
        rank that ended between steps, not a recovery after a step that timed out)."""
        mask = np.asarray(rank_mask)
        n = self.num_ranks
        if mask.shape != (n,):
            raise _shape_err("rank_mask", f"shape [N] = [{n}] (one flag per EP rank)", list(mask.shape))
        if mask.dtype != np.bool_ and not np.issubdtype(mask.dtype, np.integer):
            raise _shape_err("rank_mask", "dtype bool or an integer (nonzero = alive)", mask.dtype)
        alive = (mask != 0).astype(np.int32)
        if not alive.any():
            raise ValueError("rank_mask: every rank is masked (at least the survivors must be alive)")
        self._backend.recover(alive)
        _runtime.forget_failed_effects()  # the failed step's token must not raise again later

    def close(self):
        """Releases the backend's buffers, engines and threads now (also done when the
        communicator is garbage-collected). The communicator is unusable afterwards."""
        self._finalizer()  # runs the backend's close once

    def reset_stats(self):
        with self._lock:
            self._stats = {"dispatches": 0, "dropped": 0, "overflow": 0, "masked": 0}

    # ---- debug=True errors -------------------------------------------------------------------
    def check(self):
        """Raises the first `DroppedRowsError` that a debug check of this communicator raised in
        this process since the last check() (the step that raised it failed with a
        `jax.errors.JaxRuntimeError`), and forgets them; returns None when there is none."""
        with self._lock:
            errors, self._errors = self._errors, []
        if errors:
            raise _copy_of(errors[0])

    @contextlib.contextmanager
    def checked(self):
        """Context manager: inside it, a step that fails because a debug check of this
        communicator raised (`jax.errors.JaxRuntimeError`, INTERNAL) raises `DroppedRowsError`
        instead (the runtime error as its __cause__), and leaving the block without an error
        raises one that was recorded but not yet seen (an output never read). JAX's record of
        the failed step's effects is dropped too, so it is not raised again at exit. Read (or
        `jax.block_until_ready`) the step's outputs inside the block: dispatch is asynchronous.

            try:
                with comm.checked():
                    out = jax.block_until_ready(step(x, ids, w))
            except a2a.DroppedRowsError as e:
                ...
        """
        try:
            yield self
        except jax.errors.JaxRuntimeError as e:
            with self._lock:
                errors, self._errors = self._errors, []
            if not errors and DroppedRowsError.__name__ not in str(e):
                raise
            _runtime.forget_failed_effects()
            err = _copy_of(errors[0]) if errors else DroppedRowsError(str(e))
            raise err from e
        self.check()


def _copy_of(err: DroppedRowsError) -> DroppedRowsError:
    """A new error with `err`'s message, to raise from a method: raising `err` itself would add
    the method's frame (and `self` in it) to the traceback of an object that logging records of
    the failed callback may keep (pytest's do), keeping the communicator alive with them."""
    return type(err)(*err.args)


def init(spec: Spec, mesh, axis="ep", backend: str = "auto", *, debug: bool = False, timeout_s: float = 60.0,
         collect_stats: Optional[bool] = None, max_private_tokens: Optional[int] = None,
         provider: Optional[str] = None, engine: Optional[str] = None, proxied: Optional[bool] = None,
         node_size: Optional[int] = None, **options) -> Communicator:
    """Creates a communicator for `spec` over `mesh`'s `axis` (collective: call on every process).

    axis: the EP axis, a mesh axis name or a tuple of them (ranks row-major over the tuple). On a
    mesh with other axes, each position along them is an independent EP group of
    prod(sizes of `axis`) ranks running the same program (see `Communicator.groups`).

    backend: "auto" (best available), "reference", or another name from `available_backends()`.
    debug: raise `DroppedRowsError` (see `Communicator.checked`) when a dispatch drops or overflows.
    timeout_s: bound of every wait for a peer inside the ops.
    collect_stats: count drops/overflow on the host (default: True on CPU devices, False on GPUs,
      where its host callback would synchronise the stream).
    Backend options (None: not given, the backend's default); a backend refuses the ones it does not
    declare (`Backend.OPTIONS`), naming the valid ones:
      max_private_tokens (host, cuda), provider (host, cuda), engine (host), proxied (host),
      node_size (host with proxied, cuda). See docs/api.md.
    """
    given = dict(max_private_tokens=max_private_tokens, provider=provider, engine=engine, proxied=proxied,
                 node_size=node_size)
    options = {**{k: v for k, v in given.items() if v is not None}, **options}
    return Communicator(spec, mesh, axis, backend, debug=debug, timeout_s=timeout_s, collect_stats=collect_stats,
                        **options)
