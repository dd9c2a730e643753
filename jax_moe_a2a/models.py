"""An example DeepSeek-V3-shaped MoE block on top of the communicator, in plain JAX.

Params are a dict of arrays; the routed experts' weights are sharded over the EP axis (leading
expert dimension), everything else replicated. Use inside `jax.shard_map` over that axis:

    params = init_moe_params(key, cfg)
    shard = moe_param_specs(axis)                      # PartitionSpecs for shard_map in_specs
    out = moe_block(comm, cfg, local_params, x, num_tokens)   # x [T, H] -> [T, H]

or on global arrays (the shard_map is done for you): `moe_layer(comm, cfg, params, x, num_tokens)`.

Routed experts, `MoEConfig.experts`: "ragged_dot" (the default: silu(x @ w1) @ w2 per expert with
`jax.lax.ragged_dot`, w1 [E, H, F], w2 [E, F, H]), "grouped" (DeepSeek-V3's SwiGLU expert through
`jax_moe_a2a.experts.expert_mlp`: w_gate_up [E, 2F, H], w_down [E, H, F], bf16 or, with
`expert_dtype=float8_e4m3fn`, fp8 with block scales w_gate_up_scale / w_down_scale; any layout) or
"identity" (no routed weights: the received rows are the expert output, so the layer is the
exchange and its glue; any layout).

moe_block's options (all keyword-only, defaults = the plain layer above): `routing=(ids, weights)`
skips the router; `shared_at` places the shared expert ("combine", "overlap", "after"); `slot`
picks the exchange's slot (one per layer in a stack); `overlap=True` runs the split halves.
`local_moe_block` is the same layer without communication (what plain XLA does on one device);
`dense_moe_block` computes every expert for every token (the checking reference).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from . import experts
from ._compat import shard_map
from .overlap import overlap as in_flight
from .quant import dequantize_fp8, quantize_fp8_jax


EXPERT_KINDS = ("ragged_dot", "grouped", "identity")
SHARED_AT = ("combine", "overlap", "after")


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """hidden H, expert FFN width F, E routed experts, K per token, shared-expert FFN width,
    router scores "softmax" or "sigmoid" (DeepSeek-V3: sigmoid, top-K renormalised), and a
    scale applied to the routed weights. experts: "ragged_dot", "grouped" or "identity" (the
    module's docstring)."""

    hidden: int
    ffn: int
    num_experts: int
    topk: int
    shared_ffn: int = 0
    score: str = "softmax"
    route_scale: float = 1.0
    param_dtype: object = jnp.bfloat16
    experts: str = "ragged_dot"     # or "grouped" (SwiGLU experts through experts.expert_mlp) or "identity"
    expert_dtype: object = None     # "grouped": None (param_dtype) or jnp.float8_e4m3fn (block-scaled weights)
    weight_block: int = 128         # "grouped" fp8: weight scales per weight_block x weight_block block
    expert_impl: str = "auto"       # "grouped": expert_mlp's impl ("auto", "native", "xla")

    def __post_init__(self):
        if self.experts not in EXPERT_KINDS:
            raise ValueError(f"MoEConfig.experts: expected one of {EXPERT_KINDS}, got {self.experts!r}")
        if self.expert_dtype is not None and self.experts != "grouped":
            raise ValueError("MoEConfig.expert_dtype: only for experts='grouped'")

    @property
    def fp8_experts(self) -> bool:
        return self.expert_dtype is not None and jnp.dtype(self.expert_dtype) == jnp.dtype(jnp.float8_e4m3fn)


def _silu(h):
    """silu(h) = h * sigmoid(h), written with the primitive (jax.nn.silu is a jitted function:
    XLA can fuse both of its call sites' metadata into one instruction, so the HLO-schedule test
    would see the shared expert's scope on the routed experts' fusion)."""
    return h * jax.lax.logistic(h)


def _expert_names(cfg: MoEConfig) -> tuple:
    if cfg.experts == "identity":
        return ()
    if cfg.experts == "ragged_dot":
        return ("w1", "w2")
    return ("w_gate_up", "w_down") + (("w_gate_up_scale", "w_down_scale") if cfg.fp8_experts else ())


def init_moe_params(key, cfg: MoEConfig) -> dict:
    """router [H, E] f32; the routed experts (experts="ragged_dot": w1 [E, H, F], w2 [E, F, H];
    "grouped": w_gate_up [E, 2F, H], w_down [E, H, F], and with fp8 expert_dtype their f32 scales
    w_gate_up_scale [E, 2F/b, H/b], w_down_scale [E, H/b, F/b], b = weight_block); shared w1s [H, Fs],
    w2s [Fs, H]; in param_dtype unless said otherwise. experts="identity": no routed expert weights."""
    k = jax.random.split(key, 5)
    h, f, e = cfg.hidden, cfg.ffn, cfg.num_experts
    p = {"router": jax.random.normal(k[0], (h, e), jnp.float32) / jnp.sqrt(h)}
    if cfg.experts == "identity":
        pass
    elif cfg.experts == "ragged_dot":
        p["w1"] = (jax.random.normal(k[1], (e, h, f)) / jnp.sqrt(h)).astype(cfg.param_dtype)
        p["w2"] = (jax.random.normal(k[2], (e, f, h)) / jnp.sqrt(f)).astype(cfg.param_dtype)
    else:
        wgu = jax.random.normal(k[1], (e, 2 * f, h)) / jnp.sqrt(h)
        wdn = jax.random.normal(k[2], (e, h, f)) / jnp.sqrt(f)
        if cfg.fp8_experts:
            p["w_gate_up"], p["w_gate_up_scale"] = experts.quantize_weights_fp8(wgu, cfg.weight_block)
            p["w_down"], p["w_down_scale"] = experts.quantize_weights_fp8(wdn, cfg.weight_block)
        else:
            p["w_gate_up"] = wgu.astype(cfg.param_dtype)
            p["w_down"] = wdn.astype(cfg.param_dtype)
    if cfg.shared_ffn:
        p["w1s"] = (jax.random.normal(k[3], (h, cfg.shared_ffn)) / jnp.sqrt(h)).astype(cfg.param_dtype)
        p["w2s"] = (jax.random.normal(k[4], (cfg.shared_ffn, h)) / jnp.sqrt(cfg.shared_ffn)).astype(cfg.param_dtype)
    return p


def moe_param_specs(cfg: MoEConfig, axis="ep") -> dict:
    """shard_map in_specs for init_moe_params' dict: routed experts split over `axis`."""
    s = {"router": P(), **{name: P(axis) for name in _expert_names(cfg)}}
    if cfg.shared_ffn:
        s.update(w1s=P(), w2s=P())
    return s


def route(cfg: MoEConfig, router_w, x):
    """x [T, H] -> (topk_ids [T, K] int32, topk_weights [T, K] f32)."""
    logits = x.astype(jnp.float32) @ router_w
    if cfg.score == "sigmoid":
        scores = jax.nn.sigmoid(logits)
        w, ids = jax.lax.top_k(scores, cfg.topk)
        w = w / jnp.sum(w, axis=-1, keepdims=True)
    elif cfg.score == "softmax":
        w, ids = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), cfg.topk)
    else:
        raise ValueError(f"score: expected 'softmax' or 'sigmoid', got {cfg.score!r}")
    return ids.astype(jnp.int32), (w * cfg.route_scale).astype(jnp.float32)


