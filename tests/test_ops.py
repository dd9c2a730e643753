"""Every backend against the NumPy oracle on fresh random inputs, outputs poisoned beforehand.

Marked `mpi`: also runs under mpirun (one JAX process per rank or several devices each).
"""

import gc
import os
import time
import weakref
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_moe_a2a as a2a
from jax_moe_a2a import testing as T

# Cases that also run under mpirun (each process compiles every case, so the multi-process
# suites take a representative subset; the single-process suite runs them all).
# JAX_MOE_A2A_MPI_ALL_CASES=1 runs every case under mpirun too (the GPU checks do).
MPI_ALL_CASES = os.environ.get("JAX_MOE_A2A_MPI_ALL_CASES") == "1"
MPI_CASES = {"fp8-random", "expert-major", "one-hot-expert", "empty-ranks", "minus-one-and-invalid",
             "tp2-fp8-expert-major", "overflow-ragged", "combine-into-out", "fp8-partial-block",
             "fp8-partial-block-32", "fp8-partial-block-expert-major-pow2", "fp8-recv-bf16",
             "fp8-non-finite", "fp8-non-finite-f16-odd-hidden"}

from conftest import BACKENDS, PURE_JAX, xla_collectives_refused  # noqa: E402,F401 (re-exported)
FP8 = jnp.float8_e4m3fn
BASE = dict(num_experts=32, experts_per_token=4, hidden=256, max_tokens_per_rank=24)

