"""The interface every backend implements. The communicator validates, the backend moves data.

The contract: a backend is opened from (Config, mesh, axis) and its communicator id
(`Backend.open`), keeps what it needs of them, and never reads the communicator back. The
communicator asks it only through the methods declared here: the four halves (inside
`jax.shard_map` on one rank's shard; shapes in `jax_moe_a2a.types`), the buffer sizes, the
diagnostics (`proxy_stats`, `kernel_seconds`, `last_error`, `diagnostics`) and `close`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from ..spec import Spec


@dataclasses.dataclass(frozen=True)
class Ctx:
    """Static facts a backend needs on every call, plus the traced rank."""

    spec: Spec
    num_ranks: int
    axis: Any           # mesh axis name(s) of the EP axis
    rank: Any           # [] int32, jax.lax.axis_index(axis)
    comm_id: int
    call_id: int        # distinct per call site, so XLA never merges two calls
    config: Any = None  # the communicator's jax_moe_a2a.config.Config
    group_axes: tuple = ()  # the mesh's other axes (mesh order): each position is one EP group


def group_index(ctx: Ctx):
    """[] int32: this rank's EP group, jax.lax.axis_index(ctx.group_axes) (row g of
    Communicator.groups); 0 on a mesh without other axes."""
    import jax
    import jax.numpy as jnp

    if not ctx.group_axes:
        return jnp.zeros((), jnp.int32)
    try:
        return jax.lax.axis_index(ctx.group_axes).astype(jnp.int32)
    except NameError as e:
        raise ValueError(f"jax_moe_a2a: the EP groups are told apart by the mesh's other axes {ctx.group_axes!r}: "
                         "run the ops inside a jax.shard_map that is manual over every mesh axis") from e


def vma(a) -> frozenset:
    """The mesh axes `a` varies over inside shard_map (its type's vma; empty outside shard_map or
    on JAX versions without it)."""
    import jax

    typeof = getattr(jax, "typeof", None)
    try:
        aval = typeof(a) if typeof is not None else None
    except TypeError:
        return frozenset()
    mat = getattr(aval, "manual_axis_type", None)  # jax 0.11
    if mat is not None:
        return frozenset(getattr(mat, "varying", ()))
    return frozenset(getattr(aval, "vma", ()) or ())  # jax 0.6 - 0.10


def varying(tree, axis):
    """Marks FFI outputs as varying over the EP axis inside shard_map (they differ per rank);
    without it JAX types them as replicated and autodiff/check_vma reject them. Casts only over
    the axes an array does not vary over yet. No-op on JAX versions without `jax.lax.pcast`."""
    import jax

    pcast = getattr(jax.lax, "pcast", None)
    if pcast is None:
        return tree
    axes = axis if isinstance(axis, tuple) else (axis,)

    def cast(a):
        if a is None or getattr(a, "dtype", None) == jax.dtypes.float0:
            return a
        have = vma(a)
        missing = tuple(x for x in axes if x not in have)
        if not missing:
            return a
        try:
            return pcast(a, missing, to="varying")
        except (ValueError, TypeError, NameError):  # already varying, or outside shard_map
            return a

    return jax.tree.map(cast, tree)


def like_primal(ct, axes):
    """A cotangent typed like its primal, which varies over `axes` (a custom_vjp rule must return
    exactly the primal's type): varying over the axes it lacks; summed over the axes the primal
    is invariant over (on a multi-axis mesh the FFI results vary over the EP groups' axes too, as
    the groups' inputs do; the transpose of that broadcast is the sum)."""
    import jax

    if ct is None or getattr(ct, "dtype", None) == jax.dtypes.float0:
        return ct
    axes = tuple(axes)
    extra = tuple(sorted(vma(ct) - set(axes)))
    if extra and vma(ct):
        ct = jax.lax.psum(ct, extra)
    return varying(ct, axes) if axes else ct


def recv_result_shapes(spec, n, counts_shape, dequant=False):
    """Result shapes of an FFI dispatch_recv: x, scale, group_sizes, weights, src, recv_slot,
    recv_counts (counts_shape), overflow; rows flattened to R' = prod(recv_shape). dequant: the
    kernels write x in spec.recv_dtype (fp8 dequantised on receive) and no scales ([R', 0])."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    rows = int(np.prod(spec.recv_shape(n)))
    i32, f32 = jnp.int32, jnp.float32
    dequant = dequant and spec.recv_dtype is not None
    return (jax.ShapeDtypeStruct((rows, spec.hidden), spec.recv_dtype if dequant else spec.dispatch_dtype),
            jax.ShapeDtypeStruct((rows, 0 if dequant else spec.num_scales), f32),
            jax.ShapeDtypeStruct((spec.local_experts(n),), i32),
            jax.ShapeDtypeStruct((rows,), f32),
            jax.ShapeDtypeStruct((rows, 2), i32),
            jax.ShapeDtypeStruct((rows,), i32),
            jax.ShapeDtypeStruct(counts_shape, i32),
            jax.ShapeDtypeStruct((), i32))


def finish_recv(spec, n, outs, route):
    """FFI dispatch_recv results -> the tuple Backend.dispatch_recv returns (layout reshapes,
    routing arrays for combine added to `route`)."""
    x, scale, sizes, weights, src, recv_slot, recv_counts, overflow = outs
    shape = spec.recv_shape(n)
    route = dict(route, recv_src=src, recv_slot=recv_slot, recv_counts=recv_counts)
    x = x.reshape(*shape, spec.hidden)
    # no scales: 16/32-bit rows, or fp8 rows the kernels dequantised (recv_result_shapes' dequant)
    scale = scale.reshape(*shape, spec.num_scales) if spec.is_fp8 and scale.shape[-1] else None
    return x, scale, sizes, weights.reshape(shape), src.reshape(*shape, 2), overflow, route


class Backend:
    """Backend protocol. Subclasses fill in the four halves."""

    name = "?"
    # The backend-specific options of `jax_moe_a2a.init` this backend reads (name -> meaning);
    # Config.build refuses any other and hands these to `transport`.
    OPTIONS: dict = {}

    @classmethod
    def transport(cls, opts: dict, num_ranks: int) -> dict:
        """The Config's transport fields (config.TRANSPORT_FIELDS) from this backend's options
        (only declared names reach here) and its defaults; ValueError for a bad value."""
        return {}

    def open(self, config, mesh, axis, comm_id: int) -> None:
        """Creates whatever the halves need (collective over the processes of the mesh):
        `config` (jax_moe_a2a.config.Config), the mesh and the EP axis, and the communicator id
        (the key of the native registries). The pure-JAX backends keep the config only."""
        self.config = config

    def buffer_regions(self, config) -> dict:
        """{region: bytes per rank, all slots} of the communication buffers for `config`."""
        raise NotImplementedError

    def buffer_bytes(self, config) -> int:
        """Communication buffer bytes one rank holds (all slots)."""
        return int(sum(self.buffer_regions(config).values()))

    # ---- diagnostics (declared here; the communicator forwards them) ------------------------
    def proxy_stats(self) -> dict:
        """Counters of this process's proxy threads ({rank: dict}, or {(group, rank): dict} on a
        mesh with several EP groups); {} for a backend without proxies."""
        return {}

    def kernel_seconds(self, half: str):
        """Seconds the last kernel of `half` took on the slowest local rank, or None."""
        return None

    def last_error(self):
        """A failure the backend recorded out of band (text, or the host backend's PeerFailure),
        or None."""
        return None

    def recover(self, alive) -> None:
        """Elastic EP: rejoin the survivors `alive` ([N] int32, 1 = survivor) after a peer failure
        (Communicator.recover). A backend of XLA collectives keeps no state between steps (a
        no-op); one whose halves wait for peers and does not implement it raises."""
        if self.xla_collectives:
            return  # reference / ragged: no per-slot state between steps (their collectives need every process)
        raise NotImplementedError(f"recover() is not supported by the {self.name} backend yet: its kernels wait "
                                  "for every rank; a failed communicator cannot be reused (create a new one "
                                  "without the dead ranks)")

    def diagnostics(self) -> dict:
        """What the backend resolved at open (e.g. the fabric provider in use)."""
        return {}

    def close(self) -> None:
        """Releases native resources now (idempotent)."""

    def dispatch_send(self, ctx: Ctx, x, x_scale, topk_ids, topk_weights, num_tokens, slot: int, after=None):
        """x [T, H] (input dtype, or fp8 with x_scale [T, S]); topk_ids [T, K] int32;
        topk_weights [T, K] f32; num_tokens [] int32; after: an array this send must follow
        (XLA orders calls only by data dependencies), or None.
        Returns (handle_arrays: dict, route_arrays: dict, num_dropped [] int32)."""
        raise NotImplementedError

    def dispatch_recv(self, ctx: Ctx, handle_arrays: dict, route_arrays: dict, slot: int):
        """Returns (x, scale|None, group_sizes [L], weights, src, num_overflow [], route_arrays)."""
        raise NotImplementedError

    def combine_send(self, ctx: Ctx, y, route, slot: int, after=None, from_slot=None) -> dict:
        """y in the layout of Dispatched.x (bf16/f16/f32). Returns handle arrays. from_slot: the
        slot of the dispatch whose rows these are (None: `slot`); a backend whose combine reads
        per-slot state of the dispatch (the host and cuda proxy paths' combine offsets) reads that
        slot's."""
        raise NotImplementedError

    # True when JAX autodiff differentiates the halves directly (pure-JAX backends); otherwise the
    # communicator wraps the one-shot ops in custom_vjp (jax_moe_a2a/autodiff.py).
    autodiff = False
    # True when the halves move data with XLA collectives (pure-JAX backends). A rank that stops
    # (debug=True raising) would leave the others waiting in XLA's next collective forever (on
    # XLA:CPU until its rendezvous aborts the process), so the debug check must stop every rank
    # at once. FFI backends time out and name the missing rank instead.
    xla_collectives = False
    # True when the debug check may decide for every rank with a psum over the EP axis (XLA
    # collectives work there: every CPU backend and the pure-JAX ones), so that every rank raises
    # or none does. The GPU FFI backends set False: XLA's NCCL collectives refuse several processes
    # on one GPU; there a rank whose check passed ends at its next half's timeout, naming the
    # stopped rank.
    debug_psum = True

    # True when dispatch_send takes `rank_mask=` (int32 [N]) too (the FFI backends).
    takes_rank_mask = False

    def rank_mask_unsupported(self) -> "str | None":
        """None when this backend honours a `rank_mask` (docs/api.md, elastic EP), else why not.
        The communicator applies the mask's send side (the stopped pairs' ids become E) for
        every backend; a backend that waits for peers must also skip masked ranks in its waits
        and writes (FfiBackend halves get `rank_mask`: int32 [N], route.arrays["rank_mask"] in
        the combine halves). The pure-JAX backends need nothing more: their XLA collectives
        involve every rank, masked or not (so every process must still run)."""
        return None

    def combine_recv(self, ctx: Ctx, handle_arrays: dict, route, slot: int, out: Optional[Any],
                     pairs: bool = False):
        """Returns [T, H] in Spec.combine_dtype: sum_k w * y_row (f32 accumulation), plus `out`
        when given; rows at or past num_tokens are 0 (or `out`). With pairs=True also returns the
        unweighted row of every pair, [T, K, H] f32 (0 where the pair was not routed or dropped),
        which the weight gradient needs."""
        raise NotImplementedError