def _experts(spec, cfg, params, got):
    """Routed experts on a Dispatched: got.x [R, H] (or [L, C, H]) -> the same shape in
    Spec.combine_dtype (tests/test_overlap_schedule.py calls it too)."""
    return _expert_rows(spec, cfg, params, got.x, got.scale, got.group_sizes)


def _expert_rows(spec, cfg, params, x, scale, group_sizes):
    """Routed experts on rows as received: x [R, H] (or [L, C, H]; experts="ragged_dot" takes the
    ragged layout only), float8_e4m3fn with scale [.., ceil(H/Spec.scale_block)] f32, or 16/32-bit
    with scale None; group_sizes [L] int32. Returns the same shape in Spec.combine_dtype."""
    if cfg.experts == "grouped":
        return _grouped_experts(spec, cfg, params, x, scale, group_sizes)
    if jnp.dtype(x.dtype) == jnp.dtype(jnp.float8_e4m3fn):  # else x arrives dequantised or 16/32-bit
        x = dequantize_fp8(x, scale, spec.scale_block)
    if cfg.experts == "identity":
        return x.astype(spec.combine_dtype)
    xin = x.astype(params["w1"].dtype)
    h = _silu(jax.lax.ragged_dot(xin, params["w1"], group_sizes))
    y = jax.lax.ragged_dot(h.astype(params["w2"].dtype), params["w2"], group_sizes)
    return y.astype(spec.combine_dtype)