# (id, spec overrides, make_inputs kwargs, run kwargs)
CASES = [
    ("bf16-random", {}, {}, {}),
    ("fp8-random", dict(dispatch_dtype=FP8), {}, {}),
    ("fp8-pow2", dict(dispatch_dtype=FP8, pow2_scale=True), {}, {}),
    ("fp8-prequantized", dict(dispatch_dtype=FP8), dict(prequantized=True), {}),
    ("fp8-bf16-input", dict(dispatch_dtype=FP8), dict(input_dtype=jnp.bfloat16), {}),
    ("f32-wire-f32-out", dict(dispatch_dtype=jnp.float32, combine_dtype=jnp.float32), {}, dict(y_dtype=jnp.float32)),
    ("f16-wire", dict(dispatch_dtype=jnp.float16, combine_dtype=jnp.float16), dict(input_dtype=jnp.float16),
     dict(y_dtype=jnp.float16)),
    # y wider than the combine dtype travels cast to it (the combine buffers hold bf16 rows)
    ("f32-y-bf16-combine", dict(dispatch_dtype=jnp.float32), {}, dict(y_dtype=jnp.float32)),
    ("expert-major", dict(layout="expert_major"), {}, {}),
    ("expert-major-fp8", dict(layout="expert_major", dispatch_dtype=FP8), {}, {}),
    ("one-hot-expert", {}, dict(routing="one_hot"), {}),
    ("one-hot-expert-major", dict(layout="expert_major"), dict(routing="one_hot"), {}),
    ("skewed", dict(dispatch_dtype=FP8), dict(routing="skewed"), {}),
    ("empty-ranks", {}, dict(routing="empty"), {}),
    ("all-minus-one", {}, dict(minus_one_frac=1.0), {}),
    ("minus-one-and-invalid", {}, dict(minus_one_frac=0.2, invalid_frac=0.2), {}),
    ("num-tokens-zero", {}, dict(num_tokens=0), {}),
    ("num-tokens-full", {}, dict(num_tokens=24), {}),
    ("tp2", dict(tp_size=2), {}, {}),
    ("tp2-fp8-expert-major", dict(tp_size=2, dispatch_dtype=FP8, layout="expert_major"), {}, {}),
    ("overflow-ragged", dict(recv_capacity=20), dict(num_tokens=24), {}),
    ("overflow-ragged-hot", dict(recv_capacity=30), dict(routing="one_hot", num_tokens=24), {}),
    ("overflow-expert-major", dict(layout="expert_major", recv_capacity=2), dict(num_tokens=24), {}),
    ("k-greater-than-l", dict(num_experts=16, experts_per_token=6), {}, {}),
    # wider routing: top-16, and 1,024 experts (newer models; Kimi-K2 has 384 with top-8)
    ("top16", dict(num_experts=64, experts_per_token=16, dispatch_dtype=FP8), {}, {}),
    ("experts-1024", dict(num_experts=1024, experts_per_token=8, max_tokens_per_rank=16, dispatch_dtype=FP8),
     dict(num_tokens=16), {}),
    ("odd-sizes", dict(num_experts=24, experts_per_token=3, hidden=96, max_tokens_per_rank=7,
                       dispatch_dtype=FP8, scale_block=32), {}, {}),
    # rows whose byte size is not a multiple of 16 (GPU kernels fall back from 16-byte copies), and
    # fp8 scales that are not 4-byte aligned on the wire (H % 4 != 0)
    ("odd-hidden-bf16", dict(hidden=36, max_tokens_per_rank=5), {}, {}),
    ("odd-hidden-fp8", dict(hidden=30, max_tokens_per_rank=5, dispatch_dtype=FP8, scale_block=10), {}, {}),
    # fp8 with a partial last scale block (scale_block does not divide H; gpt-oss has H = 2880 with
    # 128: 22 full blocks and one of 64): small shapes of that kind, one with H % 8 != 0
    ("fp8-partial-block", dict(hidden=144, max_tokens_per_rank=8, dispatch_dtype=FP8, scale_block=128), {}, {}),
    ("fp8-partial-block-32", dict(hidden=48, max_tokens_per_rank=8, dispatch_dtype=FP8, scale_block=32), {}, {}),
    ("fp8-partial-block-prequantized", dict(hidden=144, max_tokens_per_rank=8, dispatch_dtype=FP8, scale_block=128),
     dict(prequantized=True), {}),
    ("fp8-partial-block-expert-major-pow2", dict(hidden=48, max_tokens_per_rank=8, dispatch_dtype=FP8,
                                                 scale_block=32, layout="expert_major", pow2_scale=True),
     dict(input_dtype=jnp.bfloat16), {}),
    ("odd-hidden-fp8-partial-block", dict(hidden=30, max_tokens_per_rank=5, dispatch_dtype=FP8, scale_block=16), {}, {}),
    # batches whose routing tables pass one block's shared memory (prefill-sized T at E = 256):
    # on the GPU at EP = 1 the grid-routed local dispatch (cc/gpu/local/dispatch_grid.cu)
    ("many-tokens-fp8", dict(num_experts=256, experts_per_token=8, hidden=128, max_tokens_per_rank=1024,
                             dispatch_dtype=FP8), dict(num_tokens=1000, minus_one_frac=0.1, invalid_frac=0.05), {}),
    ("many-tokens-expert-major-overflow", dict(num_experts=256, experts_per_token=8, hidden=128,
                                               max_tokens_per_rank=1024, dispatch_dtype=FP8, layout="expert_major",
                                               recv_capacity=24), dict(input_dtype=jnp.bfloat16), {}),
    ("many-tokens-bf16-overflow", dict(num_experts=256, experts_per_token=8, hidden=128, max_tokens_per_rank=1024,
                                       recv_capacity=6000), dict(input_dtype=jnp.bfloat16), {}),
    # fp8 on the wire, dequantised on receive (Spec.recv_dtype): the GPU kernels write the rows in
    # recv_dtype (the EP = 1 kernels too, block- and grid-routed; the exchange's row copy with odd
    # sizes and pre-quantised x), every other backend through the communicator's dequantisation
    ("fp8-recv-bf16", dict(dispatch_dtype=FP8, recv_dtype=jnp.bfloat16), {}, {}),
    ("fp8-recv-f32-expert-major", dict(dispatch_dtype=FP8, recv_dtype=jnp.float32, layout="expert_major"),
     dict(input_dtype=jnp.bfloat16), {}),
    ("fp8-recv-f16-odd-hidden", dict(hidden=30, max_tokens_per_rank=5, dispatch_dtype=FP8, scale_block=10,
                                     recv_dtype=jnp.float16), {}, {}),
    ("fp8-recv-bf16-prequantized-partial-block", dict(hidden=144, max_tokens_per_rank=8, dispatch_dtype=FP8,
                                                      recv_dtype=jnp.bfloat16), dict(prequantized=True), {}),
    ("many-tokens-fp8-recv-bf16", dict(num_experts=256, experts_per_token=8, hidden=128, max_tokens_per_rank=1024,
                                       dispatch_dtype=FP8, recv_dtype=jnp.bfloat16), dict(num_tokens=1000), {}),
    # NaN, +-Inf, values far past +-448 and all-zero blocks in x (testing.special_rows): every
    # quantiser follows one rule (docs/api.md, "fp8 quantisation"), so rows and scales match the
    # oracle bit for bit, NaN codes included; the vector and the warp-per-block paths of the GPU
    # staging (H % 8 == 0 or not), partial blocks, pow2, bf16/f16 x and dequantisation on receive
    ("fp8-non-finite", dict(dispatch_dtype=FP8), dict(specials=True, num_tokens=24), {}),
    ("fp8-non-finite-bf16-pow2-partial", dict(hidden=144, max_tokens_per_rank=8, dispatch_dtype=FP8, scale_block=32,
                                              pow2_scale=True, layout="expert_major"),
     dict(input_dtype=jnp.bfloat16, specials=True, num_tokens=8), {}),
    ("fp8-non-finite-f16-odd-hidden", dict(hidden=30, max_tokens_per_rank=8, dispatch_dtype=FP8, scale_block=16),
     dict(input_dtype=jnp.float16, specials=True, num_tokens=8), {}),
    ("fp8-non-finite-recv-bf16", dict(dispatch_dtype=FP8, recv_dtype=jnp.bfloat16), dict(specials=True, num_tokens=24),
     {}),
    ("one-shot", {}, {}, dict(split=False)),
    ("combine-into-out", dict(combine_dtype=jnp.float32), {}, dict(with_out=True)),
    ("slot1", dict(slots=2), {}, dict(slot=1)),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case_id, spec_kw, input_kw, run_kw",
                         [pytest.param(*c, marks=[pytest.mark.mpi] if MPI_ALL_CASES or c[0] in MPI_CASES else [], id=c[0])
                          for c in CASES])
