"""The benchmark programs of benchmarks/ at a tiny size (one iteration), so that CI runs them.
Nothing here asserts a speed."""

import json
import os
import time
import sys

import pytest

BENCH_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, BENCH_DIR)

import jax  # noqa: E402

import jax_moe_a2a as a2a  # noqa: E402
from conftest import subprocess_env

pytestmark = pytest.mark.skipif(jax.process_count() > 1, reason="one process")


def _backends():
    return ",".join(b for b in ("host", "reference") if b in a2a.available_backends())


def test_halves_tiny(tmp_path, capsys):
    import halves
    from benchlib import report
    args = halves.parse_args(["--quick", "--shape", "decode", "--backend", _backends() + ",cuda", "--iters", "1",
                              "--warmup", "0", "--out", str(tmp_path)])
    out = halves.run(jax, args)
    assert not halves.failed(out), out["results"]
    assert "cuda" in out["skipped"] and out["skipped"]["cuda"]  # skipped, with the reason
    assert {r["backend"] for r in out["results"]} == set(_backends().split(","))
    report.print_halves(out)
    assert report.plot_halves(out, str(tmp_path))
    text = capsys.readouterr().out
    assert "fastest at decode" in text and "skipped cuda" in text and "scaled down" in text


def test_layers_tiny(tmp_path, capsys):
    import layers
    from benchlib import report
    args = layers.parse_args(["--quick", "--shape", "decode", "--backend", _backends(), "--experts", "identity",
                              "--shared", "overlap,after,none", "--out", str(tmp_path)])
    out = layers.run(jax, args)
    rows = out["results"]
    assert not [r for r in rows if "error" in r], rows
    assert {r["backend"] for r in rows} == set(_backends().split(",")) | {"plain"}
    assert {r["placement"] for r in rows} == {"overlap", "after", "none"}
    assert all(r["per_layer_us"]["p50"] > 0 and r["finite"] for r in rows)
    # the real experts once (ragged_dot is slow on XLA:CPU)
    args = layers.parse_args(["--quick", "--shape", "decode", "--backend", "reference", "--experts", "ragged_dot",
                              "--shared", "after", "--out", str(tmp_path)])
    more = layers.run(jax, args)["results"]
    assert not [r for r in more if "error" in r], more
    out["results"] += more
    report.print_layers(out)
    assert report.plot_layers(out, str(tmp_path))
    text = capsys.readouterr().out
    assert "fastest MoE layer at decode, identity experts" in text
    assert "NOT FINITE" not in text.split("vs ref:")[0] and "WARNING" not in text
    # a row whose output was not finite is marked in the table and its headline warns
    bad = next(r for r in out["results"] if r["backend"] != "plain" and r["experts"] == "identity")
    bad["finite"] = False
    report.print_layers(out)
    text = capsys.readouterr().out
    assert "  NOT FINITE" in text.split("vs ref:")[0], text
    assert "identity experts" in text and "WARNING: a layer's output was not finite" in text, text


def test_layers_grouped_experts(tmp_path, capsys):
    """--experts grouped: router -> dispatch -> fp8 SwiGLU experts (expert_mlp) -> combine, several
    layers in one jit, on each CPU backend and plain; the headline line comes first."""
    import layers
    from benchlib import report
    args = layers.parse_args(["--quick", "--shape", "decode", "--backend", _backends(), "--experts", "grouped",
                              "--shared", "none", "--layers", "2", "--routing", "per-layer", "--out", str(tmp_path)])
    out = layers.run(jax, args)
    rows = out["results"]
    assert not [r for r in rows if "error" in r], rows
    assert {r["backend"] for r in rows} == set(_backends().split(",")) | {"plain"}
    assert all(r["finite"] and r["per_layer_us"]["p50"] > 0 and r["expert_impl"].startswith("xla") for r in rows)
    assert layers.weight_block(256, 64) == 64 and layers.weight_block(7168, 2048) == 128
    report.print_layers(out)
    assert "fastest MoE layer at decode, grouped experts" in capsys.readouterr().out


def test_layers_per_layer_routing(tmp_path):
    """--routing per-layer: every layer routes its own input (both the backend's layer and plain's)."""
    import layers
    args = layers.parse_args(["--quick", "--shape", "decode", "--backend", "reference", "--experts", "identity",
                              "--shared", "none", "--routing", "per-layer", "--layers", "2", "--out", str(tmp_path)])
    rows = layers.run(jax, args)["results"]
    assert not [r for r in rows if "error" in r], rows
    assert {r["backend"] for r in rows} == {"reference", "plain"}
    assert all(r["routing"] == "per-layer" and r["finite"] and r["per_layer_us"]["p50"] > 0 for r in rows)
    assert {r["layer"] for r in rows} == {"models.moe_block", "models.local_moe_block"}
    reach = {r["backend"]: r["experts_reached_per_layer"] for r in rows}
    assert reach["reference"] is None and len(reach["plain"]) == 2, reach  # plain's routing, per layer
    assert all(1 <= c <= rows[0]["spec"]["E"] for c in reach["plain"]), reach

def test_layers_env_variants_run_interleaved(tmp_path, monkeypatch):
    """--env-variants / --rounds: each variant's settings are in the environment while its
    communicator is created and gone after (the library reads them at creation), the variants run
    in interleaved rounds, every result names its variant and round; only JAX_MOE_A2A_* names are
    accepted (XLA's and JAX's are read when the process starts)."""
    import layers
    assert layers.parse_env_variants("") == [{}]
    assert layers.parse_env_variants("default; JAX_MOE_A2A_COMB_PIECES=4 JAX_MOE_A2A_WRITE_CHUNK_KIB=512") == \
        [{}, {"JAX_MOE_A2A_COMB_PIECES": "4", "JAX_MOE_A2A_WRITE_CHUNK_KIB": "512"}]
    for bad in ("XLA_FLAGS=--x", "JAX_MOE_A2A_COMB_PIECES", "default;COMB_PIECES=4"):
        with pytest.raises(SystemExit, match="env-variants"):
            layers.parse_env_variants(bad)
    monkeypatch.delenv("JAX_MOE_A2A_COMB_PIECES", raising=False)
    seen = []  # the setting each communicator was created under
    real = a2a.init

    def spy(*a, **kw):
        seen.append(os.environ.get("JAX_MOE_A2A_COMB_PIECES"))
        return real(*a, **kw)

    monkeypatch.setattr(a2a, "init", spy)
    args = layers.parse_args(["--quick", "--shape", "decode", "--backend", "reference", "--experts", "identity",
                              "--shared", "none", "--no-plain", "--out", str(tmp_path), "--rounds", "2",
                              "--env-variants", "default;JAX_MOE_A2A_COMB_PIECES=7"])
    rows = layers.run(jax, args)["results"]
    assert seen == [None, "7", None, "7"] and "JAX_MOE_A2A_COMB_PIECES" not in os.environ
    assert [(r["env"], r["round"]) for r in rows] == \
        [("default", 0), ("COMB_PIECES=7", 0), ("default", 1), ("COMB_PIECES=7", 1)]
    assert not [r for r in rows if "error" in r], rows


@pytest.mark.parametrize("experts", ["grouped", "identity", "ragged_dot"])
@pytest.mark.parametrize("shared", ["overlap", "none"])
def test_layers_params_are_the_librarys(experts, shared):
    """The benchmark's weights (drawn without an f32 copy) have exactly the names, shapes and dtypes of
    models.init_moe_params for the MoEConfig it runs (the router stacked one per layer), so that
    models.moe_block reads them as a user's."""
    import jax.numpy as jnp
    import layers
    from benchlib import shapes
    from jax_moe_a2a import models
    shape = shapes.QUICK["decode"]
    spec = shape.spec()
    cfg = layers.layer_config(spec, shape.ffn, experts, shared)
    assert (cfg.experts, cfg.shared_ffn, cfg.score) == (experts, 0 if shared == "none" else shape.ffn, "sigmoid")
    assert (cfg.expert_dtype is not None) == (experts == "grouped") and cfg.weight_block == 64
    mine = jax.eval_shape(lambda k: layers.init_params(cfg, k, routers=3), jax.random.key(0))
    want = jax.eval_shape(lambda k: models.init_moe_params(k, cfg), jax.random.key(0))
    assert mine.pop("router").shape == (3,) + want.pop("router").shape
    assert {k: (v.shape, jnp.dtype(v.dtype)) for k, v in mine.items()} == \
        {k: (v.shape, jnp.dtype(v.dtype)) for k, v in want.items()}
    with pytest.raises(ValueError, match="shared"):
        layers.layer_config(spec, shape.ffn, experts, "before")