def _grouped_experts(spec, cfg, params, x, scale, group_sizes):
    """experts="grouped": the SwiGLU experts via expert_mlp on the received layout, the rows adapted
    to the weights: fp8 weights take fp8 rows whose scale blocks are the weights' (rows that arrive in
    bf16, or with other blocks, are (re-)quantised with the library's rule); bf16 weights take the
    rows dequantised. Returns [.., H] in Spec.combine_dtype."""
    fp8_rows = jnp.dtype(x.dtype) == jnp.dtype(jnp.float8_e4m3fn)
    if cfg.fp8_experts:
        block = cfg.hidden // params["w_gate_up_scale"].shape[-1]
        if fp8_rows and (spec.scale_block != block or cfg.hidden % block):
            x, fp8_rows = dequantize_fp8(x, scale, spec.scale_block), False
        if not fp8_rows:
            x, scale = experts.quantize_rows_fp8(x, block)
        kw = dict(x_scale=scale, w_gate_up_scale=params["w_gate_up_scale"], w_down_scale=params["w_down_scale"])
    else:
        if fp8_rows:
            x = dequantize_fp8(x, scale, spec.scale_block)
        x = x.astype(params["w_gate_up"].dtype)
        kw = {}
    out = jnp.float32 if jnp.dtype(spec.combine_dtype).itemsize > 2 else jnp.bfloat16
    y = experts.expert_mlp(x, params["w_gate_up"], params["w_down"], group_sizes, out_dtype=out,
                           impl=cfg.expert_impl, **kw)
    return y.astype(spec.combine_dtype)


def _check_block_args(spec, cfg, overlap, shared_at):
    """shared_at resolved ("combine" / "overlap" / "after"), after checking the options."""
    if spec.layout != "ragged" and cfg.experts == "ragged_dot":
        raise ValueError("moe_block: experts='ragged_dot' needs Spec.layout='ragged' (experts='grouped' and "
                         "'identity' take both)")
    if shared_at is None:
        shared_at = "overlap" if overlap else "combine"
    if shared_at not in SHARED_AT:
        raise ValueError(f"moe_block: shared_at: expected one of {SHARED_AT} or None, got {shared_at!r}")
    if shared_at == "overlap" and not overlap:
        raise ValueError("moe_block: shared_at='overlap' needs overlap=True (the split halves leave the window)")
    return shared_at   # slot: checked by the communicator's halves


def _routing(cfg, params, x, routing):
    """(topk_ids [T, K] int32, topk_weights [T, K] f32): `routing` checked, or the router's."""
    if routing is None:
        return route(cfg, params["router"], x)
    ids, w = routing
    t = x.shape[0]
    if tuple(ids.shape) != (t, cfg.topk) or tuple(w.shape) != (t, cfg.topk):
        raise ValueError(f"routing: expected (ids, weights) of shape [T, K] = [{t}, {cfg.topk}], got "
                         f"{tuple(ids.shape)} and {tuple(w.shape)}")
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(f"routing: ids must be integers, got {ids.dtype}")
    return ids.astype(jnp.int32), w.astype(jnp.float32)