def test_against_oracle(backend, case_id, spec_kw, input_kw, run_kw, num_ranks, mesh):
    spec_kw = dict(spec_kw)
    if spec_kw.get("num_experts", 32) % num_ranks or num_ranks % spec_kw.get("tp_size", 1):
        pytest.skip(f"{case_id} does not fit {num_ranks} ranks")
    spec = a2a.Spec(**{**BASE, **spec_kw})
    comm = a2a.init(spec, mesh, "ep", backend=backend)
    run_kw = dict(run_kw)
    seed = zlib.crc32(case_id.encode()) % 10**6 + 17 * num_ranks  # same in every process
    inputs = T.make_inputs(spec, num_ranks, seed, **input_kw)
    out = None
    if run_kw.pop("with_out", False):
        rng = np.random.default_rng(seed + 1)
        out = [rng.standard_normal((spec.max_tokens_per_rank, spec.hidden)).astype(np.float32)
               for _ in range(num_ranks)]
    y_dtype = run_kw.pop("y_dtype", jnp.bfloat16)
    results = T.run_ops(comm, inputs, y_dtype=y_dtype, out=out, **run_kw)
    T.check_all(comm, inputs, results, y_dtype=y_dtype, out=out)
    if case_id.startswith("overflow"):
        assert sum(int(r["num_overflow"]) for r in results.values()) > 0 or jax.process_count() > 1


