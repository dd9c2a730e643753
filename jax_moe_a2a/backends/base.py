"""The interface every backend implements. The communicator validates, the backend moves data.

The contract: a backend is opened from (Config, mesh, axis) and its communicator id
(`Backend.open`), keeps what it needs of them, and never reads the communicator back. The
communicator asks it only through the methods declared here: the four halves (inside
`jax.shard_map` on one rank's shard; shapes in `jax_moe_a2a.types`), the buffer sizes, the
diagnostics (`proxy_stats`, `kernel_seconds`, `last_error`, `diagnostics`) and `close`. The halves
exchange named records: dispatch_send returns a `Sent`, dispatch_recv a `Received`; what a backend
keeps between its halves (`wire`, `placement`) is a pytree of a type it declares itself.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp

from ..config import Config
from ..spec import Spec


@dataclasses.dataclass(frozen=True)
class Ctx:
    """Static facts a backend needs on every call, plus the traced rank."""

    spec: Spec
    num_ranks: int
    axis: Any           # mesh axis name(s) of the EP axis
    rank: Any           # [] int32, jax.lax.axis_index(axis)
    comm_id: int
    call_id: int        # distinct per call (each half's call, traced or retraced): XLA never merges two
    config: Optional[Config] = None  # the communicator's Config
    group_axes: tuple = ()  # the mesh's other axes (mesh order): each position is one EP group


class Sent(NamedTuple):
    """What `Backend.dispatch_send` returns.

    wire:        the backend's in-flight record for its dispatch_recv (a pytree of arrays of a
                 type the backend declares), carried in `DispatchHandle.wire`.
    placement:   where each pair went, [T, K] arrays at least (a pytree of the backend's type),
                 handed to dispatch_recv, which returns it completed.
    num_dropped: [] int32 pairs with bad expert ids that this rank sends (rank-mask-stopped pairs
                 included: the communicator subtracts those).
    """

    wire: Any
    placement: Any
    num_dropped: Any


class Received(NamedTuple):
    """What `Backend.dispatch_recv` returns, in `Dispatched`'s shapes (jax_moe_a2a/types.py):
    x, scale (or None), group_sizes [L], weights, src, num_overflow [] int32, and the placement
    completed with what the combine halves need (where each received row came from)."""

    x: Any
    scale: Optional[Any]
    group_sizes: Any
    weights: Any
    src: Any
    num_overflow: Any
    placement: Any


def group_index(ctx: Ctx):
    """[] int32: this rank's EP group, jax.lax.axis_index(ctx.group_axes) (row g of
    Communicator.groups); 0 on a mesh without other axes."""
    if not ctx.group_axes:
        return jnp.zeros((), jnp.int32)
    try:
        return jax.lax.axis_index(ctx.group_axes).astype(jnp.int32)
    except NameError as e:
        raise ValueError(f"jax_moe_a2a: the EP groups are told apart by the mesh's other axes {ctx.group_axes!r}: "
                         "run the ops inside a jax.shard_map that is manual over every mesh axis") from e


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

    def dispatch_send(self, ctx: Ctx, x, x_scale, topk_ids, topk_weights, num_tokens, slot: int, after=None,
                      rank_mask=None) -> Sent:
        """x [T, H] (input dtype, or fp8 with x_scale [T, S]); topk_ids [T, K] int32;
        topk_weights [T, K] f32; num_tokens [] int32; after: an array this send must follow
        (XLA orders calls only by data dependencies), or None; rank_mask: int32 [N] (1 = alive)
        or None (see rank_mask_unsupported)."""
        raise NotImplementedError

    def dispatch_recv(self, ctx: Ctx, wire, placement, slot: int, rank_mask=None) -> Received:
        """`wire` and `placement` as dispatch_send returned them (`Sent`); rank_mask as given to
        dispatch_send. Returns `Received`: x [R, H] / [L, C, H] in Spec.dispatch_dtype (or
        Spec.recv_dtype where the backend dequantises fp8), scale [.., S] f32 or None, group_sizes
        [L] int32, weights [R] / [L, C] f32, src [.., 2] int32 (-1 past the counts), num_overflow
        [] int32, and the placement completed with where each received row came from."""
        raise NotImplementedError

    def combine_send(self, ctx: Ctx, y, route, slot: int, after=None, from_slot=None):
        """y in the layout of Dispatched.x (bf16/f16/f32); route: the dispatch's `Route` (its
        `placement` as dispatch_recv completed it, `rank_mask`); after: as in dispatch_send (one
        array; the FFI backends' `after_operand` packs a pytree). Returns the backend's in-flight
        record (a pytree of arrays, e.g. `FfiCombineWire`, or the reference backend's rows
        [N, tp, P, H] as they arrive), carried in `CombineHandle.wire`. from_slot: the slot of the dispatch
        whose rows these are (None: `slot`); a backend whose combine reads per-slot state of the
        dispatch (the host and cuda proxy paths' combine offsets) reads that slot's."""
        raise NotImplementedError

    # True when JAX autodiff differentiates the halves directly (pure-JAX backends); otherwise the
    # communicator wraps the one-shot ops in custom_vjp (jax_moe_a2a/autodiff.py).
    autodiff = False
    # True when the halves move data with XLA collectives (pure-JAX backends). A rank that stops
    # (debug=True raising) would leave the others waiting in XLA's next collective forever (on
    # XLA:CPU until its rendezvous aborts the process), so the debug check must stop every rank
    # at once. FFI backends time out and name the missing rank instead.
    xla_collectives = False
    # True when the debug check may decide for every rank with an XLA collective over the EP axis
    # (an all_gather of every rank's findings, debug.record's gather_axis; the name predates it:
    # XLA collectives work there: every CPU backend and the pure-JAX ones), so that every rank
    # raises or none does. The GPU FFI backends set False: XLA's NCCL collectives refuse several processes
    # on one GPU; there a rank whose check passed ends at its next half's timeout, naming the
    # stopped rank.
    debug_psum = True

    def rank_mask_unsupported(self) -> "str | None":
        """None when this backend honours a `rank_mask` (docs/api.md, elastic EP), else why not.
        The communicator applies the mask's send side (the stopped pairs' ids become E) for
        every backend; a backend that waits for peers must also skip masked ranks in its waits
        and writes (every half gets the mask: `rank_mask` in the dispatch halves, `route.rank_mask`
        in the combine halves). The pure-JAX backends need nothing more: their XLA collectives
        involve every rank, masked or not (so every process must still run)."""
        return None

    def combine_recv(self, ctx: Ctx, wire, route, slot: int, out: Optional[Any], pairs: bool = False):
        """Returns [T, H] in Spec.combine_dtype: sum_k w * y_row (f32 accumulation), plus `out`
        when given; rows at or past num_tokens are 0 (or `out`). With pairs=True also returns the
        unweighted row of every pair, [T, K, H] f32 (0 where the pair was not routed or dropped),
        which the weight gradient needs."""
        raise NotImplementedError