def _shared_after(spec, y, x, params):
    """shared_at="after": y [T, H] (the combined routed output) + the shared expert of x [T, H], the
    shared expert behind an optimisation barrier with y (it starts after the exchange has finished);
    both in Spec.combine_dtype -> [T, H] Spec.combine_dtype."""
    y, x = jax.lax.optimization_barrier((y, x))
    return y + shared_expert(spec, params, x)


def moe_block(comm, cfg: MoEConfig, params: dict, x, num_tokens=None, *, overlap: bool = False,
              expert_map=None, routing=None, shared_at=None, slot: int = 0):
    """One rank's MoE layer: x [T, H] -> [T, H] = shared expert + sum_k w_k * expert_k(x), in
    Spec.combine_dtype. num_tokens: None (T) or [] int32: rows at or past it get the shared expert
    only (0 without one).

    Routed experts (cfg.experts): "ragged_dot" runs `jax.lax.ragged_dot` on the ragged layout (w1/w2
    are the local [L, H, F] / [L, F, H] shards; fp8 dispatch is dequantised before the expert
    GEMMs); "grouped" runs `experts.expert_mlp` (SwiGLU, fp8 or bf16 weights) on either layout;
    "identity" returns the received rows (dequantised, in Spec.combine_dtype) on either layout.

    overlap=False: the one-shot dispatch/combine; differentiable w.r.t. x and every parameter
    (the router through the combine weights) on every backend.
    overlap=True: the split halves (dispatch_send / dispatch_recv, combine_send / combine_recv),
    by default with the shared expert's two halves placed in flight with `jax_moe_a2a.overlap`:
    silu(x @ w1s) between dispatch_send and dispatch_recv, @ w2s between combine_send and
    combine_recv (see docs/overlap.md). For inference: the split halves are differentiable only on
    the reference backend.

    routing: None (the router: `route(cfg, params["router"], x)`) or given (topk_ids [T, K] int
    in [0, E) (E_logical with expert_map), topk_weights [T, K] float): used as they are, the router
    is not read (params may lack "router"); e.g. the same precomputed routing for every layer.
    shared_at: where the shared expert (cfg.shared_ffn > 0; ignored without one) runs. None: the
    default, "overlap" with overlap=True, else "combine". "combine": computed beside the exchange
    and added by the combine (`out=`; XLA orders it); "overlap": its halves in flight in the split
    halves (needs overlap=True); "after": after the combine has returned, behind an optimisation
    barrier (serialised after the exchange), added in Spec.combine_dtype. The same layer for every
    placement (up to the rounding of that sum).
    slot: the slot (0 .. Spec.slots - 1) this layer's exchange uses; give consecutive layers of
    one jit different slots so that one layer's exchange need not wait for the previous one's
    buffers.

    expert_map: optional `jax_moe_a2a.ExpertMap` (redundant experts, EPLB): the router scores
    the map's E_logical logical experts (params["router"] [H, E_logical]) and w1/w2 hold the
    Spec.num_experts PHYSICAL experts (local shards [L, ...]; a replica holds a copy of its
    logical expert's weights, and under jax.grad each copy gets its own gradient: sum them).
    """
    spec = comm.spec
    shared_at = _check_block_args(spec, cfg, overlap, shared_at)
    ids, w = _routing(cfg, params, x, routing)
    has_shared = bool(cfg.shared_ffn)
    if not overlap:
        got = comm.dispatch(x, ids, w, num_tokens, slot=slot, expert_map=expert_map)
        shared = None
        if has_shared and shared_at == "combine":
            shared = shared_expert(spec, params, x)
        y = comm.combine(_experts(spec, cfg, params, got), got, out=shared)
        return _shared_after(spec, y, x, params) if has_shared and shared_at == "after" else y
    in_flight_shared = has_shared and shared_at == "overlap"
    sent = comm.dispatch_send(x, ids, w, num_tokens, slot=slot, expert_map=expert_map)
    if in_flight_shared:   # the weights go through the barrier too: all of the work waits for the send
        sent, h = in_flight(sent, shared_up, x, params["w1s"])
    got = comm.dispatch_recv(sent)
    back = comm.combine_send(_experts(spec, cfg, params, got), got)
    shared = None
    if in_flight_shared:
        back, shared = in_flight(back, functools.partial(shared_down, spec), h, params["w2s"])
    elif has_shared and shared_at == "combine":
        shared = shared_expert(spec, params, x)
    y = comm.combine_recv(back, out=shared)
    return _shared_after(spec, y, x, params) if has_shared and shared_at == "after" else y


