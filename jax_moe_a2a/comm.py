"""The communicator: validates every call at trace time and forwards it to a backend.

Use it inside `jax.shard_map` over the EP axis; every array argument is one rank's shard. On a
mesh with more axes than the EP axis (e.g. ("dp", "ep")), every position along the other axes is
an independent EP group: its ranks exchange only among themselves (see `Communicator.groups`).

What it builds on, each in a module of its own: the errors (errors.py), slot tracking (slots.py),
rank masks (elastic.py), counters and debug checks (debug.py), the gradients of the FFI
backends (autodiff.py) and the backends (backends/).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import itertools
import weakref
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from . import autodiff
from . import backends as _backends
from . import debug as _debug
from . import elastic
from . import runtime as _runtime
from .backends.base import Ctx
from .config import Config, check_options  # noqa: F401 (check_options: re-exported, tests/test_options.py)
from .dtypes import COMBINE_DTYPES, FP8_DTYPES, INPUT_DTYPES
from .eplb import ExpertMap, check_expert_map, map_ids
from .errors import DroppedRowsError, PeerFailure, copy_of, shape_err  # noqa: F401 (PeerFailure: re-exported)
from .groups import ep_groups, local_members
from .quant import dequantize_fp8
from .slots import SlotChain, SlotOrder, SlotTracker
from .spec import Spec
from .types import CombineHandle, DispatchHandle, Dispatched, Route

_COMM_IDS = itertools.count(1)
logger = _debug.logger  # the library's logger, "jax_moe_a2a"
_OPEN: dict = {}  # comm_id -> the weakref.finalize of each communicator not closed yet


def _close_backend(backend, comm_id: int):
    _OPEN.pop(comm_id, None)
    backend.close()


def _close_at_exit():
    """At interpreter exit: wait for the steps still in flight, then close every communicator.

    weakref.finalize's own exit hook would close a communicator while a step that uses it is still
    running (nothing makes a script wait for a result it never reads, e.g. one that shows only
    out.shape at the end): its remaining halves then fail ("no host communicator") and its peers wait for them until
    timeout_s (issue 33.1). This hook is registered when this module is imported, after JAX's
    (atexit runs hooks last-registered first), so it runs before JAX tears its backends down:
    every live array is waited for (a failed step's error is left to JAX's own exit hook), then
    the communicators are closed."""
    finalizers = [f for f in list(_OPEN.values()) if f.alive]
    if not finalizers:
        return
    try:
        arrays = jax.live_arrays()
    except Exception:  # pragma: no cover - JAX without live_arrays, or torn down
        arrays = []
    for a in arrays:
        try:
            a.block_until_ready()
        except Exception:  # deleted or donated arrays, a failed step: nothing left to wait for
            pass
    for f in finalizers:
        try:
            f()
        except Exception as e:  # pragma: no cover - a backend that fails to close: say so once
            logger.warning("jax_moe_a2a: closing a communicator at exit failed: %s", e)


atexit.register(_close_at_exit)



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
        # None: not given (as init filters them; a None proxied=... would hide the backend's
        # default, e.g. $JAX_MOE_A2A_HOST_PROXIED). Config.build refuses a name the backend does
        # not declare.
        self.options = {k: v for k, v in options.items() if v is not None}
        self.config = Config.build(spec, self.num_ranks, self._backend, timeout_s=self.timeout_s,
                                   options=self.options)
        self.comm_id = next(_COMM_IDS)
        self._call_ids = itertools.count(1)
        self._counters = _debug.Counters()  # what the executed dispatches counted; debug=True errors
        self._slots = SlotTracker()
        self._chain = SlotChain()  # the order of the forward uses of a slot (slots.SlotChain)
        self._order = SlotOrder()  # the order of the FFI backends' backward exchanges (autodiff.py)
        # The halves for the custom_vjp rules (autodiff.py), built once: they hold this
        # communicator weakly (the traced program keeps the rules), so no reference cycle.
        self._rule_halves = autodiff.Halves(self.spec, self.axis, weakref.WeakMethod(self._send),
                                            weakref.WeakMethod(self._recv_plain),
                                            weakref.WeakMethod(self._combine_send),
                                            weakref.WeakMethod(self._combine_recv), self._order)
        try:
            self._backend.open(self.config, mesh, axis, self.comm_id)
        except BaseException:
            self._backend.close()  # what a failed open created (idempotent)
            raise
        # The backend's native state lives as long as the communicator (or until close()); at
        # interpreter exit `_close_at_exit` closes it after the work still in flight.
        self._finalizer = weakref.finalize(self, _close_backend, self._backend, self.comm_id)
        self._finalizer.atexit = False
        _OPEN[self.comm_id] = self._finalizer
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
            raise ValueError(f"slot: expected an int in [0, {self.spec.slots}) (Spec.slots={self.spec.slots}), "
                             f"got {slot!r}")
        return int(slot)

    def _check_mine(self, arg: str, obj):
        if getattr(obj, "comm_id", None) != self.comm_id:
            raise ValueError(f"{arg}: was produced by another communicator (spec or mesh mismatch); "
                             f"expected comm_id {self.comm_id}, got {getattr(obj, 'comm_id', None)}")

    def _num_tokens(self, num_tokens):
        """(n [] int32 in [0, T], given): `given` is a device array's value before the clamp
        ([] int32; counted in stats()['clamped'] and raised by debug=True when outside [0, T]),
        None for an int (checked here) or None (T)."""
        t = self.spec.max_tokens_per_rank
        if num_tokens is None:
            return jnp.int32(t), None
        if isinstance(num_tokens, (int, np.integer)) and not isinstance(num_tokens, bool):
            if not 0 <= num_tokens <= t:
                raise ValueError(f"num_tokens: expected 0 <= num_tokens <= {t}, got {num_tokens}")
            return jnp.int32(num_tokens), None
        n = jnp.asarray(num_tokens)
        if n.size != 1 or not jnp.issubdtype(n.dtype, jnp.integer):
            raise ValueError(f"num_tokens: expected an integer scalar (shape () or (1,)), got "
                             f"{n.dtype}{list(n.shape)}")
        given = n.reshape(()).astype(jnp.int32)
        return jnp.clip(given, 0, t), given

    def _validate_dispatch(self, x, topk_ids, topk_weights, x_scale):
        s = self.spec
        t, h, k = s.max_tokens_per_rank, s.hidden, s.experts_per_token
        if tuple(x.shape) != (t, h):
            raise shape_err("x", f"shape [T, H] = {[t, h]} (one rank's shard)", list(x.shape))
        xd = np.dtype(x.dtype)
        if xd in FP8_DTYPES:
            if not s.is_fp8:
                raise ValueError(f"x: fp8 input needs Spec.dispatch_dtype fp8, spec has {s.dispatch_dtype}")
            if x_scale is None:
                raise ValueError("x_scale: required when x is already fp8, shape [T, ceil(H / scale_block)] f32")
            if tuple(x_scale.shape) != (t, s.num_scales) or np.dtype(x_scale.dtype) != np.float32:
                raise shape_err("x_scale", f"float32{[t, s.num_scales]}", f"{x_scale.dtype}{list(x_scale.shape)}")
        elif xd not in INPUT_DTYPES:
            raise ValueError(f"x: expected dtype bf16, f16, f32 (or fp8 with x_scale), got {xd}")
        elif x_scale is not None:
            raise ValueError("x_scale: only valid with fp8 x")
        if tuple(topk_ids.shape) != (t, k):
            raise shape_err("topk_ids", f"shape [T, K] = {[t, k]}", list(topk_ids.shape))
        if np.dtype(topk_ids.dtype) != np.int32:
            raise shape_err("topk_ids", "dtype int32", topk_ids.dtype)
        if tuple(topk_weights.shape) != (t, k):
            raise shape_err("topk_weights", f"shape [T, K] = {[t, k]}", list(topk_weights.shape))
        if np.dtype(topk_weights.dtype) != np.float32:
            raise shape_err("topk_weights", "dtype float32", topk_weights.dtype)

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
        """rank_mask -> int32 [N] (1 = alive) or None (elastic.check_rank_mask)."""
        def unsupported():
            reason = self._backend.rank_mask_unsupported()
            return None if reason is None else f"rank_mask is not supported by the {self.backend_name} backend yet: {reason}"
        return elastic.check_rank_mask(rank_mask, self.num_ranks, unsupported)

    def dispatch_send(self, x, topk_ids, topk_weights, num_tokens=None, *, slot: int = 0,
                      x_scale=None, after=None, expert_map: Optional[ExpertMap] = None,
                      rank_mask=None) -> DispatchHandle:
        """Starts sending this rank's tokens to the ranks hosting their experts.

        Args:
          x: [T, H] bf16/f16/f32, or float8_e4m3fn with `x_scale` [T, ceil(H/scale_block)] f32.
          topk_ids: [T, K] int32 expert ids in [0, E); -1 = not routed; others dropped+counted.
          topk_weights: [T, K] f32 router weights (used by combine).
          num_tokens: [] int32 device scalar (or int); rows at or past it are ignored. Default T.
            An int outside [0, T] raises; a device value outside it is clamped to [0, T],
            counted in stats()['clamped'], and raised by debug=True.
          slot: buffer slot in [0, Spec.slots) (static).
          after: optional array, or pytree of arrays, this send must run after (never read; no
            gradient flows through it, so a value on the differentiated path is fine). XLA orders
            the halves only through data; the send already follows the slot's last exchange
            traced in the same trace (slots.SlotChain), so this is for uses it cannot see (another
            trace's, e.g. a jax.checkpoint body). The pure-JAX backends (reference, ragged)
            ignore it: XLA orders their collectives.
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
        logical_ids = topk_ids
        topk_ids = self._map_experts(topk_ids, expert_map, mask)
        n, given = self._num_tokens(num_tokens)
        ctx = self._ctx()  # outside shard_map: the error names it, before the slot is marked busy
        self._slots.open(slot, self.spec.slots)
        after = self._chain.follow(slot, after)  # after the slot's last exchange in this trace
        if self.spec.is_fp8 and x_scale is None:  # one rule on every backend: fp8 rows have no gradient
            x = autodiff.fp8_guard(x, "dispatch")
        handle = self._send(x, topk_ids, topk_weights, n, slot, x_scale=x_scale, after=after, mask=mask, given=given)
        if not self.debug:
            return handle
        # debug=True names the first bad pair as the caller gave it: with an expert map, its
        # logical id (the mapped one is the map's doing: physical E for no replica)
        bad = _debug.first_bad_pair(self.spec, topk_ids, n, ctx.rank,
                                    None if expert_map is None else logical_ids,
                                    0 if expert_map is None else int(expert_map.physical.shape[0]))
        return dataclasses.replace(handle, bad_pair=bad)

    def _send(self, x, topk_ids, topk_weights, n, slot, *, x_scale=None, after=None, mask=None,
              given=None) -> DispatchHandle:
        """dispatch_send after the checks: physical ids, n [] int32, mask int32 [N] or None, given:
        num_tokens before the clamp or None; no slot tracking (the autodiff rules call it too).
        Backends that JAX cannot differentiate see x and the weights through stop_gradient; the
        handle carries x (and the route the weights) to dispatch_recv's rule (autodiff.py)."""
        ctx = self._ctx()
        carry = not self._backend.autodiff
        xs, ws = (jax.lax.stop_gradient(x), jax.lax.stop_gradient(topk_weights)) if carry else (x, topk_weights)
        with jax.named_scope("a2a_dispatch_send"):
            send_ids, masked = topk_ids, None
            if mask is not None:
                send_ids, masked = elastic.mask_ids(self.spec, self.num_ranks, ctx.rank, topk_ids, n, mask)
            if carry and x_scale is not None:
                x_scale = jax.lax.stop_gradient(x_scale)
            sent = self._backend.dispatch_send(ctx, xs, x_scale, send_ids, ws, n, slot, after=after, rank_mask=mask)
        # topk_ids: the physical ids before the mask (the combine's backward dispatch re-applies it)
        route = Route(topk_weights.astype(jnp.float32), n, topk_ids, sent.placement, mask, self.comm_id)
        dropped = sent.num_dropped if masked is None else sent.num_dropped - masked
        return DispatchHandle(sent.wire, route, dropped, masked, given, x if carry else None, slot=slot,
                              comm_id=self.comm_id)


    def dispatch_recv(self, handle: DispatchHandle) -> Dispatched:
        """Waits for this rank's incoming tokens and lays them out (see `Dispatched`)."""
        if not isinstance(handle, DispatchHandle):
            raise ValueError(f"handle: expected the DispatchHandle from dispatch_send, got {type(handle).__name__}")
        self._check_mine("handle", handle)
        return self._recv(handle)

    def _recv(self, handle: DispatchHandle) -> Dispatched:
        """dispatch_recv after the checks, differentiable on every backend (autodiff.py's rule
        where JAX cannot differentiate the backend)."""
        if self._backend.autodiff:
            return self._recv_plain(handle)
        return autodiff.dispatch_recv(self._halves(), handle)

    def _recv_plain(self, handle: DispatchHandle, count: bool = True) -> Dispatched:
        """dispatch_recv after the checks, without a gradient rule. count: record this dispatch
        in stats() and run the debug check (False for a backward pass's exchanges)."""
        ctx = self._ctx()
        route = handle.route
        with jax.named_scope("a2a_dispatch_recv"):
            r = self._backend.dispatch_recv(ctx, handle.wire, route.placement, handle.slot, rank_mask=route.rank_mask)
            x, scale, weights, src, placement = r.x, r.scale, r.weights, r.src, r.placement
            if self.spec.recv_dtype is not None and scale is not None:  # the backend returned fp8 rows
                x, scale = dequantize_fp8(x, scale, self.spec.scale_block).astype(self.spec.recv_dtype), None
        dropped = handle.num_dropped
        if count:
            gather_axis = self.axis if self._backend.debug_psum else None  # every rank's findings gathered
            clamped = None if handle.tokens_given is None else (handle.tokens_given != route.num_tokens).astype(jnp.int32)
            detail = None
            if self.debug:
                detail = handle.bad_pair if handle.bad_pair is not None else _debug.first_bad_pair(
                    self.spec, route.topk_ids, route.num_tokens, ctx.rank)
            dropped, gate = _debug.record(self._counters, dropped, r.num_overflow, handle.num_masked, clamped,
                                          tokens_given=handle.tokens_given, detail=detail, rank=ctx.rank,
                                          spec=self.spec, collect=self.collect_stats, debug=self.debug, gather_axis=gather_axis)
            if self.debug:  # what follows the dispatch (the combine's communication too) waits for the check
                # An optimisation barrier orders XLA's schedule, but XLA:CPU runs thunks as soon as their
                # buffers are ready: only a data dependency keeps a rank whose check raised from
                # entering the combine's all_to_all alone (which aborted the process after 40 s).
                x, scale, weights, src, placement = _debug.after(gate, (x, scale, weights, src, placement))
                dropped, x, weights, placement = jax.lax.optimization_barrier((dropped, x, weights, placement))
        route = Route(route.topk_weights, route.num_tokens, route.topk_ids, placement, route.rank_mask, self.comm_id)
        # got.weights carries no gradient on any backend (docs/api.md "Differentiation"): the router
        # weights' gradient flows through combine (route.topk_weights). JAX would otherwise
        # differentiate the pure-JAX backends' received weights, which the FFI rules cannot.
        weights = jax.lax.stop_gradient(weights)
        return Dispatched(x, scale, r.group_sizes, weights, src, dropped, r.num_overflow, route, handle.slot,
                          self.comm_id, num_masked=handle.num_masked)

    def combine_send(self, y, got: Dispatched, *, slot: Optional[int] = None, after=None) -> CombineHandle:
        """Starts sending expert outputs back to their tokens' ranks.

        Args:
          y: expert outputs in `got.x`'s layout ([R, H] or [L, C, H]), bf16/f16/f32. They travel
            in their own dtype when it is no wider than Spec.combine_dtype, else they are cast to
            Spec.combine_dtype first (the combine buffers are sized for it; set combine_dtype
            f32 to send f32 outputs exactly). Accumulation is f32 either way.
          got: the `Dispatched` of the matching dispatch.
          slot: buffer slot (static; default: the dispatch's). Another slot must be free in this
            trace (no dispatch or combine in flight on it; else ValueError naming the free
            slots); it is then held by this combine until its combine_recv, and the dispatch's
            slot is free from here on.
          after: optional array or pytree of arrays this send must run after (never read; no
            gradient flows through it), as in dispatch_send.
        Returns: a CombineHandle for `combine_recv`.
        """
        y, slot = self._check_combine(y, got, slot)
        moved = slot != got.slot
        if moved:  # the dispatch's slot is done once its rows are read back here; the
            self._slots.move(got.slot, slot, self.spec.slots)  # combine's, busy until combine_recv
            after = self._chain.follow(slot, after)  # after that slot's last exchange in this trace
        if self.spec.is_fp8:  # one rule on every backend: no gradient through an fp8 dispatch's combine
            y = autodiff.fp8_guard(y, "combine")
        handle = self._combine_send(y, got, slot, after=after)
        if moved:  # the dispatch's slot's next use follows this send
            self._chain.record(got.slot, handle.wire)
        return handle

    def _check_combine(self, y, got, slot):
        """(y in Spec.combine_wire_dtype, the slot) after checking y, got and slot."""
        if not isinstance(got, Dispatched):
            raise ValueError(f"got: expected the Dispatched from dispatch_recv, got {type(got).__name__}")
        self._check_mine("got", got)
        slot = got.slot if slot is None else self._check_slot(slot)
        expected = tuple(self.spec.recv_shape(self.num_ranks)) + (self.spec.hidden,)
        if tuple(y.shape) != expected:
            raise shape_err("y", f"shape {list(expected)} (the layout of got.x)", list(y.shape))
        if np.dtype(y.dtype) not in COMBINE_DTYPES:
            raise shape_err("y", "dtype bf16, f16 or f32", y.dtype)
        wire = self.spec.combine_wire_dtype(y.dtype)
        if wire != np.dtype(y.dtype):  # the combine buffers hold rows of Spec.combine_dtype
            y = y.astype(wire)
        return y, slot

    def _check_out(self, out):
        s = self.spec
        if out is not None and tuple(out.shape) != (s.max_tokens_per_rank, s.hidden):
            raise shape_err("out", f"shape [T, H] = {[s.max_tokens_per_rank, s.hidden]}", list(out.shape))

    def _combine_send(self, y, got: Dispatched, slot: int, after=None) -> CombineHandle:
        """combine_send after the checks (y in Spec.combine_wire_dtype); no slot tracking. Backends
        that JAX cannot differentiate see y through stop_gradient; the handle carries y and got to
        combine_recv's rule (autodiff.py)."""
        ctx = self._ctx()
        carry = not self._backend.autodiff
        with jax.named_scope("a2a_combine_send"):
            wire = self._backend.combine_send(ctx, jax.lax.stop_gradient(y) if carry else y, got.route, slot,
                                              after=after, from_slot=got.slot)
        if not carry:
            return CombineHandle(wire, got.route, slot=slot, comm_id=self.comm_id)
        return CombineHandle(wire, got.route, y, got, slot=slot, comm_id=self.comm_id)

    def combine_recv(self, handle: CombineHandle, out=None):
        """Waits for the expert outputs and reduces them.

        Returns [T, H] in Spec.combine_dtype: for t < num_tokens, sum over routed pairs of
        weight * expert output (f32 accumulation), plus `out[t]` when `out` is given; rows at or
        past num_tokens are 0, or `out` unchanged.
        """
        if not isinstance(handle, CombineHandle):
            raise ValueError(f"handle: expected the CombineHandle from combine_send, got {type(handle).__name__}")
        self._check_mine("handle", handle)
        self._check_out(out)
        self._ctx()
        self._slots.close(handle.slot)
        if self._backend.autodiff:
            res = self._combine_recv(handle, out)
        else:
            res = autodiff.combine_recv(self._halves(), handle, out)
        self._chain.record(handle.slot, res)  # the slot's next use follows this receive
        return res

    def _combine_recv(self, handle: CombineHandle, out, pairs: bool = False):
        """combine_recv after the checks, without slot tracking or a gradient rule. pairs: also
        every pair's unweighted row [T, K, H] f32 (Backend.combine_recv)."""
        ctx = self._ctx()
        with jax.named_scope("a2a_combine_recv"):
            res = self._backend.combine_recv(ctx, handle.wire, handle.route, handle.slot, out, pairs=pairs)
        mask = handle.route.rank_mask
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
        """dispatch_send then dispatch_recv; differentiable w.r.t. x and topk_weights (as the halves).
        expert_map: as in dispatch_send (topk_ids logical, mapped to physical replicas).
        rank_mask: as in dispatch_send ([N] bool/int, nonzero = alive; combine takes it from got)."""
        return self.dispatch_recv(self.dispatch_send(x, topk_ids, topk_weights, num_tokens, slot=slot, x_scale=x_scale,
                                                     expert_map=expert_map, rank_mask=rank_mask))

    def combine(self, y, got: Dispatched, out=None, *, slot: Optional[int] = None):
        """combine_send then combine_recv; differentiable w.r.t. y, the router weights and out
        (as the halves)."""
        return self.combine_recv(self.combine_send(y, got, slot=slot), out=out)

    def _halves(self) -> "autodiff.Halves":
        """The halves without checks or slot tracking, for the custom_vjp rules of autodiff.py
        (which JAX traces at times it picks, in traces of their own), holding this communicator
        weakly (the traced program keeps the rules); one object per communicator."""
        return self._rule_halves


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
        """Counters gathered from executed dispatches of this process's ranks (collect_stats=True;
        docs/api.md "Counters"): dispatches (rank-calls of the dispatches the program calls; a
        backward pass's exchanges are not counted), dropped pairs (bad expert ids), overflow rows
        (past recv_capacity), masked pairs (not sent because of the rank mask: expected), clamped
        (dispatches whose device num_tokens was outside [0, T]); plus buffer bytes per rank and
        the backend."""
        out = self._counters.snapshot()
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
        self._backend.recover(elastic.survivors(rank_mask, self.num_ranks))
        _runtime.forget_failed_effects()  # the failed step's token must not raise again later

    def close(self):
        """Releases the backend's buffers, engines and threads now (also done when the
        communicator is garbage-collected). The communicator is unusable afterwards."""
        self._finalizer()  # runs the backend's close once

    def reset_stats(self):
        self._counters.reset()

    # ---- debug=True errors -------------------------------------------------------------------
    def check(self):
        """Raises the first `DroppedRowsError` that a debug check of this communicator raised in
        this process since the last check() (the step that raised it failed with a
        `jax.errors.JaxRuntimeError`), and forgets them; returns None when there is none."""
        errors = self._counters.take_errors()
        if errors:
            raise copy_of(errors[0])

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
            errors = self._counters.take_errors()
            if not errors and DroppedRowsError.__name__ not in str(e):
                raise
            _runtime.forget_failed_effects()
            err = copy_of(errors[0]) if errors else DroppedRowsError(str(e))
            raise err from e
        self.check()




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