def test_layers_step_is_moe_block():
    """make_step's layers are models.moe_block's (and plain's models.local_moe_block's): the
    benchmark's one-layer step on the reference backend equals dense_moe_block of each rank's
    tokens, and the plain step at EP = 1 (8 experts, one device) too, for fixed and per-layer routing."""
    import dataclasses
    import numpy as np
    import jax.numpy as jnp
    import layers
    from jax.sharding import PartitionSpec as P
    from jax_moe_a2a import models, testing
    from benchlib import shapes
    shape = dataclasses.replace(shapes.QUICK["decode"], experts=16, tokens=8, hidden=128, ffn=64)
    spec = shape.spec()
    mesh = testing.make_mesh()
    n = mesh.size
    comm = a2a.init(spec, mesh, "ep", backend="reference", collect_stats=False)
    cfg = layers.layer_config(spec, shape.ffn, "grouped", "after")
    seed = testing.fresh_seed()
    params = layers.init_params(cfg, jax.random.key(seed), routers=1)
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((n * 8, 128)), jnp.bfloat16)
    ids = jnp.asarray(np.argsort(rng.random((n * 8, 16)), axis=1)[:, :8], jnp.int32)
    w = jnp.asarray(rng.uniform(0.1, 1, (n * 8, 8)), jnp.float32)
    num = jnp.full((n,), 6, jnp.int32)
    specs = models.moe_param_specs(cfg)
    p1 = dict(params, router=params["router"][0])
    for routing in ("fixed", "per-layer"):
        step = layers.make_step(comm, cfg, "after", 1, False, routing)
        f = jax.jit(testing.shard_map(step, mesh=mesh, in_specs=(P("ep"),) * 4 + (specs,), out_specs=P("ep")))
        got = np.asarray(f(x, ids, w, num, params), np.float32)
        for r in range(n):
            rows = slice(r * 8, r * 8 + 8)
            given = None if routing == "per-layer" else (ids[rows], w[rows])
            h = models.rms_norm(x[rows])    # every layer reads its input through the RMS norm
            want = np.asarray(models.dense_moe_block(cfg, spec, p1, h, 6, routing=given), np.float32)
            if routing == "per-layer":  # per-layer routing adds the layer to the residual stream
                want = want + np.asarray(x[rows], np.float32)
            np.testing.assert_allclose(got[rows], want, rtol=2e-2, atol=2e-2 * np.abs(want).max(),
                                       err_msg=f"seed {seed} {routing}, rank {r}")
    one = testing.make_mesh(1)
    plain = layers.make_step(a2a.init(spec, one, "ep", backend="reference", collect_stats=False), cfg, "after", 1,
                             True, "per-layer")
    got = np.asarray(jax.jit(plain)(x[:8], ids[:8], w[:8], num[:1], params), np.float32)
    bf16 = dataclasses.replace(spec, dispatch_dtype=jnp.bfloat16)   # plain XLA moves bf16 rows
    want = (np.asarray(models.dense_moe_block(cfg, bf16, p1, models.rms_norm(x[:8]), 6), np.float32)
            + np.asarray(x[:8], np.float32))
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2 * np.abs(want).max(), err_msg=f"seed {seed} plain")
    # reach=True: the plain per-layer step also counts the experts the EP group's valid ids name,
    # per layer (layer 0 routes x itself: NumPy's count of models.route's ids of every rank's
    # first 6 tokens); EP = n over the mesh, the same count on every rank
    reach = layers.make_step(comm, cfg, "after", 2, True, "per-layer", reach=True)
    params2 = layers.init_params(cfg, jax.random.key(seed), routers=2)
    f = jax.jit(testing.shard_map(reach, mesh=mesh, in_specs=(P("ep"),) * 4 + (specs,), out_specs=(P("ep"), P("ep"))))
    y_reach, counts = f(x, ids, w, num, params2)
    counts = np.asarray(counts)
    g = jax.jit(testing.shard_map(layers.make_step(comm, cfg, "after", 2, True, "per-layer"), mesh=mesh,
                                  in_specs=(P("ep"),) * 4 + (specs,), out_specs=P("ep")))
    np.testing.assert_array_equal(np.asarray(y_reach, np.float32), np.asarray(g(x, ids, w, num, params2), np.float32),
                                  err_msg="counting must not change the layers")
    routed = [np.asarray(models.route(cfg, params2["router"][0], models.rms_norm(x[r * 8:r * 8 + 8]))[0])[:6]
              for r in range(n)]
    assert counts.shape == (n, 2) and (counts == counts[0]).all(), counts
    assert counts[0, 0] == len(np.unique(np.concatenate(routed))), (counts, seed)
    assert 1 <= counts[0, 1] <= 16
    with pytest.raises(ValueError, match="reach"):
        layers.make_step(comm, cfg, "after", 1, False, "per-layer", reach=True)


def test_trace_summary_counts_overlaps_once_and_gaps():
    from benchlib import trace
    # two steps, per=2: kernels a [0,10) and b [5,20) overlap (busy 20), then c [30,40) after a gap
    ev = [(0, 10_000, "a"), (5_000, 20_000, "b"), (30_000, 40_000, "c"), (50_000, 60_000, "a")]
    s = trace.summarize_events(ev, steps=2, per=2)
    assert s["busy_us"] == pytest.approx((20 + 10 + 10) / 4)
    assert s["span_us"] == pytest.approx(60 / 4)
    assert s["gap_us"] == pytest.approx(s["span_us"] - s["busy_us"])
    assert [k["name"] for k in s["kernels"]] == ["a", "b", "c"]  # by total time: a 20, b 15, c 10
    assert s["kernels"][0]["calls_per_step"] == 1 and s["kernels"][0]["us"] == pytest.approx(20 / 4)
    # the idle time falls before c (10 us after b's end) and before the second a (10 us after c)
    idle = {k["name"]: k["idle_before_us"] for k in s["kernels"]}
    assert idle == pytest.approx({"a": 10 / 4, "b": 0.0, "c": 10 / 4})
    assert sum(idle.values()) == pytest.approx(s["gap_us"])
    assert trace.summarize_events([], 1)["busy_us"] is None


def test_layers_trace_on_cpu_says_why(tmp_path):
    import layers
    args = layers.parse_args(["--quick", "--shape", "decode", "--backend", "reference", "--experts", "identity",
                              "--shared", "none", "--no-plain", "--trace", "--out", str(tmp_path)])
    rows = layers.run(jax, args)["results"]
    assert rows and all(r["device"]["busy_us"] is None and "no GPU" in r["device"]["why"] for r in rows), rows


def test_anchor_merge(tmp_path, capsys):
    """pplx_N.json of the anchor kit -> pplx rows and ours/pplx ratios in the halves table."""
    from benchlib import anchor, report
    stats = lambda p50: {"pe0": {"mean_us": p50, "stddev_us": 0.5, "p50_us": p50, "p99_us": p50 + 1, "min_us": p50,
                                 "max_us": p50 + 2, "n": 10}}
    res = [{"kernel": k, "num_pes": 2, "tokens_per_rank": 128, "m_mode": m, "num_experts": 256, "topk": 8,
            "hidden": 7168, "check": "ok", **{h: stats(v) for h, v in zip(anchor.KEYS, (12.5, 16.6, 25.0, 14.0))}}
           for k, m in (("inter", "fixed"), ("intra-sync", "fixed"), ("inter", "pplx"))]
    (tmp_path / "pplx_2.json").write_text(json.dumps({"pplx_commit": "12cecfd", "results": res}))
    a = anchor.load(str(tmp_path), 2)
    assert [r["kernel"] for r in a["rows"]] == ["inter", "intra-sync"]
    spec = {"T": 128, "H": 7168, "E": 256, "K": 8}
    assert anchor.best_row(a, "cuda", spec)["kernel"] == "intra-sync"
    assert anchor.best_row(a, "nvshmem", spec)["kernel"] == "inter"
    assert anchor.best_row(a, "reference", spec) is None
    assert anchor.load(str(tmp_path), 4)["error"]
    t = {h: {"p50_us": 100.0, "p99_us": 120.0} for h in ("dispatch_send", "dispatch_recv", "combine_send",
                                                         "combine_recv", "dispatch", "combine")}
    row = {"backend": "cuda", "shape": "decode", "ranks": 2, "processes": 2, "check": "ok", "spec": spec,
           "timings": t, "kernel_timings": {h: {"p50_us": 25.0, "p99_us": 30.0} for h in anchor.KEYS},
           "buffer_bytes_per_rank": 1 << 20, "anchor_row": anchor.best_row(a, "cuda", spec)}
    report.print_halves({"meta": {}, "results": [row], "anchor": a})
    text = capsys.readouterr().out
    assert "pplx intra-sync" in text and "2.00x" in text  # 25 µs kernel / 12.5 µs pplx


def test_layers_children_get_their_own_cmdbuf():
    """The parent's --cmdbuf (both spellings) is dropped before a child gets `--cmdbuf on|off`
    (a child once got the parent's value too and refused it: 'unrecognized arguments: on,off')."""
    import layers
    assert layers.without_option(["--backend", "cuda", "--cmdbuf", "on,off", "--layers", "8"], "--cmdbuf") == \
        ["--backend", "cuda", "--layers", "8"]
    assert layers.without_option(["--cmdbuf=on,off", "--quick"], "--cmdbuf") == ["--quick"]