def shared_expert(spec, params, x):
    """The shared expert: x [T, H] -> silu(x @ w1s) @ w2s [T, H] in Spec.combine_dtype (its two
    halves, `shared_up` then `shared_down`)."""
    return shared_down(spec, shared_up(x, params["w1s"]), params["w2s"])


def shared_up(x, w1s):
    """First half of the shared expert: x [T, H] -> silu(x @ w1s) [T, Fs] (named scope
    `shared_expert_up`, which the HLO-schedule test looks for)."""
    with jax.named_scope("shared_expert_up"):
        return _silu(x.astype(w1s.dtype) @ w1s)


def shared_down(spec, h, w2s):
    """Second half: h [T, Fs] -> h @ w2s [T, H] in Spec.combine_dtype (scope `shared_expert_down`)."""
    with jax.named_scope("shared_expert_down"):
        return (h @ w2s).astype(spec.combine_dtype)


def moe_layer(comm, cfg: MoEConfig, params: dict, x, num_tokens=None, *, overlap: bool = False,
              expert_map=None, data_axes=None, routing=None, shared_at=None, slot: int = 0):
    """moe_block on global arrays: `jax.shard_map` over comm.mesh and comm.axis.

    x [N*T, H] (rank r's tokens are rows r*T .. r*T+T-1); num_tokens None or [N] int32 (one per
    rank); params as init_moe_params (global; routed experts get split over the axis). Returns
    [N*T, H] in Spec.combine_dtype. Works inside and outside `jax.jit`. expert_map: as in
    moe_block (replicated to every rank; an argument of the shard_map, so a jitted caller that
    takes it as an argument does not recompile for a new map). routing: None or global
    (topk_ids [N*T, K] int32, topk_weights [N*T, K] f32), rows split as x's; shared_at, slot: as
    in moe_block.

    data_axes: the mesh axes x's rows (and num_tokens) are split over, major to minor; default
    comm.axis, which gives every EP group of a multi-axis mesh the same tokens. With the groups'
    axes as well, e.g. ("dp", "ep") on a (dp, ep) mesh with comm.axis "ep", every group has its own
    tokens: x [D*T, H] and num_tokens [D] with D = the product of those axes' sizes, row block
    b = row-major index over data_axes (on that mesh: b = g * N + r, group g, rank r).
    """
    specs = moe_param_specs(cfg, comm.axis)
    if routing is not None and "router" not in params:
        specs.pop("router")
    row = P(_data_axes(comm, data_axes))
    kw = dict(overlap=overlap, shared_at=shared_at, slot=slot)
    routing = None if routing is None else tuple(routing)

    def fn(p, x, m, n, r):
        return moe_block(comm, cfg, p, x, n, expert_map=m, routing=r, **kw)
    in_specs = (specs, row, P(), P() if num_tokens is None else row, P() if routing is None else (row, row))
    return shard_map(fn, mesh=comm.mesh, in_specs=in_specs, out_specs=row)(params, x, expert_map, num_tokens,
                                                                           routing)


