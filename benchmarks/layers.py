"""MoE layer benchmark: L layers (dispatch -> experts -> combine) unrolled in one jax.jit.

    python benchmarks/layers.py [--backend host,reference] [--shape decode] [--quick]
    mpirun -n 2 python benchmarks/layers.py --backend cuda --shape decode

Every layer is the library's own: `jax_moe_a2a.models.moe_block(comm, cfg, ..., overlap=True)` (the
split halves), so what is timed is what users run. Per backend, shape, expert kind (models.MoEConfig
experts=; `grouped`: DeepSeek-V3's expert, a SwiGLU MLP with fp8 weights (128 x 128 block scales,
e4m3) through jax_moe_a2a.expert_mlp on the fp8 rows as received (the native grouped GEMMs where
built, else plain JAX), fp8 hidden re-quantised, F = --ffn: the headline; `identity`: the received
rows are the expert output; `ragged_dot`: silu(x @ w1) @ w2 per local expert with jax.lax.ragged_dot
in bf16, XLA's own grouped GEMM) and shared expert placement (moe_block's shared_at; `overlap`: its
two halves in flight with jax_moe_a2a.overlap; `after`: after combine_recv, behind an optimisation
barrier; `none`: no shared expert (MoEConfig.shared_ffn=0), so that with identity experts the layer
is dispatch + combine and their glue), each layer on its own slot (slot = layer mod Spec.slots), it
times `steps` back-to-back calls of the jitted L-layer step (each step's output is the next one's
input; every layer reads its input through models.rms_norm, so the chained stream stays finite:
a row that is not finite is marked NOT FINITE) after two warm-up calls (one on CPUs), blocks at the
end and divides by steps x L: one repeat. p50 and min over repeats, max over processes. Routing (--routing): `fixed`, the same
precomputed top-k ids and weights for every layer (moe_block(routing=(ids, weights))), or
`per-layer`, moe_block's router (DeepSeek-V3's: sigmoid scores, top-K renormalised; one router per
layer). Next to every backend: `plain`, the same layer without communication on the same inputs
(models.local_moe_block: each rank sorts its own tokens' rows by local expert, runs the experts,
scatter-adds them back weighted): at EP=1 the whole layer, at EP>1 each rank's local compute only.
XLA command buffers: `--cmdbuf on,off` runs one child process per setting
(XLA_FLAGS must be set before JAX starts; the default on GPUs in one process); under mpirun or on
CPUs (no command buffers) the current XLA_FLAGS decide. Through a proxy (cuda with peers on other
nodes, host --proxied) `--raw-wire` also times, after the layers and in the same processes, the raw
exchange of the bytes the proxies wrote per layer (benchlib/raw_exchange.py: raw fi_writedata, every
rank writing every peer at once), the wire's share of the layer. Writes layers.json (and layers.png).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import traceback

import benchlib
from benchlib import Progress, gpu_clock, raw_exchange, report, shapes, timing

NO_CMDBUF = "--xla_gpu_enable_command_buffer="


def parse_args(argv):
    from halves import add_common_args
    p = argparse.ArgumentParser(prog="python benchmarks/layers.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    p.add_argument("--layers", type=int, default=None, help="MoE layers per jitted step (default 4; 2 on CPUs)")
    p.add_argument("--steps", type=int, default=None, help="back-to-back steps per repeat (default 10; CPU 1)")
    p.add_argument("--repeats", type=int, default=None, help="repeats, at least (default 7; CPU 5; quick 1; see --min-time)")
    p.add_argument("--experts", default=None,
                   help="comma-separated: grouped, identity, ragged_dot (default all three on GPUs; grouped and "
                        "identity on CPUs, where XLA's ragged_dot computes every row against every local expert)")
    p.add_argument("--shared", default="overlap,after",
                   help="comma-separated: overlap, after, none (no shared expert: dispatch + experts + combine only)")
    p.add_argument("--ffn", type=int, default=None, help="expert FFN width F (default 2048; scaled on CPU)")
    p.add_argument("--no-plain", action="store_true", help="skip the plain-XLA layer")
    p.add_argument("--proxied", action="store_true",
                   help="the host backend through its proxy thread (a2a.init(proxied=True), node_size from "
                        "$JAX_MOE_A2A_NODE_SIZE, default 0: every pair through the engine): the cuda inter-node "
                        "path's protocol on CPUs; with NODE_SIZE=1 every peer remote, with NODE_SIZE=N none (the "
                        "node-local path, rows copied in memory: a node's ranks must share one process)")
    p.add_argument("--raw-wire", action="store_true",
                   help="through a proxy (cuda with remote peers, host --proxied): after timing, the raw wire time "
                        "of the bytes the proxies wrote per layer, every rank writing every peer at once (raw "
                        "fi_writedata, benchlib/raw_exchange.py), in the same processes: issue 35's denominator")
    p.add_argument("--dispatch-dtype", default="fp8", choices=("fp8", "fp8-recv-bf16", "bf16"),
                   help="dispatch dtype: fp8 e4m3 with 128-value scales (DeepSeek-V3's; identity and bf16 experts "
                        "dequantise the rows in XLA), fp8-recv-bf16 (fp8 on the wire, the rows dequantised to bf16 "
                        "on receive: Spec.recv_dtype) or bf16 (the bytes the plain-XLA layer moves)")
    p.add_argument("--routing", default="fixed", choices=("fixed", "per-layer"),
                   help="fixed: every layer routes with the same precomputed top-k ids and weights "
                        "(moe_block(routing=...); XLA computes the plain layer's sort once for the whole step); "
                        "per-layer: each layer routes its own input with moe_block's router (its own [H, E] f32 "
                        "weights, sigmoid scores, top-k renormalised: DeepSeek-V3's), as a model does")
    p.add_argument("--trace", action="store_true",
                   help="after timing, trace 3 steps with the JAX profiler: device busy time, idle gaps and "
                        "the top kernels per layer (benchlib/trace.py; GPUs only)")
    p.add_argument("--cmdbuf", default="auto",
                   help="XLA command buffers: on, off, on,off (one child process each), or auto (on,off on "
                        "GPUs in one process, else as XLA_FLAGS say)")
    p.add_argument("--env-variants", default="",
                   help="';'-separated library settings, each a space-separated list of JAX_MOE_A2A_*=VALUE "
                        "(or 'default': none), timed one after another in the same processes, each with its own "
                        "communicator (the library reads its settings when a communicator is created): "
                        "same-run comparisons without a process start each; every result names its variant")
    p.add_argument("--rounds", type=int, default=1,
                   help="with --env-variants: the variants in this many interleaved rounds (a machine's drift "
                        "spreads over all of them)")
    p.add_argument("--json-out", default=None, help=argparse.SUPPRESS)  # child processes: results only
    args = p.parse_args(argv)
    args.env_variants = parse_env_variants(args.env_variants)
    if args.rounds < 1:
        p.error("--rounds: at least 1")
    return args


def parse_env_variants(arg: str) -> list:
    """'A=1 B=2;default' -> [{'A': '1', 'B': '2'}, {}]; [{}] (one variant, the environment as it is)
    for ''. Only the library's own settings (JAX_MOE_A2A_*) are accepted: others (XLA's, JAX's) are
    read when the process starts, so a variant could not change them."""
    out = []
    for part in [v.strip() for v in arg.split(";")] if arg.strip() else ["default"]:
        env = {}
        for item in part.split() if part != "default" else []:
            name, eq, value = item.partition("=")
            if not eq or not name.startswith("JAX_MOE_A2A_"):
                raise SystemExit(f"--env-variants: {item!r} is not JAX_MOE_A2A_<NAME>=<value>")
            env[name] = value
        out.append(env)
    return out


def variant_label(env: dict) -> str:
    """'WRITE_CHUNK_KIB=512 COMB_PIECES=4' for those settings (prefix dropped); 'default' for none."""
    return " ".join(f"{k[len('JAX_MOE_A2A_'):]}={v}" for k, v in env.items()) or "default"


class with_env:
    """Sets the variables of `env` for the block (a communicator created inside reads them), then puts
    back what was there."""

    def __init__(self, env: dict):
        self.env, self.saved = env, {}

    def __enter__(self):
        self.saved = {k: os.environ.get(k) for k in self.env}
        os.environ.update(self.env)

    def __exit__(self, *exc):
        for k, v in self.saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def without_option(argv: list, name: str) -> list:
    """argv without `name VALUE` and `name=VALUE` (the children get their own value)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == name:
            skip = True
        elif not a.startswith(name + "="):
            out.append(a)
    return out


