"""An example DeepSeek-V3-shaped MoE block on top of the communicator, in plain JAX.

Params are a dict of arrays; the routed experts' weights are sharded over the EP axis (leading
expert dimension), everything else replicated. Use inside `jax.shard_map` over that axis:

    params = init_moe_params(key, cfg)
    shard = moe_param_specs(axis)                      # PartitionSpecs for shard_map in_specs
    out = moe_block(comm, cfg, local_params, x, num_tokens)   # x [T, H] -> [T, H]

or on global arrays (the shard_map is done for you): `moe_layer(comm, cfg, params, x, num_tokens)`.

Routed experts, `MoEConfig.experts`: "ragged_dot" (the default: silu(x @ w1) @ w2 per expert with
`jax.lax.ragged_dot`, w1 [E, H, F], w2 [E, F, H]) or "grouped" (DeepSeek-V3's SwiGLU expert through
`jax_moe_a2a.experts.expert_mlp`: w_gate_up [E, 2F, H], w_down [E, H, F], bf16 or, with
`expert_dtype=float8_e4m3fn`, fp8 with block scales w_gate_up_scale / w_down_scale; any layout).
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


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """hidden H, expert FFN width F, E routed experts, K per token, shared-expert FFN width,
    router scores "softmax" or "sigmoid" (DeepSeek-V3: sigmoid, top-K renormalised), and a
    scale applied to the routed weights."""

    hidden: int
    ffn: int
    num_experts: int
    topk: int
    shared_ffn: int = 0
    score: str = "softmax"
    route_scale: float = 1.0
    param_dtype: object = jnp.bfloat16
    experts: str = "ragged_dot"     # or "grouped": SwiGLU experts through experts.expert_mlp
    expert_dtype: object = None     # "grouped": None (param_dtype) or jnp.float8_e4m3fn (block-scaled weights)
    weight_block: int = 128         # "grouped" fp8: weight scales per weight_block x weight_block block
    expert_impl: str = "auto"       # "grouped": expert_mlp's impl ("auto", "native", "xla")

    def __post_init__(self):
        if self.experts not in ("ragged_dot", "grouped"):
            raise ValueError(f"MoEConfig.experts: expected 'ragged_dot' or 'grouped', got {self.experts!r}")
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
    if cfg.experts == "ragged_dot":
        return ("w1", "w2")
    return ("w_gate_up", "w_down") + (("w_gate_up_scale", "w_down_scale") if cfg.fp8_experts else ())


def init_moe_params(key, cfg: MoEConfig) -> dict:
    """router [H, E] f32; the routed experts (experts="ragged_dot": w1 [E, H, F], w2 [E, F, H];
    "grouped": w_gate_up [E, 2F, H], w_down [E, H, F], and with fp8 expert_dtype their f32 scales
    w_gate_up_scale [E, 2F/b, H/b], w_down_scale [E, H/b, F/b], b = weight_block); shared w1s [H, Fs],
    w2s [Fs, H]; in param_dtype unless said otherwise."""
    k = jax.random.split(key, 5)
    h, f, e = cfg.hidden, cfg.ffn, cfg.num_experts
    p = {"router": jax.random.normal(k[0], (h, e), jnp.float32) / jnp.sqrt(h)}
    if cfg.experts == "ragged_dot":
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
    """Routed experts: got.x [R, H] (or [L, C, H] with experts="grouped") -> the same shape."""
    if cfg.experts == "grouped":
        return _grouped_experts(spec, cfg, params, got.x, got.scale, got.group_sizes)
    xin = got.x
    if spec.recv_is_fp8:  # else got.x arrives dequantised (Spec.recv_dtype) or 16/32-bit
        xin = dequantize_fp8(got.x, got.scale, spec.scale_block)
    xin = xin.astype(params["w1"].dtype)
    h = _silu(jax.lax.ragged_dot(xin, params["w1"], got.group_sizes))
    y = jax.lax.ragged_dot(h.astype(params["w2"].dtype), params["w2"], got.group_sizes)
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


def moe_block(comm, cfg: MoEConfig, params: dict, x, num_tokens=None, *, overlap: bool = False,
              expert_map=None):
    """One rank's MoE layer: x [T, H] -> [T, H] = shared expert + sum_k w_k * expert_k(x).

    Routed experts (cfg.experts): "ragged_dot" runs `jax.lax.ragged_dot` on the ragged layout (w1/w2
    are the local [L, H, F] / [L, F, H] shards; fp8 dispatch is dequantised before the expert
    GEMMs); "grouped" runs `experts.expert_mlp` (SwiGLU, fp8 or bf16 weights) on either layout.

    overlap=False: the one-shot dispatch/combine; differentiable w.r.t. x and every parameter
    (the router through the combine weights) on every backend.
    overlap=True: the split halves with the shared expert's two halves placed in flight with
    `jax_moe_a2a.overlap`: silu(x @ w1s) between dispatch_send and dispatch_recv, @ w2s between
    combine_send and combine_recv (see docs/overlap.md). For inference: the split halves are
    differentiable only on the reference backend.

    expert_map: optional `jax_moe_a2a.ExpertMap` (redundant experts, EPLB): the router scores
    the map's E_logical logical experts (params["router"] [H, E_logical]) and w1/w2 hold the
    Spec.num_experts PHYSICAL experts (local shards [L, ...]; a replica holds a copy of its
    logical expert's weights, and under jax.grad each copy gets its own gradient: sum them).
    """
    spec = comm.spec
    if spec.layout != "ragged" and cfg.experts != "grouped":
        raise ValueError("moe_block: experts='ragged_dot' needs Spec.layout='ragged' (experts='grouped' takes both)")
    ids, w = route(cfg, params["router"], x)
    if not overlap:
        got = comm.dispatch(x, ids, w, num_tokens, expert_map=expert_map)
        shared = None
        if cfg.shared_ffn:
            shared = shared_down(spec, shared_up(x, params["w1s"]), params["w2s"])
        return comm.combine(_experts(spec, cfg, params, got), got, out=shared)
    sent = comm.dispatch_send(x, ids, w, num_tokens, expert_map=expert_map)
    if cfg.shared_ffn:   # the weights go through the barrier too: all of the work waits for the send
        sent, h = in_flight(sent, shared_up, x, params["w1s"])
    got = comm.dispatch_recv(sent)
    back = comm.combine_send(_experts(spec, cfg, params, got), got)
    shared = None
    if cfg.shared_ffn:
        back, shared = in_flight(back, functools.partial(shared_down, spec), h, params["w2s"])
    return comm.combine_recv(back, out=shared)


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
              expert_map=None, data_axes=None):
    """moe_block on global arrays: `jax.shard_map` over comm.mesh and comm.axis.

    x [N*T, H] (rank r's tokens are rows r*T .. r*T+T-1); num_tokens None or [N] int32 (one per
    rank); params as init_moe_params (global; routed experts get split over the axis). Returns
    [N*T, H] in Spec.combine_dtype. Works inside and outside `jax.jit`. expert_map: as in
    moe_block (replicated to every rank; an argument of the shard_map, so a jitted caller that
    takes it as an argument does not recompile for a new map).

    data_axes: the mesh axes x's rows (and num_tokens) are split over, major to minor; default
    comm.axis, which gives every EP group of a multi-axis mesh the same tokens. With the groups'
    axes as well, e.g. ("dp", "ep") on a (dp, ep) mesh with comm.axis "ep", every group has its own
    tokens: x [D*T, H] and num_tokens [D] with D = the product of those axes' sizes, row block
    b = row-major index over data_axes (on that mesh: b = g * N + r, group g, rank r).
    """
    specs = moe_param_specs(cfg, comm.axis)
    row = P(_data_axes(comm, data_axes))
    if num_tokens is None:
        fn = lambda p, x, m: moe_block(comm, cfg, p, x, overlap=overlap, expert_map=m)
        return shard_map(fn, mesh=comm.mesh, in_specs=(specs, row, P()), out_specs=row)(params, x, expert_map)
    fn = lambda p, x, n, m: moe_block(comm, cfg, p, x, n, overlap=overlap, expert_map=m)
    return shard_map(fn, mesh=comm.mesh, in_specs=(specs, row, row, P()), out_specs=row)(
        params, x, num_tokens, expert_map)


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


def dense_moe_block(cfg: MoEConfig, spec, params: dict, x, num_tokens=None):
    """What moe_block computes, on one device without communication (every expert, dense):
    x [T, H] -> [T, H] in spec.combine_dtype, for checking serving outputs. The routed rows
    pass through spec.dispatch_dtype as on the wire (fp8: quantised with the library's scales).
    """
    t = x.shape[0]
    ids, w = route(cfg, params["router"], x)
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
    else:
        xw = xw.astype(params["w1"].dtype)
        hid = _silu(jnp.einsum("th,ehf->etf", xw, params["w1"]))
        y = jnp.einsum("etf,efh->eth", hid.astype(params["w2"].dtype), params["w2"]).astype(spec.combine_dtype)
    gate = jnp.sum(jax.nn.one_hot(ids, cfg.num_experts, dtype=jnp.float32) * w[..., None], axis=1)   # [T, E]
    out = jnp.einsum("te,eth->th", gate, y.astype(jnp.float32))
    if cfg.shared_ffn:
        shared = shared_down(spec, shared_up(x, params["w1s"]), params["w2s"]).astype(jnp.float32)
        out = out + shared
    return out.astype(spec.combine_dtype)


def toy_model(comm, cfg: MoEConfig, layers: list, x, num_tokens=None, *, remat: bool = False):
    """A stack of residual MoE layers: x [T, H] -> [T, H] (the test model of issue 7).

    remat=True wraps each layer in `jax.checkpoint`: the backward pass recomputes the router,
    experts and shared expert, while the dispatch/combine results are kept (communication halves
    are never recomputed, see jax_moe_a2a.commcall)."""
    def layer(p, x, num_tokens):
        return (x.astype(jnp.float32) + moe_block(comm, cfg, p, x, num_tokens).astype(jnp.float32)).astype(x.dtype)

    if remat:
        layer = jax.checkpoint(layer)
    for p in layers:
        x = layer(p, x, num_tokens)
    return x