def _data_axes(comm, data_axes):
    """moe_layer's data_axes as a PartitionSpec entry (an axis name or a tuple), checked."""
    if data_axes is None:
        return comm.axis
    axes = (data_axes,) if isinstance(data_axes, str) else tuple(data_axes)
    ep = (comm.axis,) if isinstance(comm.axis, str) else tuple(comm.axis)
    names = tuple(comm.mesh.axis_names)
    if len(set(axes)) != len(axes) or any(a not in names for a in axes):
        raise ValueError(f"moe_layer: data_axes={data_axes!r} must be distinct axes of the mesh {names}")
    if any(a not in axes for a in ep):
        raise ValueError(f"moe_layer: data_axes={data_axes!r} must include the EP axis {comm.axis!r} "
                         "(the ranks of a group hold different tokens)")
    return axes[0] if len(axes) == 1 else axes


def dense_moe_block(cfg: MoEConfig, spec, params: dict, x, num_tokens=None, *, routing=None):
    """What moe_block computes, on one device without communication (every expert, dense):
    x [T, H] -> [T, H] in spec.combine_dtype, for checking serving outputs. The routed rows
    pass through spec.dispatch_dtype as on the wire (fp8: quantised with the library's scales).
    num_tokens: None or [] int32; routing: None (the router) or (topk_ids [T, K] int, topk_weights
    [T, K] float), as in moe_block. Memory: E x T x H (every expert's output for every token).
    """
    t = x.shape[0]
    ids, w = _routing(cfg, params, x, routing)
    n = t if num_tokens is None else jnp.asarray(num_tokens).reshape(())
    w = jnp.where((jnp.arange(t) < n)[:, None], w, 0.0)
    if spec.is_fp8:
        xw = dequantize_fp8(*quantize_fp8_jax(x, spec.scale_block, spec.pow2_scale), spec.scale_block)
    else:
        xw = x.astype(spec.dispatch_dtype)
    if cfg.experts == "grouped":   # every expert over every token: the expert_major layout [E, T, H]
        xe = jnp.broadcast_to(xw.astype(jnp.float32), (cfg.num_experts, t, cfg.hidden))
        xs = None
        if spec.is_fp8 and cfg.fp8_experts and spec.scale_block == cfg.hidden // params["w_gate_up_scale"].shape[-1]:
            q, s = quantize_fp8_jax(  # the wire's own fp8 rows and scales
                x, spec.scale_block, spec.pow2_scale)
            xe = jnp.broadcast_to(q, (cfg.num_experts,) + q.shape)
            xs = jnp.broadcast_to(s, (cfg.num_experts,) + s.shape)
        counts = jnp.full((cfg.num_experts,), t, jnp.int32)
        y = _grouped_experts(spec, cfg, params, xe, xs, counts)
    elif cfg.experts == "identity":   # every expert returns its row
        y = jnp.broadcast_to(xw.astype(spec.combine_dtype), (cfg.num_experts, t, cfg.hidden))
    else:
        xw = xw.astype(params["w1"].dtype)
        hid = _silu(jnp.einsum("th,ehf->etf", xw, params["w1"]))
        y = jnp.einsum("etf,efh->eth", hid.astype(params["w2"].dtype), params["w2"]).astype(spec.combine_dtype)
    gate = jnp.sum(jax.nn.one_hot(ids, cfg.num_experts, dtype=jnp.float32) * w[..., None], axis=1)   # [T, E]
    out = jnp.einsum("te,eth->th", gate, y.astype(jnp.float32))
    if cfg.shared_ffn:
        shared = shared_expert(spec, params, x).astype(jnp.float32)
        out = out + shared
    return out.astype(spec.combine_dtype)