def cmdbuf_variants(arg: str) -> list:
    if arg != "auto":
        return [v for v in arg.split(",") if v]
    _, mpi_size = benchlib.mpi_world()
    cpu = os.environ.get("JAX_PLATFORMS", "").split(",")[0] == "cpu" or not shutil.which("nvidia-smi")
    return ["on", "off"] if mpi_size == 1 and not cpu else []


def current_cmdbuf(jax) -> str:
    """off, on (XLA's default command types), or on:TYPES when XLA_FLAGS names them."""
    if jax.default_backend() == "cpu":
        return "n/a"
    types = [f.split("=", 1)[1] for f in os.environ.get("XLA_FLAGS", "").split()
             if f.startswith(NO_CMDBUF)]
    if not types:
        return "on"
    return "off" if not types[-1] else f"on:{types[-1]}"


def with_cmdbuf_env(variant: str) -> dict:
    """The environment of a child for `variant`: off, or on (keeping the command types XLA_FLAGS
    names, e.g. --xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUSTOM_CALL; else XLA's default)."""
    env = dict(os.environ)
    flags = env.get("XLA_FLAGS", "").split()
    cmd = [f for f in flags if f.startswith(NO_CMDBUF)]
    flags = [f for f in flags if not f.startswith("--xla_gpu_enable_command_buffer")]
    if variant == "off":
        flags.append(NO_CMDBUF)
    elif cmd and cmd[-1] != NO_CMDBUF:
        flags.append(cmd[-1])
    env["XLA_FLAGS"] = " ".join(flags)
    return env