@pytest.mark.mpi
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("debug", [False, True], ids=["stats", "debug"])
def test_communicator_collected_after_running(backend, debug, num_ranks, mesh):
    """A communicator nobody holds is collected after it ran, its engines and threads with it,
    though the jit caches keep its compiled step (and the host callbacks that count drops into it:
    collect_stats, or debug's check). They held it strongly until 2026-12-02: every test under
    mpirun left two progress threads behind, and the suite slowed to a crawl waking them."""
    spec = a2a.Spec(**BASE)
    comm = a2a.init(spec, mesh, "ep", backend=backend, collect_stats=True, debug=debug)
    inputs = T.make_inputs(spec, num_ranks, 4242)
    T.check_all(comm, inputs, T.run_ops(comm, inputs))
    assert comm.stats()["dispatches"] > 0, "the callback counted into the communicator"
    ref = weakref.ref(comm)
    del comm
    gc.collect()
    assert ref() is None, [type(r) for r in gc.get_referrers(ref())]


@pytest.mark.mpi
@pytest.mark.parametrize("backend", BACKENDS)
def test_repeated_steps_fresh_inputs(backend, num_ranks, mesh):
    """The same compiled step on several fresh random routings (buffers reused across steps)."""
    spec = a2a.Spec(**BASE, dispatch_dtype=FP8)
    comm = a2a.init(spec, mesh, "ep", backend=backend)
    for step in range(4):
        inputs = T.make_inputs(spec, num_ranks, 1000 + step, invalid_frac=0.05, minus_one_frac=0.05)
        T.check_all(comm, inputs, T.run_ops(comm, inputs))


@pytest.mark.mpi
@pytest.mark.parametrize("backend", BACKENDS)
def test_dropped_rows_return_zeros_after_kept_ones(backend, num_ranks, mesh):
    """Rows dropped past recv_capacity come back from the combine as zeros on every step, also where
    an earlier step of the same buffers kept and returned a row at that place (a backend that clears
    only at creation passes a single step; found when the host backend's combine_send stopped
    clearing every outgoing row first)."""
    spec = a2a.Spec(**BASE, recv_capacity=20)
    comm = a2a.init(spec, mesh, "ep", backend=backend)
    dropped = 0
    for step, n in enumerate((24, 6, 24, 24, 12, 24)):
        inputs = T.make_inputs(spec, num_ranks, 3100 + step, num_tokens=n)
        results = T.run_ops(comm, inputs, poison=True)
        T.check_all(comm, inputs, results)
        dropped += sum(int(r["num_overflow"]) for r in results.values())
    assert dropped > 0 or jax.process_count() > 1


@pytest.mark.mpi
@pytest.mark.parametrize("backend", BACKENDS)
def test_stats_count_drops_and_overflow(backend, num_ranks, mesh):
    spec = a2a.Spec(**BASE, recv_capacity=8)
    comm = a2a.init(spec, mesh, "ep", backend=backend, collect_stats=True)  # default off on GPUs
    inputs = T.make_inputs(spec, num_ranks, 5, invalid_frac=0.1, num_tokens=24)
    for i in inputs:  # a bad id on every rank, whatever the draw (each process sums its own ranks' drops)
        i.topk_ids[0, 0] = spec.num_experts + 3
    res = T.run_ops(comm, inputs)
    st = comm.stats()
    assert st["dispatches"] == len(res)
    assert st["dropped"] == sum(int(r["num_dropped"]) for r in res.values()) > 0
    assert st["overflow"] == sum(int(r["num_overflow"]) for r in res.values()) > 0
    assert st["buffer_bytes_per_rank"] > 0 and st["backend"] == backend


@pytest.mark.mpi
@pytest.mark.parametrize("backend", BACKENDS)
def test_debug_raises_on_drop(backend, num_ranks, mesh):
    spec = a2a.Spec(**BASE)
    comm = a2a.init(spec, mesh, "ep", backend=backend, debug=True)
    inputs = T.make_inputs(spec, num_ranks, 6, invalid_frac=0.2, num_tokens=24)
    with pytest.raises(a2a.DroppedRowsError, match="dropped"):
        with comm.checked():  # also drops JAX's record of the failed step (else raised again at exit)
            T.run_ops(comm, inputs)


