"""The benchmark programs of benchmarks/ at a tiny size (one iteration), so that CI runs them.
Nothing here asserts a speed."""

import json
import os
import sys

import pytest

BENCH_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, BENCH_DIR)

import jax  # noqa: E402

import jax_moe_a2a as a2a  # noqa: E402

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
    assert "fastest MoE layer at decode, identity experts" in capsys.readouterr().out


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


def test_engine_timing_loops_take_the_library_engines():
    """benchmarks/engine.py's C++ loops live in their own module (jax_moe_a2a_bench, cc/bench) and
    take the engines, regions and groups jax_moe_a2a._C.transfer makes (nanobind shares the types
    between the two modules): every loop once between two in-process engines, a thread per rank,
    and a timeout from the loop arrives as the library's TransferTimeoutError."""
    import threading

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
    seconds, errors = {}, []

    def rank_main(r):
        try:
            e = engines[r]
            dsts = [e.remote(d) for d in descs]
            g = e.peer_group([0, 1])
            seconds[r] = (loops.pingpong(e, 1 - r, regions[r], dsts[1 - r], 64, 5, 1, r == 0, imm(20), 10.0),
                          loops.stream(e, 1 - r, regions[r], dsts[1 - r], 64, 4, r == 0, imm(22), imm(23), 10.0),
                          loops.scatter(e, g, regions[r], dsts, 64, r, 3, 1, imm(24), 10.0),
                          loops.barrier(e, g, 3, 1, imm(25), 10.0))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append((r, exc))

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert all(s > 0 for s in seconds[0]) and seconds[1][1] == 0  # the stream's receiver reports 0
    with pytest.raises(transfer.TransferTimeoutError):  # rank 1 never answers
        loops.pingpong(engines[0], 1, regions[0], engines[0].remote(descs[1]), 8, 1, 0, True, imm(26), 0.2)
    for e in engines:
        e.close()