# --- the layer: jax_moe_a2a.models' ----------------------------------------------------------------
KINDS = ("grouped", "identity", "ragged_dot")
PLACEMENTS = {"overlap": "overlap", "after": "after", "none": None}   # --shared -> moe_block's shared_at


def weight_block(hidden: int, ffn: int) -> int:
    """The fp8 weights' square block: 128 (DeepSeek-V3's) when it divides H and F, else the largest
    power of two that does (scaled-down CPU shapes)."""
    b = 128
    while b > 1 and (hidden % b or ffn % b):
        b //= 2
    return b


def layer_config(spec, ffn: int, experts: str, shared: str):
    """The models.MoEConfig a benchmark variant runs: spec's H, E and K, F = ffn for the routed and
    the shared expert (none: shared_ffn 0), DeepSeek-V3's router (sigmoid, top-K renormalised: the
    weights sum to 1, so identity layers keep the activations' scale), and the expert kind
    (grouped: fp8 e4m3 weights with weight_block(H, F) square blocks)."""
    import jax.numpy as jnp

    from jax_moe_a2a import models
    if experts not in KINDS:
        raise ValueError(f"experts: expected one of {KINDS}, got {experts!r}")
    if shared not in PLACEMENTS:
        raise ValueError(f"shared: expected one of {tuple(PLACEMENTS)}, got {shared!r}")
    return models.MoEConfig(hidden=spec.hidden, ffn=ffn, num_experts=spec.num_experts, topk=spec.experts_per_token,
                            shared_ffn=0 if shared == "none" else ffn, score="sigmoid", experts=experts,
                            expert_dtype=jnp.float8_e4m3fn if experts == "grouped" else None,
                            weight_block=weight_block(spec.hidden, ffn), param_dtype=jnp.bfloat16)