@pytest.mark.parametrize("backend", BACKENDS)
def test_debug_stops_every_rank_when_one_drops(backend, num_ranks, mesh):
    """One bad id on rank 0 only: every rank must stop at the check (a psum decides for all);
    before, the others waited in the combine's all_to_all until XLA:CPU aborted the process
    (40 s), or, on the FFI backends, in the combine until timeout_s."""
    spec = a2a.Spec(**BASE)
    comm = a2a.init(spec, mesh, "ep", backend=backend, debug=True)
    if num_ranks > 1 and not comm._backend.debug_psum:
        pytest.skip(f"{backend}: no psum in the debug check (XLA's NCCL collectives refuse processes sharing a "
                    "GPU); the other ranks end at their next half's timeout")
    inputs = T.make_inputs(spec, num_ranks, 6, num_tokens=24)
    # Compiled (and run once, every id valid) first: the time below is the failing run's alone,
    # not XLA compiling the step as well (seconds, many more on a loaded machine).
    T.run_ops(comm, inputs)
    inputs[0].topk_ids[0, 0] = spec.num_experts + 7
    t0 = time.monotonic()
    with pytest.raises(a2a.DroppedRowsError, match="dropped"):
        with comm.checked():
            T.run_ops(comm, inputs)
    assert time.monotonic() - t0 < 20, "the ranks without drops waited for the one that stopped"


@pytest.mark.mpi
@pytest.mark.skipif("cuda" not in BACKENDS, reason="the cuda backend's inter-node path")
def test_cuda_row_path_follows_module_loading(num_ranks, mesh):
    """JAX_MOE_A2A_STAGING unset (`auto`, the default): the inter-node path keeps its rows in GPU
    memory copied by the copy engines (`copy`) where CUDA loads modules eagerly
    (CUDA_MODULE_LOADING=EAGER, which copy rows need) and in pinned host memory (`host`) otherwise;
    proxy_stats()["row_path"] names the one taken, and a step on it matches the oracle. The rails and
    the writes' pieces follow (cc/cuda/remote_path.cc, rails_default, pieces_default): copy rows open
    two rails (proxy_stats' rails) and so post each COMB in at least two pieces (comb_pieces: writes
    beyond one a peer; 4 with one remote peer a rank); host rows one rail, each COMB in one."""
    for var in ("JAX_MOE_A2A_STAGING", "JAX_MOE_A2A_WRITE_CHUNK_KIB", "JAX_MOE_A2A_COMB_PIECES", "JAX_MOE_A2A_RAILS"):
        if os.environ.get(var):
            pytest.skip(f"{var} is set: the default is not what runs")
    if num_ranks < 2:
        pytest.skip("needs a peer on another node (node_size 1)")
    spec = a2a.Spec(**BASE)
    comm = a2a.init(spec, mesh, "ep", backend="cuda", node_size=1)
    inputs = T.make_inputs(spec, num_ranks, T.fresh_seed())
    T.check_all(comm, inputs, T.run_ops(comm, inputs, poison=True))
    want = "copy" if os.environ.get("CUDA_MODULE_LOADING", "").upper() == "EAGER" else "host"
    stats = comm.proxy_stats()
    comm.close()
    assert stats and {s["row_path"] for s in stats.values()} == {want}, stats
    rails = 2 if want == "copy" else 1
    assert {s["rails"] for s in stats.values()} == {rails}, stats
    if want == "copy":  # node_size 1: each rank's N - 1 peers are remote; per combine COMB in max(4 if
        # one peer, rails) pieces a peer, so at least (pieces - 1) x (N - 1) beyond one a peer per combine
        pieces = 4 if num_ranks == 2 else rails
        assert all(s["comb_pieces"] >= (pieces - 1) * (num_ranks - 1) * s["combines"] > 0 for s in stats.values()), stats
    else:
        assert all(s["comb_pieces"] == 0 for s in stats.values()), stats