def local_moe_block(cfg: MoEConfig, spec, params: dict, x, num_tokens=None, *, routing=None, shared_at=None):
    """The MoE layer without communication, as plain XLA runs it on one device: x [T, H] (16/32-bit)
    -> [T, H] in spec.combine_dtype.

    The routed (token, k) pairs are sorted by expert (stable), x's rows gathered in that order in
    x's dtype (the ragged layout with group_sizes [E] int32: no wire, so no dispatch dtype), the
    experts of cfg.experts run on them (params' routed weights hold all E = cfg.num_experts
    experts: w1 [E, H, F] ...), and their outputs are scatter-added back weighted, in f32. Pairs of
    rows at or past num_tokens ([] int32 or None), or with ids outside [0, E), are skipped.
    routing: as in moe_block. shared_at: "combine" / "overlap" (None, the default: the shared
    expert computed first, XLA orders it; there is no exchange to overlap with) or "after" (after
    the routed sum, behind an optimisation barrier). Equals dense_moe_block with a 16/32-bit
    spec.dispatch_dtype equal to x's dtype, up to the order of the f32 sums.
    spec: only its combine_dtype is read. expert_map: not supported.
    """
    if jnp.dtype(x.dtype) == jnp.dtype(jnp.float8_e4m3fn):
        raise ValueError("local_moe_block: x must be 16/32-bit (fp8 rows need their scales: dequantise first)")
    shared_at = shared_at or "combine"
    if shared_at not in SHARED_AT:
        raise ValueError(f"local_moe_block: shared_at: expected one of {SHARED_AT} or None, got {shared_at!r}")
    t, e = x.shape[0], cfg.num_experts
    ids, w = _routing(cfg, params, x, routing)
    k = ids.shape[1]
    n = t if num_tokens is None else jnp.asarray(num_tokens).reshape(())
    valid = (jnp.arange(t) < n)[:, None] & (ids >= 0) & (ids < e)
    key = jnp.where(valid, ids, e).reshape(-1)                  # skipped pairs sort last, past every group
    order = jnp.argsort(key, stable=True)
    tok = order // k                                            # [T*K] the token of each sorted pair
    group_sizes = jnp.bincount(key, length=e + 1)[:e].astype(jnp.int32)
    has_shared = bool(cfg.shared_ffn)
    if has_shared and shared_at != "after":
        out = shared_expert(spec, params, x).astype(jnp.float32)
    else:
        out = jnp.zeros(x.shape, jnp.float32)
    y = _expert_rows(spec, cfg, params, x[tok], None, group_sizes)  # [T*K, H] combine_dtype
    wf = jnp.where(valid, w, 0.0).reshape(-1)[order]
    out = out.at[tok].add(y.astype(jnp.float32) * wf[:, None])
    if has_shared and shared_at == "after":
        out, x = jax.lax.optimization_barrier((out, x))
        out = out + shared_expert(spec, params, x).astype(jnp.float32)
    return out.astype(spec.combine_dtype)


def rms_norm(x, eps: float = 1e-6):
    """x [..., H] -> x / sqrt(mean(x^2 over H) + eps) in x's dtype (computed in f32; no learned
    weight): the norm in front of each layer of toy_model and of the layer benchmark, as
    DeepSeek-V3's blocks have it."""
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)


def toy_model(comm, cfg: MoEConfig, layers: list, x, num_tokens=None, *, remat: bool = False):
    """A stack of pre-norm residual MoE layers, x_{i+1} = x_i + moe_block(rms_norm(x_i)): x [T, H]
    -> [T, H] in x's dtype (the test model of issue 7). Without the norm a deep stack overflows:
    the SwiGLU experts are quadratic in their input.

    remat=True wraps each layer in `jax.checkpoint`: the backward pass recomputes the router,
    experts and shared expert, while the dispatch/combine results are kept (communication halves
    are never recomputed, see jax_moe_a2a.commcall)."""
    def layer(p, x, num_tokens):
        y = moe_block(comm, cfg, p, rms_norm(x), num_tokens)
        return (x.astype(jnp.float32) + y.astype(jnp.float32)).astype(x.dtype)

    if remat:
        layer = jax.checkpoint(layer)
    for p in layers:
        x = layer(p, x, num_tokens)
    return x