def init_params(cfg, key, routers: int = 1) -> dict:
    """models.init_moe_params' dict for cfg (global: every expert), drawn without an f32 copy of
    the fp8 weights (DeepSeek-V3's are 11 GB): fp8 values ~ N(0, 1) drawn in bf16 and one scale per
    block, 1/sqrt(fan-in) (0.1 of it for the down projections: the layers add up). "router" is
    [routers, H, E] f32, one per layer for --routing per-layer (layer i takes router[i]); the rest
    as init_moe_params: w_gate_up [E, 2F, H] / w_down [E, H, F] fp8 with f32 scales [E, 2F/b, H/b] /
    [E, H/b, F/b] (grouped), w1 [E, H, F] / w2 [E, F, H] bf16 (ragged_dot), none (identity), and
    w1s [H, Fs] / w2s [Fs, H] bf16 when cfg.shared_ffn."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    h, f, e, b = cfg.hidden, cfg.ffn, cfg.num_experts, cfg.weight_block
    k = jax.random.split(key, 5)
    p = {"router": jax.random.normal(k[4], (routers, h, e), jnp.float32) / np.sqrt(h)}
    if cfg.shared_ffn:
        fs = cfg.shared_ffn
        p["w1s"] = (jax.random.normal(k[2], (h, fs)) / np.sqrt(h)).astype(jnp.bfloat16)
        p["w2s"] = (0.1 * jax.random.normal(k[3], (fs, h)) / np.sqrt(fs)).astype(jnp.bfloat16)
    if cfg.experts == "grouped":
        p["w_gate_up"] = jax.random.normal(k[0], (e, 2 * f, h), jnp.bfloat16).astype(jnp.float8_e4m3fn)
        p["w_down"] = jax.random.normal(k[1], (e, h, f), jnp.bfloat16).astype(jnp.float8_e4m3fn)
        p["w_gate_up_scale"] = jnp.full((e, 2 * f // b, h // b), 1 / np.sqrt(h), jnp.float32)
        p["w_down_scale"] = jnp.full((e, h // b, f // b), 0.1 / np.sqrt(f), jnp.float32)
    elif cfg.experts == "ragged_dot":
        p["w1"] = (jax.random.normal(k[0], (e, h, f)) / np.sqrt(h)).astype(jnp.bfloat16)
        p["w2"] = (jax.random.normal(k[1], (e, f, h)) / np.sqrt(f)).astype(jnp.bfloat16)
    return p


def grouped_impl(jax) -> str:
    """How expert_mlp runs the grouped experts here: "native", or "xla (why not native)"."""
    from jax_moe_a2a import experts as ex
    f8, f32 = jax.numpy.float8_e4m3fn, jax.numpy.float32
    why = ex.native_reason(jax.ShapeDtypeStruct((8, 128), f8), jax.ShapeDtypeStruct((1, 128, 128), f8),
                           jax.ShapeDtypeStruct((8, 1), f32), jax.ShapeDtypeStruct((1, 1, 1), f32))
    return "native" if why is None else f"xla ({why})"


def make_step(comm, cfg, shared: str, num_layers: int, plain: bool, routing: str = "fixed", reach: bool = False):
    """Per-rank step: x [T, H] -> x after num_layers MoE layers, each the library's layer:
    models.moe_block(comm, cfg, ..., overlap=True, shared_at=PLACEMENTS[shared], slot=i % Spec.slots)
    (the split halves), or for plain models.local_moe_block (no communication; at EP > 1 each rank
    runs its own tokens on its L local experts: ids mod L). routing "fixed": every layer takes the
    step's ids [T, K] int32 / w [T, K] f32 (moe_block(routing=...)); "per-layer": layer i routes its
    input with p["router"][i] [H, E] (moe_block's router; plain: models.route, then ids mod L) and
    adds its output to the residual stream, x_{i+1} = x_i + layer_i(norm(x_i)): without the residual
    the chained layers' outputs collapse onto a few experts (on the H200, 2026-12-04, a 4-layer
    decode step read the weights of at most ~60 of 256 experts: 642 us a layer against 2.7 ms for
    all), which a model with residual connections does not do. Every layer reads its input through
    models.rms_norm (no weights, as DeepSeek-V3's blocks do; fixed routing: x_{i+1} =
    layer_i(norm(x_i))): without it SwiGLU, quadratic in its input, grows the stream from layer to
    layer until bf16 overflows (on an H100, 2026-12-06: 10 steps of 4 grouped layers ended in
    non-finite values, and rows that are not finite route wherever top_k puts NaN). reach (plain,
    per-layer only): the step also returns, per layer, how many of the E experts the EP group's
    routed ids reach ([layers] int32 per rank, equal on every rank): what a layer reads of the
    experts' weights."""
    import dataclasses

    from jax_moe_a2a import models
    spec, n = comm.spec, comm.num_ranks
    local = spec.local_experts(n)
    place = PLACEMENTS[shared]
    plain_cfg = dataclasses.replace(cfg, num_experts=local)

    def layer(x, ids, w, num, p, i):
        if plain:
            if ids is None:
                ids, w = models.route(cfg, p["router"], x)
            return models.local_moe_block(plain_cfg, spec, p, x, num, routing=(ids % local, w), shared_at=place)
        return models.moe_block(comm, cfg, p, x, num, overlap=True, shared_at=place, slot=i % spec.slots,
                                routing=None if ids is None else (ids, w))

    if reach and not (plain and routing == "per-layer"):
        raise ValueError("make_step(reach=True) counts the plain layers' per-layer routing only")
    import jax
    import jax.numpy as jnp

    def reached(ids, num):  # distinct experts the group's valid routed ids name
        valid = (jnp.arange(ids.shape[0]) < num)[:, None].astype(jnp.int32)
        hit = jnp.zeros((cfg.num_experts,), jnp.int32).at[ids].max(jnp.broadcast_to(valid, ids.shape))
        return jax.lax.pmax(hit, comm.axis).sum()

    def step(x, ids, w, num, p):
        num = num[0]
        counts = []
        for i in range(num_layers):
            h = models.rms_norm(x)
            if routing == "per-layer":  # the residual stream, as a model has it (see the docstring)
                pi = dict(p, router=p["router"][i])
                if reach:  # routed once, counted, and given to plain's layer (which would route the same)
                    ids, w = models.route(cfg, pi["router"], h)
                    counts.append(reached(ids, num))
                x = x + layer(h, ids if reach else None, w if reach else None, num, pi, i).astype(x.dtype)
            else:
                x = layer(h, ids, w, num, p, i)
        return (x, jnp.stack(counts)[None]) if reach else x
    return step