def in_threads(n, fn, timeout_s=60.0):
    """{r: fn(r)} for r in range(n), each in its own thread (the timing loops release the GIL and
    wait for each other); fails naming the ranks whose call raised or did not return in time."""
    import threading
    out, errors = {}, []

    def one(r):
        try:
            out[r] = fn(r)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append((r, exc))

    threads = [threading.Thread(target=one, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    assert not errors, errors
    assert len(out) == n, f"ranks {sorted(set(range(n)) - set(out))} did not return within {timeout_s} s"
    return out


def test_engine_timing_loops_take_the_library_engines():
    """benchmarks/engine.py's C++ loops live in their own module (jax_moe_a2a_bench, cc/bench) and
    take the engines, regions and groups jax_moe_a2a._C.transfer makes (nanobind shares the types
    between the two modules): every loop once between two in-process engines, a thread per rank,
    and a timeout from the loop arrives as the library's TransferTimeoutError."""
    import numpy as np

    import jax_moe_a2a_bench as loops
    from jax_moe_a2a import _ffi
    if not _ffi.require_native().built_with_libfabric():
        pytest.skip("built without libfabric: no TransferEngine")
    transfer = _ffi.require_native().transfer
    engines = transfer.local_engines(2)
    for e in engines:
        e.add_peers([(r, engines[r].address()) for r in range(2)])
    bufs = [np.zeros(2 * 64, np.uint8) for _ in range(2)]
    regions = [e.register_array(b) for e, b in zip(engines, bufs)]
    descs = [r.descriptor() for r in regions]
    imm = lambda tag: transfer.pack_imm(tag, 0, 0)

    def rank_main(r):
        e = engines[r]
        dsts = [e.remote(d) for d in descs]
        g = e.peer_group([0, 1])
        return (loops.pingpong(e, 1 - r, regions[r], dsts[1 - r], 64, 5, 1, r == 0, imm(20), 10.0),
                loops.stream(e, 1 - r, regions[r], dsts[1 - r], 64, 4, r == 0, imm(22), imm(23), 10.0),
                loops.scatter(e, g, regions[r], dsts, 64, r, 3, 1, imm(24), 10.0),
                loops.barrier(e, g, 3, 1, imm(25), 10.0))

    seconds = in_threads(2, rank_main)
    assert all(s > 0 for s in seconds[0]) and seconds[1][1] == 0  # the stream's receiver reports 0
    with pytest.raises(transfer.TransferTimeoutError):  # rank 1 never answers
        loops.pingpong(engines[0], 1, regions[0], engines[0].remote(descs[1]), 8, 1, 0, True, imm(26), 0.2)
    for e in engines:
        e.close()


def test_raw_exchange_between_threads_and_its_timeout():
    """jax_moe_a2a_bench.RawExchange (cc/bench/raw_exchange.h): three raw endpoints in one process
    (shm), a thread per rank, every rank writing every other rank at once: the bytes land in the
    sender's block of each receiver's buffer (not checked: a timing loop), every run returns its
    seconds, runs of other sizes (zero bytes to one peer included) follow one another; two ranks
    whose third peer never writes both time out instead of hanging or returning with one message;
    bad arguments are refused."""
    import jax_moe_a2a_bench as loops
    from jax_moe_a2a import _ffi
    if not _ffi.require_native().built_with_libfabric():
        pytest.skip("built without libfabric")
    transfer = _ffi.require_native().transfer
    ex = [loops.RawExchange("shm", "", 1 << 16, 3, r) for r in range(3)]
    blobs = [e.blob() for e in ex]
    for e in ex:
        e.connect(blobs)
    seconds = in_threads(3, lambda r: [ex[r].run([4096, 4096, 4096], 20, 20.0), ex[r].run([0, 1 << 16, 100], 5, 20.0)])
    assert all(x > 0 for r in range(3) for x in seconds[r]), seconds
    # Ranks 0 and 1 exchange, rank 2 never writes: each of the two got one of its two messages and
    # must time out (an exchange waits for every peer, not for any one).
    timeouts = in_threads(2, lambda r: pytest.raises(transfer.TransferTimeoutError, ex[r].run, [8, 8, 8], 1, 0.5))
    assert all("did not come" in str(t.value) for t in timeouts.values()), timeouts
    with pytest.raises(ValueError):
        ex[0].run([1 << 17, 8, 8], 1, 1.0)  # past max_size
    with pytest.raises(ValueError):
        ex[0].run([8, 8], 1, 1.0)  # one size per rank
    with pytest.raises(ValueError):
        loops.RawExchange("shm", "", 64, 2, 2)  # rank outside the world


def test_raw_exchange_sizes_from_proxy_stats():
    """benchlib.raw_exchange.sizes_per_step: two proxy_stats snapshots and the steps between them ->
    the bytes one step wrote each peer (the average), the rank itself left out; no steps, no sizes;
    describe() names each op and the sum."""
    from benchlib import raw_exchange
    before = {0: {"row_bytes_to": [5, 100, 0], "comb_bytes_to": [0, 7, 7]},
              1: {"row_bytes_to": [0, 0, 0], "comb_bytes_to": [0, 0, 0]}}
    after = {0: {"row_bytes_to": [45, 500, 800], "comb_bytes_to": [0, 7, 15]},
             1: {"row_bytes_to": [400, 40, 4], "comb_bytes_to": [8, 0, 12]}}
    assert raw_exchange.sizes_per_step(before, after, 4) == {
        0: {"dispatch": [0, 100, 200], "combine": [0, 0, 2]}, 1: {"dispatch": [100, 0, 1], "combine": [2, 0, 3]}}
    assert raw_exchange.sizes_per_step(before, after, 0) == {}
    line = raw_exchange.describe({"dispatch": {"p50_us": 10.0, "min_us": 9.0, "max_us": 12.0, "bytes_max": 2_000_000},
                                  "combine": {"p50_us": 20.0, "min_us": 19.0, "max_us": 25.0, "bytes_max": 4_000_000}})
    assert "dispatch 10.0 [9.0, 12.0] µs (2.00 MB)" in line and "sum 30.0 µs" in line
    assert "none" in raw_exchange.describe(None)


# ---- benchmarks/proxy.py: the proxy path's breakdown (benchlib/proxy_breakdown.py) ------------

def test_proxy_breakdown_bytes_on_the_wire():
    """Routed rows -> [N, N] rows, the pairs that go through the engine, and the busiest rank's
    bytes per half (dispatch: the routing, combine: its transpose) on a 4-rank, 2-node routing."""
    import jax.numpy as jnp
    import numpy as np

    from benchlib import proxy_breakdown as pb
    # DeepSeek-V3 decode's row: 7168 fp8 values, 56 f32 scales, token + weight -> 7408 bytes
    assert pb.dispatch_row_bytes(7168 + 4 * 56) == 7408 and pb.dispatch_row_bytes(20) == 32
    spec = a2a.Spec(num_experts=8, experts_per_token=2, hidden=7168, max_tokens_per_rank=4,
                    dispatch_dtype=jnp.float8_e4m3fn)
    assert pb.dispatch_row_bytes(spec.token_bytes()) == 7408  # DeepSeek's row: 7168 fp8 + 56 scales
    dests = [np.array([0, 1, 2, 2, 3]), np.array([2, 2, 2, 3, 3, 3, 3]), np.array([], int), np.array([0, 1, 3])]
    rows = pb.rows_between(dests, 4)
    assert rows.tolist() == [[1, 1, 2, 1], [0, 0, 3, 4], [0, 0, 0, 0], [1, 1, 0, 1]]
    remote = pb.remote_pairs(4, 2)  # ranks 0, 1 on one node, 2, 3 on the other
    assert remote.tolist() == [[False, False, True, True], [False, False, True, True],
                               [True, True, False, False], [True, True, False, False]]
    assert pb.remote_pairs(2, 0).all()  # node_size 0 (host backend): every pair, self included
    d = pb.half_bytes(rows, remote, 100)  # rank 1 sends 3 + 4 remote rows, to 2 peers
    assert d == {"bytes": 700, "rank": 1, "peers": 2, "rows": 7, "block": 350.0}
    c = pb.half_bytes(rows.T, remote.T, 10)  # expert rank 2 returns 2 + 3 rows, rank 3 1 + 4 + 0
    assert c["bytes"] == 50 and c["rank"] == 2 and c["rows"] == 5 and c["block"] == 25.0
    assert pb.half_bytes(np.ones((2, 2), np.int64), pb.remote_pairs(2, 2), 8)["bytes"] == 0  # one node


def test_proxy_breakdown_engine_figures_and_wire_time():
    """The engine benchmark's points nearest one row (latency) and one peer's block (bandwidth), on
    a log scale, and wire = latency + bytes / bandwidth (MB/s = bytes per µs)."""
    from benchlib import proxy_breakdown as pb
    lat = [{"size": s, "half_rtt_us": u, **({"raw_half_rtt_us": u / 2} if s <= 4096 else {})}
           for s, u in ((8, 1.0), (512, 1.5), (4096, 2.0), (65536, 10.0), (4 << 20, 500.0))]
    bw = [{"size": s, "MBps": m} for s, m in ((4096, 1000.0), (1 << 20, 8000.0), (4 << 20, 10000.0))]
    assert pb.nearest(lat, 7408)["size"] == 4096       # log distance 0.59 against 2.18 to 64 KiB
    assert pb.nearest(lat, 40000)["size"] == 65536
    assert pb.nearest(lat, 64)["size"] == 8            # equal log distance to 8 and 512: the smaller
    assert pb.nearest([], 10) is None
    fig = pb.engine_figures({"provider": "shm", "latency": lat, "bandwidth": bw}, 7408, 3.5e6)
    assert fig == {"provider": "shm", "latency_us": 2.0, "latency_size": 4096, "raw_latency_us": 1.0,
                   "bandwidth_MBps": 10000.0, "bandwidth_size": 4 << 20}
    assert pb.engine_figures({"latency": [], "bandwidth": bw}, 10, 10)["latency_us"] is None
    assert pb.wire_us(3.5e6, 2.0, 10000.0) == pytest.approx(352.0)
    lines = pb.format_engine({"provider": "shm", "latency": lat, "bandwidth": bw})
    assert "4 KiB 2.00" in lines[1] and "4 KiB 1.00" in lines[2] and "4 MiB 10000" in lines[3]
    assert "no figures (boom)" in pb.format_engine(None, "boom")[0]


def test_proxy_breakdown_skew_counters_and_iterations():
    """Skew = max - min of the processes' stamps per iteration; counter increases per call (max over
    a process's ranks); calls grouped per iteration with the warm-up dropped."""
    import numpy as np

    from benchlib import proxy_breakdown as pb
    base = 1_700_000_000_000_000_000  # wall-clock ns: past 2**53, so stamps must stay integers
    stamps = np.array([[base + 0, base + 10_000], [base + 2_500, base + 9_000], [base + 1_000, base + 10_500]])
    assert pb.skew_us(stamps).tolist() == [2.5, 1.5]
    assert pb.skew_us(stamps[:1]).tolist() == [0.0, 0.0]
    snap = lambda a, b: {0: {"counts_to_landed_ns": a}, 1: {"counts_to_landed_ns": b}}
    snaps = [snap(0, 0), snap(1000, 3000), snap(1000, 3000), snap(6000, 4000)]
    assert pb.counter_deltas(snaps, "counts_to_landed_ns").tolist() == [3000, 0, 5000]
    assert pb.counter_deltas([{}, {}], "x").tolist() == [0]
    names = ["dispatch_send", "dispatch_recv", "combine_send"] * 3  # one warm-up, two timed iterations
    values = [100, 1, 7, 200, 2, 8, 300, 3, 9]
    assert pb.per_iteration(names, values, ("dispatch_send", "dispatch_recv"), 2).tolist() == [202, 303]
    assert pb.per_iteration(names, values, ("combine_send",), 3).tolist() == [7, 8, 9]
    firsts = pb.per_iteration(names, [base + v for v in values], ("dispatch_send", "dispatch_recv"), 2, how="first")
    assert firsts.dtype == np.int64 and firsts.tolist() == [base + 200, base + 300]
    with pytest.raises(ValueError, match="expected 4 or more"):
        pb.per_iteration(names, values, ("dispatch_send",), 4)
    with pytest.raises(ValueError):
        pb.per_iteration(names[:-1], values[:-1], ("dispatch_send", "combine_send"), 2)


def test_proxy_breakdown_unexplained_idle_policy_and_report():
    """unexplained = transfer - (skew + wire) from the p50s (and per iteration), the idle-policy table
    with default - mode, and the report lines carrying those numbers."""
    from benchlib import proxy_breakdown as pb
    transfer = [2000.0, 2100.0, 1900.0, 5000.0, 2050.0]  # p50 2050
    skew = [1200.0, 1000.0, 1100.0, 4000.0, 900.0]        # p50 1100
    b = pb.breakdown(transfer, skew, 350.0, {"pack": 250.0, "unpack": 300.0})
    assert b["transfer_us"] == 2050.0 and b["skew_us"] == 1100.0 and b["iters"] == 5
    assert b["unexplained_us"] == pytest.approx(2050 - 1100 - 350)
    assert b["unexplained_per_iter_us"] == pytest.approx(650.0)  # of 450, 750, 450, 650, 800
    assert b["transfer_mean_us"] == pytest.approx(2610.0)
    none = pb.breakdown(transfer, skew, None)
    assert none["unexplained_us"] is None and none["kernels_us"] == {}
    lines = pb.format_half("dispatch", b, {"bytes": 3_500_000, "rank": 1, "peers": 1},
                           {"latency_us": 2.0, "latency_size": 4096, "bandwidth_MBps": 10000.0,
                            "bandwidth_size": 4 << 20})
    assert lines[0].startswith("  breakdown dispatch: pack 250.0 µs | transfer 2050.0 µs | unpack 300.0 µs")
    assert "= skew 1100.0 µs + wire 350.0 µs" in lines[1] and "unexplained 600.0 µs" in lines[1]
    assert "3.500 MB" in lines[1] and "10000 MB/s" in lines[1]
    assert "wire n/a" in pb.format_half("combine", none)[1] and "unexplained n/a" in pb.format_half("combine", none)[1]
    table = pb.idle_policy({"default": {"dispatch": 2050.0, "combine": 900.0},
                            "spin": {"dispatch": 1500.0, "combine": None}})
    assert table["dispatch"] == {"default": 2050.0, "spin": 1500.0, "default - spin": 550.0}
    assert "default - spin" not in table["combine"]
    text = "\n".join(pb.format_idle(table, ["default", "spin"]))
    assert "2050.0 | 1500.0 | 550.0" in text and "900.0 | n/a | n/a" in text
    assert pb.idle_policy({"spin": {"dispatch": 1.0}}) == {"dispatch": {"spin": 1.0}}
    assert pb.parse_modes("spin, default,spin") == ["spin", "default"]
    with pytest.raises(ValueError, match="unknown proxy mode 'fast'.*spin-all"):
        pb.parse_modes("default,fast")


def test_proxy_program_records_calls_and_parses_modes(capsys):
    """benchmarks/proxy.py imports without a GPU; --proxy-modes is checked; the call recorder, as
    halves.bench_one's hooks, snapshots the counters before each call's barrier and stamps after
    it; part_samples turns the record into per-iteration transfer and skew (one process: no skew)."""
    import numpy as np

    import proxy
    from benchlib import proxy_breakdown as pb
    from benchlib import timing
    assert proxy.parse_args([]).modes == ["default", "spin"]
    assert proxy.parse_args(["--proxy-modes", "spin-all"]).modes == ["spin-all"]
    with pytest.raises(SystemExit):
        proxy.parse_args(["--proxy-modes", "sleepy"])
    assert "unknown proxy mode" in capsys.readouterr().err
    assert proxy.parse_args(["--proxy-modes", "host-rows,copy-rows"]).modes == ["host-rows", "copy-rows"]
    with pytest.raises(SystemExit):  # where the rows live is the cuda backend's choice
        proxy.parse_args(["--backend", "host", "--proxy-modes", "default,copy-rows"])
    assert "copy-rows: JAX_MOE_A2A_STAGING is the cuda backend's" in capsys.readouterr().err

    class Comm:  # a proxy whose counters move by known amounts per call
        def __init__(self):
            self.stats = {"counts_to_landed_ns": 0, "comb_to_landed_ns": 0}

        def proxy_stats(self):
            return {0: dict(self.stats)}

    comm, ticks = Comm(), iter(range(1000, 10**6, 1000))
    bump = {"dispatch_send": ("counts_to_landed_ns", 0), "dispatch_recv": ("counts_to_landed_ns", 40_000),
            "combine_send": ("comb_to_landed_ns", 0), "combine_recv": ("comb_to_landed_ns", 30_000),
            "dispatch": ("counts_to_landed_ns", 20_000), "combine": ("comb_to_landed_ns", 10_000)}
    calls = proxy.CallRecorder(comm, lambda: next(ticks))
    for it in range(3):  # one warm-up, two timed iterations, as bench_one's hooks see them
        for name, (key, ns) in bump.items():
            calls.before_barrier(name)
            timing.barrier(name)
            calls.after_barrier(name)
            comm.stats[key] += ns * (it + 1)
    calls.close()
    # a clock before each barrier (pre: the previous call's end) and after it (stamps)
    assert len(calls.names) == 18 and len(calls.snaps) == 19 and calls.stamps[:2] == [2000, 4000]
    assert len(calls.pre) == 19 and calls.pre[:2] == [1000, 3000]
    assert proxy.packer_samples(calls, 2) == {}  # no packer counters (the cuda path): no end-to-end rows
    samples = proxy.part_samples(calls, 2)
    assert samples["dispatch"]["transfer_us"] == [80.0, 120.0]
    assert samples["combine"]["transfer_us"] == [60.0, 90.0]
    assert samples["dispatch (one call)"]["transfer_us"] == [40.0, 60.0]
    assert samples["combine (one call)"]["skew_us"] == [0.0, 0.0]
    assert set(samples) == set(pb.PARTS)
    before = {k: os.environ.get(k) for k in ("JAX_MOE_A2A_PROXY", "JAX_MOE_A2A_PROGRESS")}
    with proxy.environment({"JAX_MOE_A2A_PROXY": "spin", "JAX_MOE_A2A_PROGRESS": None}):
        assert os.environ["JAX_MOE_A2A_PROXY"] == "spin" and "JAX_MOE_A2A_PROGRESS" not in os.environ
    assert {k: os.environ.get(k) for k in before} == before
    assert np.all(np.asarray(samples["dispatch"]["skew_us"]) == 0)


def test_sched_reader_sees_this_thread_run_and_the_library_threads_by_name():
    """benchlib/sched.py: the calling thread is "main"; a busy loop shows as run time in its delta;
    threads named as the library names its own (cc/core/thread_name.h) are found by name."""
    import ctypes
    import threading

    from benchlib.sched import GROUPS, SchedReader
    if not os.path.exists(f"/proc/self/task/{threading.get_native_id()}/schedstat"):
        pytest.skip("no per-thread schedstat on this kernel")
    started, stop = threading.Event(), threading.Event()

    def named():
        libc = ctypes.CDLL(None)
        libc.pthread_self.restype = ctypes.c_ulong
        libc.pthread_setname_np.argtypes = (ctypes.c_ulong, ctypes.c_char_p)
        libc.pthread_setname_np(libc.pthread_self(), b"a2a-proxy")
        started.set()
        stop.wait()
    t = threading.Thread(target=named)
    t.start()
    started.wait()
    try:
        r = SchedReader()
        assert r.available and sorted(set(r.tids.values())) == ["main", "proxy"]
        a = r.snapshot()
        x, end = 0, time.perf_counter() + 0.05
        while time.perf_counter() < end:
            x += 1
        d = r.delta(a, r.snapshot())
        assert set(d) == set(GROUPS) and d["main"][0] > 10_000  # ran > 10 ms of the 50 ms loop
        assert d["progress"] == (0.0, 0.0)  # no such thread here
    finally:
        stop.set()
        t.join()


def test_packer_breakdown_arithmetic():
    """The host backend's end-to-end parts (benchlib/proxy_breakdown.py): per call the rank whose
    calls took longest, pack / unpack = call - wait, the rest and the unexplained wait add up."""
    from benchlib import proxy_breakdown as pb
    a = {0: {"call_ns_dispatch_send": 0, "wait_ns_dispatch_send": 0, "call_ns_dispatch_recv": 0, "wait_ns_dispatch_recv": 0},
         1: {"call_ns_dispatch_send": 0, "wait_ns_dispatch_send": 0, "call_ns_dispatch_recv": 0, "wait_ns_dispatch_recv": 0}}
    b = {0: {"call_ns_dispatch_send": 50_000, "wait_ns_dispatch_send": 10_000, "call_ns_dispatch_recv": 100_000,
             "wait_ns_dispatch_recv": 70_000},
         1: {"call_ns_dispatch_send": 10_000, "wait_ns_dispatch_send": 0, "call_ns_dispatch_recv": 10_000,
             "wait_ns_dispatch_recv": 5_000}}
    d = pb.packer_deltas(a, b, "dispatch_send", "dispatch_recv")
    assert d == {"pack": 40.0, "send_wait": 10.0, "unpack": 30.0, "recv_wait": 70.0, "calls": 150.0}
    assert pb.packer_deltas(a, a, "dispatch_send", "dispatch_recv") is None  # nothing moved
    parts = {k: [d[k]] * 3 for k in pb.PACKER_PARTS}
    out = pb.packer_breakdown([200.0] * 3, parts, raw_wire_us=20.0, skew_us=[5.0] * 3)
    assert out["rest_us"] == 50.0 and out["skew_us"] == 5.0
    assert out["beyond_wire_us"] == 45.0  # recv wait 70 - skew 5 - raw wire 20
    assert out["ratio"] == 200.0 / (20.0 + 40.0 + 30.0)
    assert out["beyond_runq_us"] is None and "runq_proxy_us" not in out  # no run-queue samples: no such column
    runq = dict(parts, runq_main=[1.0] * 3, runq_proxy=[8.0] * 3, runq_progress=[2.0] * 3)
    out = pb.packer_breakdown([200.0] * 3, runq, raw_wire_us=20.0, skew_us=[5.0] * 3)
    assert out["runq_proxy_us"] == 8.0 and out["runq_main_us"] == 1.0
    assert out["beyond_runq_us"] == 35.0  # unexplained 45 - the proxy's 8 - the progress thread's 2
    assert any("run-queue waits" in line for line in pb.format_packer("dispatch (one call)", out, 1024, 1))
    assert "past JAX's call floor" not in pb.format_packer("dispatch (one call)", out, 1024, 1)[0]
    out["rest_less_floor_us"] = 12.5  # proxy.add_packer_breakdown: rest less JAX's floor per jitted call
    assert "12.5 µs past JAX's call floor" in pb.format_packer("dispatch (one call)", out, 1024, 1)[0]
    assert pb.raw_at({"latency": [{"size": 1024, "raw_half_rtt_us": 3.0}]}, 1024) == 3.0
    assert pb.raw_at({"latency": [{"size": 1024}]}, 1024) is None
    assert "peer" in pb.PROXY_MODES and pb.PROXY_MODES["series"]["JAX_MOE_A2A_PROXY_PIPELINE"] == "off"


def test_bench_one_calls_its_hooks_around_every_barrier():
    import argparse

    import halves
    from benchlib import Progress
    spec = a2a.Spec(num_experts=8, experts_per_token=2, hidden=32, max_tokens_per_rank=4)
    comm = a2a.init(spec, a2a.testing.make_mesh(2), "ep", backend="reference")
    seen = []

    class Hooks:
        def before_barrier(self, name):
            seen.append(("before", name))

        def after_barrier(self, name):
            seen.append(("after", name))
    halves.bench_one(jax, comm, "tiny", argparse.Namespace(seed=a2a.testing.fresh_seed(), no_check=False, x_dtype="f32"), 2, 1,
                     Progress(4, False), hooks=Hooks())
    order = ["dispatch_send", "dispatch_recv", "combine_send", "combine_recv", "dispatch", "combine"]
    assert seen == [(w, h) for h in order for w in ("before", "after")] * 3  # one warm-up, two timed


def test_time_turns_waits_for_landed_rows_before_each_receive():
    """halves.time_turns with proxy.LandedWaiter on the host backend's proxied mode (real proxy
    threads and their dispatches_landed / combines_landed counters; kernel times stubbed, the host
    backend has none): every receive half is called only once its proxies raised the landed flag of
    that step, every half is called once per iteration in order, and the summary is of the stubbed
    kernel times."""
    import argparse

    import halves
    import proxy
    if "host" not in a2a.available_backends():
        pytest.skip("no host backend")
    spec = a2a.Spec(num_experts=8, experts_per_token=2, hidden=32, max_tokens_per_rank=4)
    comm = a2a.init(spec, a2a.testing.make_mesh(2), "ep", backend="host", proxied=True)
    kernel_s = {"dispatch_send": 3e-6, "dispatch_recv": 5e-6, "combine_send": 7e-6, "combine_recv": 11e-6}

    class Timed:  # the communicator with a kernel clock
        def __getattr__(self, name):
            return getattr(comm, name)

        def kernel_seconds(self, half):
            return kernel_s[half]
    try:
        # any draw: the order of the calls is checked, not their results
        glob, fns = halves.jitted_halves(jax, comm, *halves.bench_inputs(comm, argparse.Namespace(seed=0, x_dtype="f32")))
        waiter = proxy.LandedWaiter(comm)
        calls = []

        def spy(name):
            def call(*args):
                now = comm.proxy_stats()
                key = {"dispatch_recv": "dispatches_landed", "combine_recv": "combines_landed"}.get(name)
                landed = min(now[r][key] - waiter.base[r][key] for r in now) if key else None
                calls.append((name, landed))
                return fns[name](*args)
            return call
        spied = {name: spy(name) for name in fns}
        out = halves.time_turns(jax, Timed(), glob, spied, 2, 1, waiter)
    finally:
        comm.close()
    order = ["dispatch_send", "dispatch_recv", "experts", "combine_send", "combine_recv"]
    assert [c[0] for c in calls] == order * 3
    for it in range(3):  # the landed counter was already up for the step of each receive half
        assert calls[5 * it + 1][1] >= it + 1 and calls[5 * it + 4][1] >= it + 1, calls
    assert set(out) == set(kernel_s)
    for half, sec in kernel_s.items():
        assert out[half]["iters"] == 2 and out[half]["p50_us"] == pytest.approx(sec * 1e6)


def test_landed_waiter_gives_up_with_the_counters():
    import proxy

    class Stuck:  # a proxy that never lands anything
        def proxy_stats(self):
            return {0: {"dispatches": 1, "dispatches_landed": 1, "combines": 0, "combines_landed": 0}}
    waiter = proxy.LandedWaiter(Stuck(), timeout_s=0.05)
    with pytest.raises(TimeoutError, match="dispatches_landed.*within 0.05 s"):
        waiter("dispatch")


def test_proxy_program_help_runs_as_a_script():
    import subprocess
    out = subprocess.run([sys.executable, os.path.join(BENCH_DIR, "proxy.py"), "--help"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "unexplained" in out.stdout and "--proxy-modes" in out.stdout


def test_median_parts():
    """The idle policy's per-mode figure over interleaved rounds (proxy.py --rounds): each part's
    median over the rounds, a round without the part (or with None) left out of it."""
    from benchlib import proxy_breakdown as pb
    assert pb.median_parts([{"dispatch": 3.0, "combine": 5.0}, {"dispatch": 1.0}, {"dispatch": 2.0, "combine": None}]) \
        == {"dispatch": 2.0, "combine": 5.0}
    assert pb.median_parts([{"dispatch": 1.0}, {"dispatch": 4.0}]) == {"dispatch": 2.5}
    assert pb.median_parts([]) == {}


def test_proxy_program_under_mpirun_on_cpus(tmp_path):
    """The whole program on CPUs (the host backend's proxied mode: the same proxy thread) under its
    own `mpirun -n 2`: engine benchmark, both proxy modes in two interleaved rounds, breakdown lines
    and the JSON record (every round's record; the idle policy over the rounds' medians)."""
    import shutil
    import signal
    import subprocess
    from jax_moe_a2a import _ffi
    if shutil.which("mpirun") is None:
        pytest.skip("no mpirun")
    if "host" not in a2a.available_backends() or not _ffi.require_native().built_with_libfabric():
        pytest.skip("no host backend with libfabric")
    env = subprocess_env(drop=("JAX_MOE_A2A_",), keep_xla_flags=True, PYTHONUNBUFFERED="1")
    out_json = tmp_path / "proxy.json"
    cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-n", "2", sys.executable,
           os.path.join(BENCH_DIR, "proxy.py"), "--backend", "host", "--tokens", "8", "--hidden", "128",
           "--iters", "3", "--warmup", "1", "--engine-iters", "300", "--engine-stream-mib", "2", "--rounds", "2",
           "--json", str(out_json)]
    proc = subprocess.Popen(cmd, env=env, cwd=str(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        text, _ = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the session this test started: mpirun and its processes
        text, _ = proc.communicate()
        pytest.fail(f"proxy.py did not finish within 240 s:\n{text[-6000:]}")
    assert proc.returncode == 0, text[-6000:]
    assert "half round trip (µs)" in text and "idle policy, transfer p50" in text, text[-6000:]
    assert text.count("breakdown dispatch:") == 4 and "unexplained" in text, text[-6000:]
    assert "-- round 2 of 2" in text, text[-6000:]
    rec = json.loads(out_json.read_text())
    assert list(rec["modes"]) == ["default (round 1)", "spin (round 1)", "default (round 2)", "spin (round 2)"]
    for mode in rec["modes"].values():
        assert mode["check"] == "ok"
        for part in ("dispatch", "combine", "dispatch (one call)", "combine (one call)"):
            b = mode["breakdown"][part]
            assert b["iters"] == 3 and b["transfer_us"] > 0 and b["skew_us"] >= 0 and b["wire_us"] > 0
            assert b["unexplained_us"] == pytest.approx(b["transfer_us"] - b["skew_us"] - b["wire_us"])
    assert rec["wire_bytes"]["dispatch"]["bytes"] > 0 and rec["engine"]["figures"]["dispatch"]["latency_us"] > 0
    assert "default - spin" in rec["idle_policy"]["dispatch"]
    # the raw exchange of each op's bytes (every rank writing every peer at once) and the ratio against it
    assert "raw exchange of the same bytes" in text and "wall / (raw exchange + pack + unpack)" in text, text[-6000:]
    for op in ("dispatch", "combine"):
        rx = rec["raw_exchange"][op]
        assert rx["p50_us"] > 0 and rx["blocks"] == 7 and rx["bytes_max"] > 0
        for mode in rec["modes"].values():
            b = mode["packer_breakdown"][f"{op} (one call)"]
            assert b["raw_exchange_us"] == rx["p50_us"] and b["ratio_exchange"] > 0
    assert "kernels alone: not run (no kernel times" in text, text[-6000:]  # the host backend has none
    assert all(m["kernel_turns_why_none"].startswith("no kernel times") for m in rec["modes"].values())


def _halves_record(backend, p10, p50, p90, iters=20):
    from benchlib import HALVES
    t = {h: {"p10_us": p10, "p50_us": p50, "p90_us": p90, "p99_us": p90 * 1.1, "iters": iters} for h in HALVES}
    return {"backend": backend, "shape": "decode", "check": "ok", "timings": t, "ranks": 8,
            "buffer_bytes_per_rank": 1 << 20, "spec": {"T": 8, "H": 64, "E": 16, "K": 2}}


def test_halves_report_gives_the_ratio_with_its_spread(tmp_path, capsys, monkeypatch):
    """The table and the fastest line give host's speed-up over reference with the range the p10..p90
    spreads allow; the plot uses a log axis (on CPUs a linear one hides host's bars)."""
    import matplotlib.axes
    from benchlib import report
    out = {"meta": {"platform": "cpu", "iters": 20},
           "results": [_halves_record("reference", 900.0, 1000.0, 1500.0), _halves_record("host", 80.0, 100.0, 150.0)]}
    rs = report.halves_ratio(out["results"][0], out["results"][1])
    assert rs == pytest.approx((10.0, 6.0, 18.75))   # 2000/200, 1800/300, 3000/160
    report.print_halves(out)
    text = capsys.readouterr().out
    assert "10.00x (6.00-18.75)" in text, text
    assert "fastest at decode: host (200 µs dispatch + combine p50 (wall), 10.00x the reference backend " \
           "(6.00-18.75x within the spread)" in text, text
    scales = []
    real = matplotlib.axes.Axes.set_yscale
    monkeypatch.setattr(matplotlib.axes.Axes, "set_yscale", lambda ax, v, **kw: (scales.append(v), real(ax, v, **kw)))
    assert report.plot_halves(out, str(tmp_path))
    assert scales == ["log"], scales


def test_layers_report_gives_the_ratio_with_its_spread(capsys):
    from benchlib import report
    rec = lambda b, lo, mid, hi: {"backend": b, "shape": "decode", "experts": "identity", "overlap": False,
                                  "placement": "after", "cmdbuf": "off", "per_layer_us": {"min": lo, "p50": mid, "max": hi}}
    out = {"meta": {}, "results": [rec("reference", 90.0, 100.0, 200.0), rec("host", 8.0, 10.0, 30.0)]}
    report.print_layers(out)
    text = capsys.readouterr().out
    assert "10.00x (3.00-25.00)" in text and "(3.00-25.00x within the spread)" in text, text


def test_interleaved_timing_spreads_the_fast_backends_iterations_over_the_slow_ones():
    """bench_interleaved: both backends time in turns (they meet the same load), the fast one gets
    more iterations up to the time budget, spread over the slow one's rounds, not after them."""
    import halves
    from benchlib import HALVES
    log = []

    class Fake:
        def __init__(self, name, sec):
            self.name, self.sec = name, sec
            self.samples = {h: [] for h in HALVES}
            self.calls = 0

        timed_iterations = halves.HalvesTimer.timed_iterations
        wants_more = halves.HalvesTimer.wants_more

        def iteration(self, timed, count_progress=True):
            log.append((self.name, timed))
            if timed:
                for h in HALVES:
                    self.samples[h].append(self.sec / len(HALVES))

        def finish(self, iters, warmup):
            return {"backend": self.name, "n": self.timed_iterations()}

    recs = halves.bench_interleaved([Fake("slow", 0.5), Fake("fast", 0.01)], iters=4, warmup=1, min_time_s=0.4)
    assert recs == [{"backend": "slow", "n": 4}, {"backend": "fast", "n": 40}], recs
    timed = [n for n, t in log if t]
    assert timed[0] == "slow" and timed[1] == "fast"
    last_slow = max(i for i, n in enumerate(timed) if n == "slow")
    assert sum(1 for n in timed[:last_slow] if n == "fast") >= 30, timed   # fast ran in the slow one's rounds


def test_bench_main_runs_the_layers_with_per_layer_routing():
    """scripts/bench.sh's layer benchmark routes every layer with moe_block's router by default (the
    headline is router -> dispatch -> experts -> combine); --routing fixed is passed on."""
    import bench
    import layers
    for argv, want in (([], "per-layer"), (["--routing", "fixed"], "fixed")):
        largs = layers.parse_args(bench.layers_argv(bench.parse_args(["--quick", "--out", "x"] + argv)))
        assert largs.routing == want and largs.quick


def test_gpu_clock_summary_and_report():
    """benchlib/gpu_clock.py: nvidia-smi's samples summarised (idle samples and unparsable lines
    left out, power-cap and thermal bits counted), and gemm.py's report line for a measurement."""
    from benchlib import gpu_clock
    lines = ["1980, 420.5, 0x0000000000000000", "1800, 699.0, 0x0000000000000004",
             "1500, 700.2, 0x0000000000000084", "345, 70.4, 0x0000000000000001",  # idle: left out
             "[N/A], [N/A], [N/A]", "", "1900, 650.0, 0x0000000000000020"]
    s = gpu_clock.summarize(lines)
    assert s["samples"] == 4 and s["sm_mhz_min"] == 1500 and s["sm_mhz_p50"] == pytest.approx(1850)
    assert s["power_w_max"] == pytest.approx(700.2) and s["power_w_p50"] == pytest.approx((650.0 + 699.0) / 2)
    assert s["power_capped"] == pytest.approx(2 / 4) and s["thermal"] == pytest.approx(1 / 4)
    assert "why" in gpu_clock.summarize(["345, 70.4, 0x0000000000000001"])
    text = gpu_clock.describe(s)
    assert "SM clock p50 1850 MHz (min 1500)" in text and "power-capped in 50 % of 4 samples" in text
    assert "thermal 25 %" in text
    import gemm
    timed = {"p50_us": 170.0, "min_us": 169.0, "max_us": 171.0, "board": s}
    d = {"L": 8, "rows": 1024, "C": 512, "hbm_fp8": {"read_once_us": 120.0, "copy_GBps": 2960.0},
         "native_fp8_ragged": timed}
    assert "board: SM clock p50 1850 MHz" in gemm.report({"decode": [d]})


def test_gpu_clock_log_runs_nvidia_smi_and_says_why_without(tmp_path, monkeypatch):
    """ClockLog starts nvidia-smi for the block's length and reads what it printed; with no
    nvidia-smi on PATH it says so."""
    from benchlib import gpu_clock
    monkeypatch.setenv("PATH", str(tmp_path))
    with gpu_clock.ClockLog() as log:
        pass
    assert "no nvidia-smi" in log.summary()["why"]
    # prints two busy samples and writes its arguments, then runs until terminated
    fake = tmp_path / "nvidia-smi"
    # the power field's probe (no -lms) answers one number; the log prints two busy samples slowly
    # (the first after 0.5 s: __enter__ waits for it), then runs until terminated
    fake.write_text("#!/bin/sh\ncase \"$*\" in *-lms*) ;; *) echo 612.5; exit 0;; esac\n"
                    f"echo \"$@\" > {tmp_path / 'args'}\nsleep 0.5\n"
                    "echo '1700, 690.0, 0x0000000000000004'\necho '1980, 400.0, 0x0'\nexec sleep 30\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path) + os.pathsep + "/bin" + os.pathsep + "/usr/bin")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    t0 = time.monotonic()
    with gpu_clock.ClockLog(interval_ms=10) as log:
        pass  # an instant block: its samples are there because __enter__ waited for the first
    assert time.monotonic() - t0 < 10  # terminated, not waited for
    s = log.summary()
    assert s["samples"] >= 1 and s["sm_mhz_min"] == 1700 and s["power_field"] == "power.draw.instant", s
    args = (tmp_path / "args").read_text().split()
    assert args[args.index("-i") + 1] == "3" and args[args.index("-lms") + 1] == "10", args  # the first visible GPU
    assert "power.draw.instant" in args[[a.startswith("--query-gpu") for a in args].index(True)]
    assert "(1 s average)" not in gpu_clock.describe(s)
    # a driver without the instant field: its probe fails, the log asks for power.draw and says so
    gpu_clock._POWER_FIELD.clear()
    fake.write_text("#!/bin/sh\ncase \"$*\" in *-lms*) ;; *) echo 'Field is not a valid field'; exit 2;; esac\n"
                    "echo '1700, 690.0, 0x0000000000000004'\necho '1980, 400.0, 0x0'\nexec sleep 30\n")
    with gpu_clock.ClockLog(interval_ms=10) as log:
        time.sleep(0.3)
    s = log.summary()
    assert s["samples"] == 2 and s["power_capped"] == pytest.approx(0.5) and s["power_field"] == "power.draw", s
    assert "(1 s average)" in gpu_clock.describe(s)
    gpu_clock._POWER_FIELD.clear()
    with gpu_clock.ClockLog(enabled=False) as off:  # a CPU run: nothing started, no summary
        pass
    assert off.summary() is None


def test_gemm_bf16_baselines_skip_when_the_card_is_full():
    """gemm.py's bf16 baselines at L = 256 do not fit an 80 GB H100 beside the fp8 case (they ended
    the whole benchmark there): an out-of-memory error drops what that part recorded and says so in
    the case and its report; any other error still ends the run."""
    import gemm
    res = {"L": 256}

    def oom():
        res["native_bf16_ragged"] = {"p50_us": 1.0}
        raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 21.00GiB")

    gemm.fits(oom, res, "bf16", 22.5e9)
    assert "native_bf16_ragged" not in res and "22.5 GB of bf16 weights" in res["bf16_skipped"], res

    def broken():
        raise ValueError("a bug")

    with pytest.raises(ValueError):
        gemm.fits(broken, {}, "bf16", 1.0)
    timed = {"p50_us": 170.0, "min_us": 169.0, "max_us": 171.0}
    d = {"L": 256, "rows": 1024, "C": 32, "hbm_fp8": {"read_once_us": 3000.0, "copy_GBps": 2960.0},
         "native_fp8_ragged": timed, "bf16_skipped": res["bf16_skipped"]}
    assert "bf16 baselines skipped: out of device memory" in gemm.report({"decode": [d]})


def test_gemm_trace_names_and_report():
    """benchmarks/gemm.py --trace: kernel names shortened from either form the profiler gives, and
    the report's per-MLP busy / idle lines, or the trace's reason on a CPU."""
    import gemm
    mangled = ("_ZN3a2a4gemm5wgmma15fp8_swap_kernelI13__nv_bfloat16Li160ELi1ELNS1_6AblateE0ELNS1_3EpiE0EEEv"
               "14CUtensorMap_stS6_NS1_7Fp8ArgsE")
    assert gemm.short_kernel_name(mangled) == "fp8_swap_kernel"
    assert gemm.short_kernel_name("void a2a::gemm::(anonymous namespace)::swiglu_vec_kernel<true, __nv_bfloat16>"
                                  "(a2a::gemm::SwigluParams, long)") == "swiglu_vec_kernel"
    assert gemm.short_kernel_name("loop_xor_fusion") == "loop_xor_fusion"
    timed = {"p50_us": 170.0, "min_us": 169.0, "max_us": 171.0}
    d = {"L": 8, "rows": 1024, "C": 512, "hbm_fp8": {"read_once_us": 120.0, "copy_GBps": 2960.0},
         "native_fp8_ragged": timed,
         "trace_fp8": {"busy_us": 160.0, "span_us": 170.0, "gap_us": 10.0,
                       "kernels": [{"name": "fp8_swap_kernel", "us": 152.0, "calls_per_step": 2.0, "idle_before_us": 9.0}]},
         "trace_fp8_chained": {"busy_us": None, "why": "no GPU device events in the trace"},
         "trace_fp8_bursts": {"busy_us": 158.5, "span_us": 1500000.0, "gap_us": 1499841.5, "kernels": []}}
    text = gemm.report({"decode": [d]})
    assert "device trace (bursts of 10 after 0.3 s idle), per MLP: busy 158.5 us" in text
    assert "span 1500000" not in text  # the pauses are not idle time worth a line
    assert "device trace (one MLP per call), per MLP: busy 160.0, span 170.0, idle 10.0 us" in text
    assert "fp8_swap_kernel" in text and "idle before    9.0" in text
    assert "device trace (chained): no GPU device events" in text


def test_gemm_prefill_parts_report():
    """benchmarks/gemm.py at prefill: each part of the fp8 MLP against XLA's fp8 dense dot of its own
    shape, the boards beside, and the parts' sum against the whole MLP."""
    import gemm
    board = {"samples": 10, "sm_mhz_p50": 1500, "sm_mhz_min": 1400, "power_w_p50": 700.0, "power_w_max": 710.0,
             "power_capped": 0.7, "thermal": 0.0}

    def timed(us, tflops=None, b=True):
        r = {"p50_us": us, "min_us": us - 1, "max_us": us + 1}
        if tflops:
            r["tflops"] = tflops
        if b:
            r["board"] = board
        return r
    p = {"L": 32, "rows": 32768, "flops": 2.886e12, "native_fp8_ragged": timed(3400.0, 849.0),
         "dense_dot_fp8": timed(2230.0, 1294.0), "native_fp8_gate_up": timed(2000.0, 962.0),
         "native_swiglu_fp8": timed(180.0), "native_fp8_down": timed(1100.0, 875.0),
         "dense_dot_fp8_gate_up_shape": timed(1500.0, 1283.0), "dense_dot_fp8_down_shape": timed(760.0, 1266.0, False),
         "swiglu_floor": timed(80.0, b=False)}
    text = gemm.report({"decode": [], "prefill": p})
    assert "x2.25 its floor (80.0 us" in text
    assert "gate_up" in text and "962 TFLOP/s against 1283" in text and ": 0.75x" in text
    assert "down" in text and "875 TFLOP/s against 1266" in text and ": 0.69x" in text
    assert "parts' sum 3280.0 us against the MLP's 3400.0" in text
    assert text.count("SM clock p50 1500 MHz") == 6  # every timed row with a board: all but the down dot


def _layers_result(p50, mn, wire=None, **extra):
    r = {"per_layer_us": {"p50": p50, "min": mn}, **extra}
    if wire is not None:
        r["raw_exchange"] = {"dispatch": {"p50_us": wire[0], "bytes_max": 3.81e6},
                             "combine": {"p50_us": wire[1], "bytes_max": 7.37e6}}
    return r


def test_gemm_timeit_board_compiles_before_the_board_log(monkeypatch):
    """gemm.timeit_board: the first call (compile, autotuning) runs before the clock log starts, so
    the board's samples cover the timed calls only (a dense dot's log was mostly idle samples)."""
    import gemm
    events = []

    class Log:
        def __enter__(self):
            events.append("log on")
            return self

        def __exit__(self, *a):
            events.append("log off")

        def summary(self):
            return {"samples": 0}
    monkeypatch.setattr(gemm.gpu_clock, "ClockLog", Log)

    def fn(x):
        events.append("call")
        return x
    r = gemm.timeit_board(fn, jax.numpy.ones(2), trials=2, target_s=0.0)
    assert events[0] == "call" and events[1] == "log on" and events[-1] == "log off"
    assert r["board"] == {"samples": 0} and r["trials"] == 2


def test_loop_ratio_cpu_and_gpu_lines(tmp_path, capsys):
    """benchlib/loop_ratio.py, issue 35's measure as both scripts print it: proxy loop / (raw
    exchange + local loop) by medians and minima; the CPU form pairs the variants of one process
    by round and the separate process starts by number, and says n/a (with why) for a missing run."""
    from benchlib import loop_ratio as lr
    import json

    def dump(name, results):
        d = tmp_path / name
        d.mkdir()
        (d / "layers.json").write_text(json.dumps({"results": results}))
        return str(d / "layers.json")
    px = _layers_result(1300.0, 1200.0, wire=(40.0, 60.0), ranks=2)
    loc = _layers_result(1100.0, 1000.0)
    assert lr.wire_us(px) == 100.0
    assert lr.ratio(px, loc) == pytest.approx(1300 / 1200) and lr.ratio(px, loc, minima=True) == pytest.approx(1200 / 1100)
    dump("run-same", [_layers_result(1300.0, 1200.0, wire=(40.0, 60.0), env="NODE_SIZE=1", round=0),
                      _layers_result(1100.0, 1000.0, env="NODE_SIZE=2", round=0),
                      _layers_result(900.0, 800.0, env="NODE_SIZE=2", round=1),
                      _layers_result(1000.0, 900.0, wire=(50.0, 50.0), env="NODE_SIZE=1", round=1)])
    dump("run-local1", [loc])
    dump("run-proxied1", [px])
    lines = lr.cpu_lines(str(tmp_path / "run"), 2, 2)
    assert lines[0] == ("issue 35 (CPU), N = 2, same process, round 1: proxy loop 1300.0 µs/layer / (raw exchange "
                        "100.0 + node-local loop 1100.0) = 1.08x; by the repeats' minima 1.09x")
    assert "round 2: proxy loop 1000.0" in lines[1] and "= 1.00x" in lines[1]
    assert lines[2].startswith("issue 35 (CPU), N = 2, 2 processes against one, round 1: proxy loop 1300.0")
    assert lines[3].startswith("issue 35 (CPU), processes, round 2: n/a (FileNotFoundError")
    assert lr.cpu_lines(str(tmp_path / "none"), 1, 2)[0].startswith("issue 35 (CPU), same process: n/a")
    g = dump("gpu-proxy", [_layers_result(2222.0, 2100.0, wire=(600.0, 1200.0), ranks=2, env="default", round=2)])
    n = dump("gpu-nvlink", [_layers_result(160.0, 150.0)])
    assert lr.main(["gpu", g, n]) == 0
    out = capsys.readouterr().out
    assert out.startswith("issue 35, N = 2 [default, round 3]: proxy loop 2222.0 µs/layer / (raw exchange 1800.0 + "
                          "NVLink loop 160.0) = 1.13x (dispatch 600.0 µs, 3.81 MB, combine 1200.0 µs, 7.37 MB)")
    assert lr.main(["gpu", g, str(tmp_path / "missing.json")]) == 0
    assert "issue 35 ratio: n/a (FileNotFoundError" in capsys.readouterr().out
    assert lr.main(["gpu"]) == 2


def test_proxy_timeline_parts_from_two_ranks_files(tmp_path):
    """benchlib/proxy_timeline.py on hand-written timelines of two ranks (ns): rank 0's dispatch of
    slot 0 epoch 3 is cut into its parts, rank 1's late PRIV post shows as "rows: peer late" in
    rank 0's rows, and the combine's parts likewise; the causes add up to the mean transfer and
    the rows are set against a raw write."""
    from benchlib import proxy_timeline as pt
    head = "# jax_moe_a2a proxy timeline rank {} ranks 2 dropped 0\n"
    r0 = [(1000, "d_counts_out"), (11000, "d_priv_post", 1), (13000, "d_priv_posted", 1), (20000, "d_counts_in"),
          (21000, "d_over_out"), (60000, "d_rows_in"), (60500, "d_landed"),
          (70000, "c_comb_post", 1), (71000, "c_comb_posted", 1), (95000, "c_comb_in"), (95200, "c_landed")]
    r1 = [(500, "d_counts_out"), (41000, "d_priv_post", 0), (42000, "d_priv_posted", 0), (43000, "d_counts_in"),
          (44000, "d_over_out"), (50000, "d_rows_in"), (50100, "d_landed"),
          (81000, "c_comb_post", 0), (82000, "c_comb_posted", 0), (90000, "c_comb_in"), (90100, "c_landed")]
    for rank, marks in ((0, r0), (1, r1)):
        with open(tmp_path / f"tl.r{rank}.p7.{rank}.tsv", "w") as f:
            f.write(head.format(rank))
            for m in marks:
                f.write(f"{m[0]}\t{m[1]}\t0\t3\t{m[2] if len(m) > 2 else -1}\n")
    by_rank = pt.read(str(tmp_path / "tl"))
    d = {round(r["transfer"], 3): r for r in pt.dispatch_parts(by_rank)}
    a = d[59.5]  # rank 0: counts out at 1 µs, landed at 60.5 µs
    assert a["pack after COUNTS"] == 10 and a["posting"] == 2 and a["peers' COUNTS"] == 7 and a["OVER out"] == 1
    assert a["rows: peer late"] == 20 and a["rows: wire"] == 19 and a["landing"] == 0.5  # rank 1 posted at 41 µs
    b = d[49.6]  # rank 1: rank 0 posted at 11 µs, before rank 1's OVER out: not late
    assert b["rows: peer late"] == 0 and b["rows: wire"] == 6
    c = {round(r["transfer"], 3): r for r in pt.combine_parts(by_rank)}
    assert c[24.2]["rows: peer late"] == 10 and c[24.2]["rows: wire"] == 14 and c[24.2]["posting"] == 1  # rank 1 at 81
    assert c[8.1]["rows: peer late"] == 0 and c[8.1]["rows: wire"] == 8
    s = pt.summarize(by_rank)
    for op in ("dispatch", "combine"):
        assert sum(pt.named(s, op).values()) == pytest.approx(s[op]["mean_us"]["transfer"])
    text = "\n".join(pt.describe(s, {"dispatch": 10.0, "combine": 5.0}))
    assert "rows / one raw write of a peer's message (10.0 µs) = 1.25x" in text  # mean rows (19 + 6) / 2
    assert "timeline combine" in text and "2 steps" in text
    with open(tmp_path / "bad.r0.tsv", "w") as f:
        f.write("not a timeline\n")
    with pytest.raises(ValueError, match="not a proxy timeline"):
        pt.read(str(tmp_path / "bad"))


def test_proxy_timeline_cycle_of_a_model_loop(tmp_path, capsys):
    """proxy_timeline.cycle_parts on a hand-written rank running three layers (slots 0, 1, 0): each
    layer's period from one COUNTS to the next is cut into the transfer, the kernels noticing the
    landings, the local compute and the next layer's send; the parts add up to the period; the last
    layer (no next COUNTS) and a dispatch whose successor overlapped its combine are left out; the
    CLI prints the cycle line."""
    from benchlib import proxy_timeline as pt
    head = "# jax_moe_a2a proxy timeline rank 0 ranks 2 dropped 0\n"
    steps = ("d_counts_out", "d_landed", "d_consumed", "c_comb_post", "c_comb_posted", "c_landed", "c_consumed")
    offs = (0, 50, 55, 80, 82, 150, 153)  # µs into the layer
    lines = []
    for i, (slot, epoch, start) in enumerate(((0, 1, 1000), (1, 1, 1200), (0, 2, 1300), (1, 2, 1600))):
        for k, off in zip(steps, offs):
            lines.append(f"{(start + off) * 1000}\t{k}\t{slot}\t{epoch}\t-1\n")
    with open(tmp_path / "tl.r0.p7.0.tsv", "w") as f:
        f.write(head + "".join(lines))
    rows = pt.cycle_parts(pt.read(str(tmp_path / "tl")))
    # layer 1 (start 1000, next 1200): kept; layer 2 (1200, next 1300 < its c_consumed 1353): overlapped, left
    # out; layer 3 (1300, next 1600): kept; layer 4: no next
    assert [r["period"] for r in rows] == [200, 300]
    a = rows[0]
    assert (a["dispatch transfer"], a["to dispatch_recv"], a["to combine post"], a["combine posting"],
            a["combine transfer"], a["to combine_recv"], a["to next COUNTS"]) == (50, 5, 25, 2, 68, 3, 47)
    for r in rows:
        assert sum(r[k] for k in pt.CYCLE_PARTS) == pytest.approx(r["period"])
    assert len(pt.cycle_parts(pt.read(str(tmp_path / "tl")), skip=1)) == 1
    assert pt.main([str(tmp_path / "tl")]) == 0
    out = capsys.readouterr().out
    assert "timeline cycle (p50 (mean) µs over 2 layers" in out and "period 250.0 (250.0)" in out
    assert pt.main([str(tmp_path / "none")]) == 1


def test_layers_proxied_host(tmp_path):
    """layers.py --proxied: the host backend's layer through its proxy thread (a2a.init(proxied=True),
    the cuda inter-node protocol on CPUs), recorded in the meta; refused without the host backend."""
    import layers
    if "host" not in a2a.available_backends():
        pytest.skip("host backend not built")
    argv = ["--quick", "--shape", "decode", "--backend", "host", "--experts", "identity", "--shared", "none",
            "--no-plain", "--proxied", "--out", str(tmp_path)]
    out = layers.run(jax, layers.parse_args(argv))
    assert out["meta"]["proxied"] is True
    assert not [r for r in out["results"] if "error" in r] and out["results"][0]["finite"], out["results"]
    assert out["results"][0]["proxy_threads"] == jax.local_device_count()  # one proxy per local rank: it ran proxied
    rec = layers.run(jax, layers.parse_args(argv + ["--raw-wire"]))["results"][0]
    raw = rec["raw_exchange"]
    assert raw["dispatch"]["p50_us"] > 0 and raw["combine"]["bytes_max"] > 0, raw  # the proxies' bytes, raw
    per = rec["proxy_per_layer"]  # one write a peer, no staging: nothing split, nothing copied
    nothing = ("write_pieces", "pieces_behind_copy", "pieces_copied_early", "staged_bytes", "staging_ns", "staging_busy_ns")
    assert {k: per[k] for k in nothing} == dict.fromkeys(nothing, 0), per
    assert 0 <= per["post_blocked_ns"] <= per["post_ns"], per
    assert per["rails"] == 1, per  # the host backend's default: one domain an engine
    assert "(this process, 1 rail): 0.0 extra PRIV/OVER pieces" in layers.describe_counters(per)
    direct = layers.run(jax, layers.parse_args([a for a in argv if a != "--proxied"]))
    assert direct["results"][0]["proxy_threads"] == 0 and direct["meta"]["proxied"] is False
    with pytest.raises(SystemExit, match="--proxied"):
        layers.run(jax, layers.parse_args(["--quick", "--backend", "reference", "--proxied", "--out", str(tmp_path)]))


def test_layers_stream_stays_finite_over_the_timed_steps():
    """The timed loop chains steps x 4 layers of grouped SwiGLU experts plus the shared expert; the
    stream must stay finite and bounded (each layer's input through models.rms_norm), or the router
    sends NaN rows wherever top_k puts them and the timing is not a model's (an H100 run of
    2026-12-06 ended in non-finite values without the norm; at this shape it does by the 8th step).
    Plain's layers at the quick shape, 10 steps."""
    import numpy as np
    import jax.numpy as jnp
    import layers
    from benchlib import shapes
    from jax_moe_a2a import testing
    shape = shapes.QUICK["decode"]
    spec = shape.spec()
    comm = a2a.init(spec, testing.make_mesh(1), "ep", backend="reference", collect_stats=False)
    cfg = layers.layer_config(spec, shape.ffn, "grouped", "overlap")
    seed = testing.fresh_seed()
    params = layers.init_params(cfg, jax.random.key(seed), routers=4)
    step = jax.jit(layers.make_step(comm, cfg, "overlap", 4, True, "per-layer"))
    i = testing.make_inputs(spec, 1, seed, num_tokens=spec.max_tokens_per_rank)[0]
    args = (jnp.asarray(i.topk_ids), jnp.asarray(i.topk_weights), jnp.asarray([i.num_tokens], jnp.int32), params)
    y = jnp.asarray(i.x, jnp.bfloat16)
    peaks = []
    for _ in range(10):
        y = step(y, *args)
        peaks.append(float(np.abs(np.asarray(y, np.float32)).max()))
    assert np.isfinite(peaks).all() and peaks[-1] < 4 * peaks[0], (peaks, seed)