def bench_layer(jax, comm, shape, experts, shared, args, plain, progress, units):
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    from jax_moe_a2a import models, testing
    spec, mesh, n, axis = comm.spec, comm.mesh, comm.num_ranks, comm.axis
    inputs = testing.make_inputs(spec, n, args.seed, num_tokens=spec.max_tokens_per_rank)
    for i in inputs:  # weights summing to 1: identity layers keep the activations' scale
        i.topk_weights[:] = i.topk_weights / i.topk_weights.sum(-1, keepdims=True)
    x = testing.stack_global(mesh, axis, [i.x.astype(jnp.bfloat16) for i in inputs])
    ids = testing.stack_global(mesh, axis, [i.topk_ids for i in inputs])
    w = testing.stack_global(mesh, axis, [i.topk_weights for i in inputs])
    num = testing.stack_global(mesh, axis, [np.int32(i.num_tokens) for i in inputs])
    cfg = layer_config(spec, shape.ffn, experts, shared)
    pspec = models.moe_param_specs(cfg, axis)
    routers = args.layers if args.routing == "per-layer" else 1
    params = jax.jit(lambda key: init_params(cfg, key, routers),
                     out_shardings={k: NamedSharding(mesh, v) for k, v in pspec.items()})(jax.random.key(1))
    step = make_step(comm, cfg, shared, args.layers, plain, args.routing)
    f_step = jax.jit(testing.shard_map(step, mesh=mesh, in_specs=(P(axis),) * 4 + (pspec,), out_specs=P(axis)))
    y = x
    for _ in range(2 if jax.default_backend() != "cpu" else 1):  # compile (GPUs: one more untimed call)
        y = timing.block(f_step(y, ids, w, num, params))
    progress.update(f"{comm.backend_name if not plain else 'plain'}/{shape.name}/{experts}/{shared} compile", 2 * units)
    per_layer, enqueued = [], []
    import time
    # on GPUs, the board's SM clock and power over the timed steps: layers of grouped expert GEMMs
    # run back to back can reach the power limit and a lower clock (docs/performance.md)
    board = gpu_clock.ClockLog(enabled=jax.default_backend() != "cpu")
    raw_wire = getattr(args, "raw_wire", False) and not plain and bool(comm.proxy_stats())
    stats_before = comm.proxy_stats() if raw_wire else None
    with board:
        while timing.keep_going(len(per_layer), sum(per_layer) * args.steps * args.layers, args.repeats,
                                getattr(args, "min_time_s", 0.0), 10 * args.repeats):
            timing.barrier("layers")
            y = x
            t0 = time.perf_counter()
            for _ in range(args.steps):
                last_in, y = y, f_step(y, ids, w, num, params)
            t1 = time.perf_counter()  # every step handed to the runtime (JAX dispatches asynchronously)
            timing.block(y)
            per_layer.append((time.perf_counter() - t0) / (args.steps * args.layers))
            enqueued.append((t1 - t0) / (args.steps * args.layers))
            if len(per_layer) <= args.repeats:   # the progress bar counts the minimum
                progress.update(f"{comm.backend_name if not plain else 'plain'}/{shape.name}/{experts}/{shared}", units)
    reached = None
    if plain and args.routing == "per-layer":  # how much of the experts' weights a layer reads, for
        # the input of the last timed step (the stream after steps - 1 steps of layers)
        r_step = make_step(comm, cfg, shared, args.layers, plain, args.routing, reach=True)
        f_reach = jax.jit(testing.shard_map(r_step, mesh=mesh, in_specs=(P(axis),) * 4 + (pspec,),
                                            out_specs=(P(axis), P(axis))))
        shard = f_reach(last_in, ids, w, num, params)[1].addressable_shards[0]  # [1, layers], equal on every rank
        reached = [int(c) for c in np.asarray(shard.data).reshape(-1)[:args.layers]]
    device = None
    if getattr(args, "trace", False):
        from benchlib import trace
        state = {"y": x}

        def one_step():
            state["y"] = f_step(state["y"], ids, w, num, params)
            return state["y"]
        name = (f"{'plain' if plain else comm.backend_name}-{shape.name}-{experts}-{shared}-{current_cmdbuf(jax)}"
                f"-p{jax.process_index()}").replace(":", "_").replace(",", "_").replace("/", "")
        keep = os.path.join(args.out, "traces", name) if args.out else None
        device = trace.device_profile(one_step, steps=3, per=args.layers, keep_dir=keep)
    raw = counters = None
    if raw_wire:  # the same bytes per layer as the proxies wrote them over the timed steps
        timing.barrier("raw_wire")  # every rank's outputs done: every write of the timed steps posted
        ops = len(per_layer) * args.steps * args.layers  # dispatches (and combines) timed
        stats_after = comm.proxy_stats()
        raw = raw_exchange.measure(raw_exchange.sizes_per_step(stats_before, stats_after, ops))
        # this process's proxies over the timed steps: how the rows went (pieces, staging copies)
        counters = {k: sum(stats_after[r][k] - stats_before[r][k] for r in stats_after) / ops
                    for k in ("write_pieces", "pieces_behind_copy", "pieces_copied_early", "staged_bytes", "staging_ns",
                              "staging_busy_ns", "post_ns", "post_blocked_ns", "progress_events", "progress_held_polls")}
        counters["rails"] = max(s["rails"] for s in stats_after.values())  # the engines' domains (RAILS or default)
    arr = timing.max_over_processes(per_layer, "layer") * 1e6
    # the stream after the last timed step, this process's shards: rows that are not finite route
    # wherever top_k puts NaN, so a timing over them says nothing (the finished line warns)
    finite = all(bool(np.isfinite(np.asarray(sh.data, np.float32)).all()) for sh in y.addressable_shards)
    t, k = spec.max_tokens_per_rank, spec.experts_per_token
    moved = t * k * (spec.token_bytes() + spec.hidden * 2)  # dispatch + combine payload per rank
    p50 = float(np.percentile(arr, 50))
    # host time to hand the steps over, per layer: close to per_layer_us when the host, not the
    # device, sets the pace (launch overhead of the step's thunks and FFI calls)
    host = float(np.percentile(np.asarray(enqueued) * 1e6, 50))
    return {"per_layer_us": {"p50": p50, "min": float(arr.min()), "max": float(arr.max()), "samples": arr.tolist()},
            "enqueue_us_per_layer": host, "device": device, "board": board.summary(),
            "experts_reached_per_layer": reached, "raw_exchange": raw, "proxy_per_layer": counters,
            "GBps": (moved / (p50 * 1e3)) if (p50 and not plain) else None, "finite": finite,
            "buffer_bytes_per_rank": None if plain else comm.buffer_bytes()}


def describe_counters(c: dict) -> str:
    """One line: this process's proxies per layer (dispatch + combine), summed over its ranks."""
    return (f"proxy per layer (this process, {c['rails']} rail{'s' if c['rails'] > 1 else ''}): "
            f"{c['write_pieces']:.1f} extra PRIV/OVER pieces, "
            f"{c['pieces_behind_copy']:.1f} posted behind a copy, {c['pieces_copied_early']:.1f} landed copies "
            f"before the rest of their write, {c['staged_bytes'] / 1e6:.2f} MB staged "
            f"in {c['staging_ns'] / 1e3:.1f} µs of copies ({c['staging_busy_ns'] / 1e3:.1f} µs with any in flight), "
            f"{c['post_ns'] / 1e3:.1f} µs in posts "
            f"({c['post_blocked_ns'] / 1e3:.1f} on a full queue), {c['progress_events']:.1f} completions on the "
            f"progress thread ({c['progress_held_polls']:.0f} polls held)")


def run(jax, args, progress_label=""):
    from jax_moe_a2a import testing

    lead = jax.process_index() == 0
    platform = jax.default_backend()
    gpu = platform != "cpu"
    table = shapes.pick(platform, args.quick)
    names = [s for s in args.shape.split(",") if s]
    for s in names:
        if s not in table:
            raise SystemExit(f"--shape: unknown shape {s!r} (known: {sorted(table)})")
    chosen = {s: shapes.with_overrides(table[s], args.tokens, args.hidden, args.ffn) for s in names}
    args.layers = args.layers or (1 if args.quick else (4 if gpu else 2))
    args.steps = args.steps or (10 if gpu and not args.quick else 1)
    args.repeats = args.repeats or (1 if args.quick else (7 if gpu else 5))
    args.min_time_s = timing.resolve_min_time(args, gpu)
    backends, skipped = benchlib.backend_plan(args.backend)
    kinds = [k for k in (args.experts or ("grouped,ragged_dot,identity" if gpu else "grouped,identity")).split(",") if k]
    for k in kinds:
        if k not in KINDS:
            raise SystemExit(f"--experts: unknown kind {k!r} (known: {', '.join(KINDS)})")
    placements = [s for s in args.shared.split(",") if s]
    mesh = testing.make_mesh(args.ranks)
    cmdbuf = current_cmdbuf(jax)
    meta = benchlib.run_meta(jax, layers=args.layers, steps=args.steps, repeats=args.repeats, ranks=mesh.size,
                             min_time_s=args.min_time_s,
                             cmdbuf=cmdbuf, proxied=bool(args.proxied))
    if args.proxied and "host" not in backends:
        raise SystemExit("--proxied: the host backend's option (a2a.init(proxied=True)); --backend has no host")
    runs = backends + ([] if args.no_plain else ["plain"])
    if lead:
        print(f"layer benchmark: {runs}, shapes {names}, experts {kinds}, shared expert {placements}, "
              f"{mesh.size} ranks on {meta['devices']} {platform} device(s) in {meta['processes']} process(es), "
              f"command buffers {cmdbuf}, dispatch dtype {args.dispatch_dtype}, routing {args.routing}; the layers: "
              f"jax_moe_a2a.models.moe_block (plain: models.local_moe_block)", flush=True)
        for b, why in skipped.items():
            print(f"  skipped {b}: {why}", flush=True)
        if args.experts is None and not gpu:
            print("  ragged_dot experts skipped on CPUs (XLA:CPU computes every row against every local expert: "
                  "minutes per layer); --experts grouped,identity,ragged_dot runs them", flush=True)
        if "grouped" in kinds:
            print(f"  grouped experts: {grouped_impl(jax)}", flush=True)
    per = {s: chosen[s].units() * args.steps * args.layers / 4 for s in names}
    variants = [v for _ in range(args.rounds) for v in args.env_variants]
    many = len(variants) > 1
    progress = Progress(len(variants) * len(runs) * len(kinds) * len(placements)
                        * sum(per[s] * (args.repeats + 2) for s in names), lead, label=progress_label)
    results = []
    wire = {"fp8": {}, "fp8-recv-bf16": {"recv_dtype": jax.numpy.bfloat16},
            "bf16": {"dispatch_dtype": jax.numpy.bfloat16}}[args.dispatch_dtype]
    plan = Plan(runs, names, chosen, kinds, placements, wire, mesh, cmdbuf, per, progress, lead)
    for i, env in enumerate(variants):
        with with_env(env):
            results += run_variant(jax, args, plan,
                                   {"env": variant_label(env), "round": i // len(args.env_variants)} if many else {})
    progress.close()
    return {"meta": meta, "results": results, "skipped": skipped}


@dataclasses.dataclass
class Plan:
    """What run() decided once for every variant: the backends (and plain), shapes by name, expert
    kinds, shared placements, the dispatch wire's Spec fields, the mesh, the command-buffer setting,
    timing units per shape, the progress bar and whether this process reports."""
    runs: list
    names: list
    chosen: dict
    kinds: list
    placements: list
    wire: dict
    mesh: object
    cmdbuf: str
    per: dict
    progress: object
    lead: bool


def run_variant(jax, args, plan: Plan, tag: dict) -> list:
    """Every backend x shape x expert kind x shared placement of `plan` under the environment as it
    is now (a communicator each: the library reads its settings at creation); `tag` (the settings'
    variant and round, or nothing) goes into every result and progress line."""
    import jax_moe_a2a as a2a

    runs, names, chosen, kinds, placements = plan.runs, plan.names, plan.chosen, plan.kinds, plan.placements
    wire, mesh, cmdbuf, per, progress, lead = plan.wire, plan.mesh, plan.cmdbuf, plan.per, plan.progress, plan.lead
    results = []
    label = f"[{tag['env']}, round {tag['round'] + 1}] " if tag else ""
    for b in runs:
        for s in names:
            shape = chosen[s]
            comm = None
            try:
                # plain: the reference backend's communicator only supplies the spec and mesh
                opts = {}
                if args.proxied and b == "host":  # node_size read here: --env-variants may set it per variant
                    from jax_moe_a2a import env
                    opts = {"proxied": True, "node_size": env.get_int("NODE_SIZE", 0)}
                comm = a2a.init(shape.spec(**wire), mesh, "ep", backend="reference" if b == "plain" else b,
                                collect_stats=False, **opts)
            except Exception as e:
                results.append({**tag, "backend": b, "shape": s, "experts": "", "overlap": False, "cmdbuf": cmdbuf,
                                "error": f"{type(e).__name__}: {e}"})
                progress.update(f"{b}/{s} failed", len(kinds) * len(placements) * per[s] * (args.repeats + 2))
                continue
            for kind in kinds:
                for place in placements:
                    rec = {**tag, "backend": b, "shape": s, "experts": kind, "overlap": place == "overlap",
                           "shared": place != "none", "placement": place,
                           "cmdbuf": cmdbuf, "dispatch_dtype": args.dispatch_dtype, "routing": args.routing, "ranks": mesh.size, "layers": args.layers, "steps": args.steps,
                           "repeats": args.repeats, "ffn": shape.ffn, "scaled": shape.scaled,
                           "spec": {"T": shape.tokens, "H": shape.hidden, "E": shape.experts, "K": shape.topk}}
                    rec["layer"] = "models.local_moe_block" if b == "plain" else "models.moe_block"
                    if b != "plain":  # the communicator's proxy threads (host --proxied, cuda's inter-node path)
                        rec["proxy_threads"] = len(comm.proxy_stats())
                    if kind == "grouped":
                        rec["expert_impl"] = grouped_impl(jax)
                    try:
                        rec.update(bench_layer(jax, comm, shape, kind, place, args, b == "plain", progress, per[s]))
                        rec["repeats"] = len(rec["per_layer_us"]["samples"])   # --min-time may add some
                    except Exception as e:
                        rec["error"] = f"{type(e).__name__}: {e}"
                        if lead:
                            traceback.print_exc()
                    results.append(rec)
                    if lead:
                        us = rec.get("per_layer_us", {}).get("p50")
                        progress.write(f"finished {label}{b}/{s}/{kind}/{place}: "
                                       + (f"{us:.1f} µs/layer" if us else rec.get("error", ""))
                                       + (f"; {gpu_clock.describe(rec['board'])}" if rec.get("board") else "")
                                       + (f"; {raw_exchange.describe(rec['raw_exchange'])}"
                                          if rec.get("raw_exchange") else "")
                                       + (f"; {describe_counters(rec['proxy_per_layer'])}"
                                          if rec.get("proxy_per_layer") else "")
                                       + ("; WARNING: the layers' output is not finite, the timing is not a "
                                          "model's" if rec.get("finite") is False else "")
                                       + (f"; the routing reaches {rec['experts_reached_per_layer']} of "
                                          f"{shape.experts} experts per layer" if rec.get("experts_reached_per_layer")
                                          else ""))
            comm.close()
    return results


def run_children(argv, variants, out_dir, extra_env=None):
    """One child process per command-buffer setting; returns their merged results."""
    merged = None
    for i, v in enumerate(variants):
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "part.json")
            cmd = [sys.executable, os.path.abspath(__file__), *argv, "--cmdbuf", v, "--json-out", path,
                   "--progress-label", f"[cmdbuf {v}, {i + 1}/{len(variants)}] "]
            env = with_cmdbuf_env(v)
            env.update(extra_env or {})
            rc = subprocess.run(cmd, env=env).returncode
            if not os.path.exists(path):
                raise SystemExit(f"layers: the child for command buffers {v} failed (exit {rc})")
            with open(path) as f:
                part = json.load(f)
        if merged is None:
            merged = part
            merged["meta"]["cmdbuf"] = variants
        else:
            merged["results"] += part["results"]
    return merged


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    variants = cmdbuf_variants(args.cmdbuf)
    if args.json_out is None and len(variants) > 1:
        out = run_children(without_option(argv, "--cmdbuf"), variants, args.out)
        lead = True
    else:
        if variants and args.json_out is None:  # one setting asked for: apply it before JAX starts
            os.environ["XLA_FLAGS"] = with_cmdbuf_env(variants[0])["XLA_FLAGS"]
        jax = benchlib.setup_runtime(args.cpu_devices)
        out = run(jax, args, args.progress_label)
        lead = jax.process_index() == 0
        if args.json_out:
            if lead:
                with open(args.json_out, "w") as f:
                    json.dump(out, f)
            return 0
    if lead:
        report.write_and_show(out, args.out, "layers.json", report.print_layers, report.plot_layers, args.no_plot)
    return 1 if any("error" in r for r in out["results"]) else 0


if __name__ == "__main__":
    sys.exit(main())
