"""The proxy thread (cc/proxy) that drives the route-exchange protocol for the cuda backend's remote
peers, tested on CPUs. The host backend's proxied mode plays the kernels' part: it packs rows into
the registered send buffer, raises the Ctrl flags and waits on the proxy's, then unpacks from the
receive buffer with the proxy's overflow bases, as the GPU kernels do through mapped memory; one
proxy thread per rank runs the protocol over the TransferEngine (LocalEngine in one process;
libfabric shm / tcp;ofi_rxm under mpirun). Every result is checked against the NumPy oracle.

    pytest tests/test_proxy.py
    mpirun -n 2 python -m pytest -m mpi tests/test_proxy.py          (JAX_MOE_A2A_PROVIDER=shm)
    JAX_MOE_A2A_PROVIDER="tcp;ofi_rxm" JAX_MOE_A2A_IFACE=lo mpirun -n 4 ... (the same)
"""

import gc
import os
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_moe_a2a as a2a
from jax_moe_a2a import testing as T

from test_protocol import check_never_calls, check_two_slots

pytestmark = pytest.mark.skipif("host" not in a2a.available_backends(), reason="host backend not built")

FP8 = jnp.float8_e4m3fn
BASE = dict(num_experts=16, experts_per_token=3, hidden=64, max_tokens_per_rank=12)
CASES = [
    ("fp8-random", dict(dispatch_dtype=FP8, scale_block=32), {}),
    ("bf16-one-hot", {}, dict(routing="one_hot")),
    ("expert-major-skewed", dict(layout="expert_major"), dict(routing="skewed", minus_one_frac=0.2)),
    ("overflow-ragged", dict(recv_capacity=10), dict(invalid_frac=0.1)),
    ("tp2-fp8", dict(tp_size=2, dispatch_dtype=FP8, scale_block=32), {}),
    ("empty", {}, dict(routing="empty")),
]


def proxied(spec, mesh, priv=None, timeout_s=60.0, node_size=0):
    return a2a.init(spec, mesh, "ep", backend="host", proxied=True, max_private_tokens=priv, timeout_s=timeout_s,
                    node_size=node_size)


def skip_unless_node_fits(node_size, num_ranks):
    """A node's ranks must live in one process here (the node-local path copies in memory)."""
    if node_size and (jax.local_device_count() % node_size or node_size >= num_ranks):
        pytest.skip(f"node_size {node_size} does not fit {jax.local_device_count()} device(s) per process "
                    f"and {num_ranks} ranks")


def check_three_steps(comm, spec, num_ranks, seed):
    """Three steps of every op against the oracle, outputs poisoned: random routing, then skewed
    with 5 tokens on every rank, then one hot expert (seeds seed, seed + 1, seed + 2)."""
    for step in range(3):
        inputs = T.make_inputs(spec, num_ranks, seed + step, num_tokens=[None, 5, None][step],
                               routing=["random", "skewed", "one_hot"][step])
        T.check_all(comm, inputs, T.run_ops(comm, inputs, poison=True))


def check_fresh_steps(comm, spec, num_ranks, steps, adjust=None, **input_kw):
    """`steps` steps of every op against the oracle on fresh random inputs (a new seed each, named
    in a failure; input_kw to testing.make_inputs, e.g. num_tokens; adjust(inputs, seed), if given,
    changes them in place before the step, the same on every process), outputs poisoned."""
    for _ in range(steps):
        seed = T.fresh_seed()
        inputs = T.make_inputs(spec, num_ranks, seed, **input_kw)
        if adjust is not None:
            adjust(inputs, seed)
        try:
            T.check_all(comm, inputs, T.run_ops(comm, inputs, poison=True))
        except AssertionError as e:
            raise AssertionError(f"seed {seed}: {e}") from e


def proxied_three_steps(mesh, num_ranks, seed, priv=None, node_size=0, tp=1):
    """The proxied host communicator of the proxy's variant tests (staging, flag mirror,
    pipelining: the variant is the caller's environment) through check_three_steps: 16 experts,
    top-3, hidden 64, 12 tokens, recv_capacity 10, tp_size tp. Skips a node_size or tp that does not
    fit num_ranks. Returns the communicator, still open (the caller reads proxy_stats, closes it)."""
    skip_unless_node_fits(node_size, num_ranks)
    if num_ranks % tp:
        pytest.skip(f"tp {tp} does not divide {num_ranks} ranks")
    spec = a2a.Spec(num_experts=16, experts_per_token=3, hidden=64, max_tokens_per_rank=12, recv_capacity=10,
                    tp_size=tp)
    comm = proxied(spec, mesh, priv, node_size=node_size)
    check_three_steps(comm, spec, num_ranks, seed)
    return comm


@pytest.mark.mpi
@pytest.mark.parametrize("node_size, priv", [(0, 0), (0, None), (1, 1), (2, 0), (2, 1)],
                         ids=["engine-priv0", "engine-privfull", "node1-priv1", "node2-priv0", "node2-priv1"])
@pytest.mark.parametrize("case_id, spec_kw, input_kw", CASES, ids=[c[0] for c in CASES])
def test_proxied_against_oracle(case_id, spec_kw, input_kw, priv, node_size, num_ranks, mesh):
    """Rows, counts, routing arrays and combine results over the proxy, 2 steps per case. node_size
    0 sends every pair (ourselves included) through the engine (the host backend's layout); 1 keeps
    each rank's rows to itself node-local, as on GPUs; 2 makes pairs of ranks nodes (hybrid)."""
    if num_ranks % spec_kw.get("tp_size", 1) or BASE["num_experts"] % num_ranks:
        pytest.skip(f"{case_id} does not fit {num_ranks} ranks")
    skip_unless_node_fits(node_size, num_ranks)
    spec = a2a.Spec(**{**BASE, **spec_kw})
    comm = proxied(spec, mesh, priv, node_size=node_size)
    for step in range(2):
        inputs = T.make_inputs(spec, num_ranks, 500 + 7 * step + len(case_id), num_tokens=[None, 5][step],
                               **input_kw)
        T.check_all(comm, inputs, T.run_ops(comm, inputs, poison=True))
    comm.close()


@pytest.mark.mpi
@pytest.mark.parametrize("node_size", [0, 2], ids=["all-via-engine", "node2-hybrid"])
@pytest.mark.parametrize("priv", [0, None], ids=["priv0", "priv-full"])
def test_proxied_two_slots(priv, node_size, num_ranks, mesh):
    """Two dispatches in flight on two slots: each slot's pipeline in the proxy runs on its own."""
    skip_unless_node_fits(node_size, num_ranks)
    spec = a2a.Spec(num_experts=2 * num_ranks, experts_per_token=2, hidden=32, max_tokens_per_rank=8, slots=2)
    check_two_slots(proxied(spec, mesh, priv, node_size=node_size), mesh)


@pytest.mark.mpi
def test_proxied_soak(num_ranks, mesh):
    """Many steps through one compiled step (epochs wrap the 8-bit immediate field past 256)."""
    steps = int(os.environ.get("JAX_MOE_A2A_PROXY_SOAK_STEPS", "300"))
    spec = a2a.Spec(num_experts=2 * num_ranks, experts_per_token=2, hidden=32, max_tokens_per_rank=6,
                    dispatch_dtype=FP8, scale_block=16, recv_capacity=4 * num_ranks)
    node_size = 1 if jax.local_device_count() == 1 else 2
    skip_unless_node_fits(node_size, num_ranks)
    comm = a2a.init(spec, mesh, "ep", backend="host", proxied=True, max_private_tokens=1, timeout_s=60,
                    collect_stats=False, node_size=node_size)
    routings = ["random", "one_hot", "empty", "skewed"]
    for step in range(steps):
        inputs = T.make_inputs(spec, num_ranks, 20_000 + step, routing=routings[step % 4], minus_one_frac=0.1)
        T.check_all(comm, inputs, T.run_ops(comm, inputs, poison=step % 50 == 0))


@pytest.mark.mpi
def test_proxied_rank_that_never_calls(num_ranks, mesh):
    """The proxy gives up after timeout_s of a waiting half and names the missing ranks."""
    if jax.process_count() < 2:
        pytest.skip("needs several processes (a rank that never calls cannot be made in one program)")
    spec = a2a.Spec(num_experts=2 * num_ranks, experts_per_token=2, hidden=32, max_tokens_per_rank=4)
    check_never_calls(proxied(spec, mesh, priv=1, timeout_s=2.0), mesh, "host")


def _stderr_until(capfd, text, seconds):
    """stderr (fd 2, C++ threads' writes included) read until it holds `text` or `seconds` passed."""
    err, deadline = "", time.monotonic() + seconds
    while text not in err and time.monotonic() < deadline:
        time.sleep(0.2)
        err += capfd.readouterr().err
    return err


@pytest.mark.mpi
def test_proxy_reports_a_stall(num_ranks, mesh, capfd, monkeypatch):
    """A slot with an op in flight and no proxy step for JAX_MOE_A2A_PROXY_REPORT_S seconds prints
    its flags and the proxy's steps to stderr once (cc/proxy/proxy.cc, report_stalls), with no GIL
    and no waiting packer needed. The last process compiles the step but never runs it: its proxy
    sees its peers' route counts come while its own packer never publishes (open item 5's hung rank,
    which no timeout names: nothing of it waits on the proxy); the others' proxies wait for its
    counts, and report before their timeout."""
    from jax_moe_a2a.runtime import forget_failed_effects, kv_client
    if jax.process_count() < 2:
        pytest.skip("needs several processes (a rank that never calls cannot be made in one program)")
    monkeypatch.setenv("JAX_MOE_A2A_PROXY_REPORT_S", "0.5")  # read when the proxy starts
    spec = a2a.Spec(num_experts=2 * num_ranks, experts_per_token=2, hidden=32, max_tokens_per_rank=4)
    comm = proxied(spec, mesh, priv=1, timeout_s=4.0)
    inputs = T.make_inputs(spec, num_ranks, 5, num_tokens=spec.max_tokens_per_rank)
    silent = jax.process_count() - 1
    if jax.process_index() == silent:
        T.run_ops(comm, inputs, compile_only=True)
        err = _stderr_until(capfd, "raised no d_counts", 20)
        assert "no step for" in err and "COUNTS of dispatch epoch 0 came from ranks [" in err, err
        assert "raised no d_counts" in err and "proxy at dispatch step 1 (waits: our d_counts) epoch 0" in err, err
    else:
        with pytest.raises(Exception, match="did not arrive"):
            T.run_ops(comm, inputs)
        forget_failed_effects()
        err = capfd.readouterr().err
        assert "no step for" in err and "dispatch epoch 0 at step 4 (waits: COUNTS in)" in err and "slot flags: d_counts 1" in err, err
    # Once per stall: a rank may report two stalls (on a loaded machine its own packer can be later
    # than the threshold, then its peers' counts), never the same one twice.
    stalls = [re.sub(r"no step for [0-9.]+ s", "", line) for line in err.splitlines() if "no step for" in line]
    assert len(stalls) == len(set(stalls)), f"once per stall and rank: {err}"
    kv_client().wait_at_barrier(f"jax_moe_a2a_stall_report_{comm.comm_id}", 60_000)


@pytest.mark.mpi
def test_proxy_reports_no_stall_after_a_pause(num_ranks, mesh, capfd, monkeypatch):
    """A stall is an op in flight without a step for JAX_MOE_A2A_PROXY_REPORT_S, not a pause of
    that length followed by a shorter wait: after 3 s of pause (no op in flight, so the proxies'
    steps did not move) the last process starts each step 1.1 s after the others, whose COUNTS
    then wait at its proxy and whose proxies wait for its COUNTS for ~1.1 s, under the 2 s
    threshold: no report (a look at most once a second lands in that second)."""
    if jax.process_count() < 2:
        pytest.skip("needs several processes (one program's ranks start their steps together)")
    monkeypatch.setenv("JAX_MOE_A2A_PROXY_REPORT_S", "2")  # read when the proxy starts
    spec = a2a.Spec(num_experts=2 * num_ranks, experts_per_token=2, hidden=32, max_tokens_per_rank=4)
    comm = proxied(spec, mesh, priv=1, timeout_s=30.0)
    late = jax.process_index() == jax.process_count() - 1
    for step in range(3):
        if step:
            time.sleep(3.0 + (1.1 if late else 0.0))
        inputs = T.make_inputs(spec, num_ranks, 21 + step)
        T.check_all(comm, inputs, T.run_ops(comm, inputs, poison=True))
        if step == 0:  # the first step compiles, one process later than another: a real stall
            capfd.readouterr()
    err = capfd.readouterr().err
    assert "no step for" not in err, err
    comm.close()


@pytest.mark.mpi
def test_proxy_wakes_on_the_packers_flags(num_ranks, mesh, monkeypatch):
    """A flag the packer raises ends the proxy's idle sleep (Proxy::wake), so a step after a pause
    does not wait for the back-off: with the back-off capped at 60 s from the first idle
    microsecond (the proxies sleep about as long as they have been idle), a step after 1.5 s of
    pause passes the oracle and every local proxy counts a sleep its packer cut short
    (proxy_stats' woken; without the wake it waits out its sleep and woken stays 0)."""
    for var, value in (("JAX_MOE_A2A_PROXY_IDLE_MS", "0"), ("JAX_MOE_A2A_PROXY_IDLE_SLEEP_US", "60e6")):
        monkeypatch.setenv(var, value)  # read when the proxies start
    monkeypatch.delenv("JAX_MOE_A2A_PROXY", raising=False)  # not `spin`: the proxies must sleep
    spec = a2a.Spec(num_experts=2 * num_ranks, experts_per_token=2, hidden=32, max_tokens_per_rank=4)
    comm = proxied(spec, mesh, priv=1, timeout_s=30.0)
    for step in range(2):
        if step:
            time.sleep(1.5)
            before = comm.proxy_stats()
        inputs = T.make_inputs(spec, num_ranks, 11 + step)
        T.check_all(comm, inputs, T.run_ops(comm, inputs, poison=True))
    after = comm.proxy_stats()
    woken = {r: after[r]["woken"] - before[r]["woken"] for r in after}
    assert woken and all(w >= 1 for w in woken.values()), woken
    comm.close()


@pytest.mark.mpi
@pytest.mark.parametrize("mode", ["adaptive", "backoff"])
def test_proxy_polls_while_a_transfer_is_under_way(num_ranks, mesh, monkeypatch, mode):
    """A transfer under way (our COUNTS out, a peer's not in yet) wakes nobody when the peer's data
    comes, so the proxy polls through it instead of sleeping by the back-off (cc/proxy/proxy.cc,
    op_under_way; JAX_MOE_A2A_PROXY=adaptive, the default). Each half is its own jitted call: the
    last process sends 0.3 s late, and process 0 waits 0.6 s after its send before it receives, so
    no packer of process 0 waits on its proxies meanwhile. Under `adaptive` they take no sleep mid-
    transfer (proxy_stats' sleeps_under_way stays 0); under `backoff` (the policy before) they do,
    which shows the counter sees it. The step must still pass the oracle."""
    if jax.process_count() < 2:
        pytest.skip("needs several processes (one process runs every rank's half in one call)")
    monkeypatch.setenv("JAX_MOE_A2A_PROXY", mode)  # read when the proxies start
    from jax.sharding import PartitionSpec as P
    spec = a2a.Spec(num_experts=2 * num_ranks, experts_per_token=2, hidden=32, max_tokens_per_rank=4)
    comm = proxied(spec, mesh, priv=1, timeout_s=30.0)
    add = lambda t: jax.tree.map(lambda a: a[None], t)
    rm = lambda t: jax.tree.map(lambda a: a[0], t)
    sm = lambda fn, nin: jax.jit(T.shard_map(fn, mesh=mesh, in_specs=(P("ep"),) * nin, out_specs=P("ep")))
    send = sm(lambda x, i, w, k: add(comm.dispatch_send(x, i, w, k)), 4)
    recv = sm(lambda h: add(comm.dispatch_recv(rm(h))), 1)
    experts = sm(lambda g: add(T.expert_fn_jax(spec, num_ranks, rm(g), jnp.bfloat16)), 1)
    csend = sm(lambda y, g: add(comm.combine_send(rm(y), rm(g))), 2)
    crecv = sm(lambda h: add(comm.combine_recv(rm(h))), 1)
    me, last = jax.process_index(), jax.process_count() - 1
    for step, seed in enumerate((31, 32)):  # the first step compiles; the second is timed as described
        inputs = T.make_inputs(spec, num_ranks, seed)
        glob = T.global_args(mesh, inputs)
        if step:
            before = comm.proxy_stats()
            if me == last:
                time.sleep(0.3)
        h = jax.block_until_ready(send(*glob))
        if step and me == 0:
            time.sleep(0.6)
        got = jax.block_until_ready(recv(h))
        out = jax.block_until_ready(crecv(csend(experts(got), got)))
    after = comm.proxy_stats()
    under_way = {r: after[r]["sleeps_under_way"] - before[r]["sleeps_under_way"] for r in after}
    fields = {"x": got.x, "group_sizes": got.group_sizes, "weights": got.weights, "src": got.src,
              "num_dropped": got.num_dropped, "num_overflow": got.num_overflow, "out": out}
    per = {k: T.local_ranks_of(v) for k, v in fields.items()}
    T.check_all(comm, inputs, {r: {k: per[k][r] for k in per} for r in sorted(per["out"])})
    if mode == "adaptive":
        assert all(v == 0 for v in under_way.values()), under_way
    elif me == 0:
        assert all(v > 0 for v in under_way.values()), under_way
    comm.close()


def test_proxy_threads_end_at_close(mesh, num_ranks):
    """close() stops and joins every proxy thread (and the engines), leaving no thread behind."""
    def threads():
        return len(os.listdir("/proc/self/task"))

    spec = a2a.Spec(num_experts=2 * num_ranks, experts_per_token=2, hidden=32, max_tokens_per_rank=4)
    gc.collect()
    before = threads()
    comm = proxied(spec, mesh)
    assert threads() >= before + jax.local_device_count(), "one proxy thread per local rank"
    comm.close()
    deadline = time.monotonic() + 5
    while threads() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert threads() <= before


def check_split_writes(comm, spec, num_ranks, proxied, split=("write_pieces",), rails=1):
    """check_three_steps on a fresh seed (named in a failure), then, through the proxy, that its
    counters `split` (write_pieces: PRIV / OVER, comb_pieces: COMB) saw writes split into pieces
    (else a test of pieces tests one write per peer again), summed over every process (under
    mpirun -n 4 a rank's own writes may all stay below a rail split: 1 run in 3 failed so), and that
    every proxy's engine has `rails` domains (proxy_stats' rails); closes comm."""
    seed = T.fresh_seed()
    try:
        check_three_steps(comm, spec, num_ranks, seed)
    except AssertionError as e:
        raise AssertionError(f"seed {seed}: {e}") from e
    if proxied:  # summed over every process's ranks: one rank alone may have written nothing big enough to split
        import numpy as np
        from jax.experimental import multihost_utils
        stats = comm.proxy_stats()
        mine = np.array([sum(s[key] for s in stats.values()) for key in split], np.int64)
        total = np.sum(multihost_utils.process_allgather(mine).reshape(-1, len(split)), axis=0)
        for key, n in zip(split, total):
            assert n > 0, (key, stats)
        assert {s["rails"] for s in stats.values()} == {rails}, stats
    comm.close()


@pytest.mark.mpi
@pytest.mark.parametrize("priv", [0, 1, None], ids=["over-only", "priv1", "priv-full"])
@pytest.mark.parametrize("path", ["proxied", "staged", "engine"])
def test_rows_written_in_pieces(num_ranks, mesh, monkeypatch, priv, path):
    """JAX_MOE_A2A_WRITE_CHUNK_KIB splits each PRIV and OVER write into pieces (cc/protocol/
    exchange.cc write_pieces) that the receiver counts from the sources' count matrices, and
    JAX_MOE_A2A_COMB_PIECES each COMB write into a fixed count (zero-length ones too): three
    steps (random, skewed, one hot expert) against the oracle, outputs poisoned, with rows of ~100
    bytes in 256-byte pieces, so most writes are several pieces and some exactly one; through the
    proxy, through the proxy with row staging (JAX_MOE_A2A_HOST_STAGED: the pieces' rows copied back
    to back, each piece posted as its copy ends, PRIV's last copy with the OVER rows:
    Proxy::pump_pieces), and through the host backend's own engine
    path. With the proxy its counters say the writes were split (else this would test one write
    per peer again), and with staging that pieces went out while later pieces were still being
    copied."""
    monkeypatch.setenv("JAX_MOE_A2A_WRITE_CHUNK_KIB", "0.25")  # read when the exchange is created
    monkeypatch.setenv("JAX_MOE_A2A_COMB_PIECES", "3")
    if path == "staged":
        monkeypatch.setenv("JAX_MOE_A2A_HOST_STAGED", "1")
    spec = a2a.Spec(num_experts=16, experts_per_token=3, hidden=64, max_tokens_per_rank=12, recv_capacity=10,
                    dispatch_dtype=FP8, scale_block=32)
    comm = a2a.init(spec, mesh, "ep", backend="host", proxied=path != "engine", max_private_tokens=priv,
                    timeout_s=60.0)
    # pieces behind a copy: COMB's always (three pieces), PRIV's with all rows private (priv 1: one row, one piece)
    split = ("write_pieces", "comb_pieces") + (("pieces_behind_copy",) if path == "staged" else ())
    check_split_writes(comm, spec, num_ranks, path != "engine", split=split)


@pytest.mark.mpi
def test_processes_cutting_writes_otherwise_are_refused(num_ranks, mesh, monkeypatch):
    """Processes whose writes go in different pieces (here JAX_MOE_A2A_COMB_PIECES 1 and 2) would
    wait for pieces that never come, or count a write landed on its first piece and read rows whose
    later pieces are still in flight: the communicator's creation is refused on every process,
    naming the other rank and both settings, before the engines connect (Exchange::check_peers)."""
    if jax.process_count() < 2:
        pytest.skip("needs processes that differ (mpirun -n 2 or more)")
    monkeypatch.setenv("JAX_MOE_A2A_COMB_PIECES", str(1 + jax.process_index() % 2))
    spec = a2a.Spec(num_experts=2 * num_ranks, experts_per_token=2, hidden=32, max_tokens_per_rank=4)
    with pytest.raises(ValueError, match=r"cuts its row writes otherwise than rank \d+: theirs '.*COMB in [12] "
                                         r"pieces.*', ours '.*COMB in [12] pieces"):
        a2a.init(spec, mesh, "ep", backend="host", proxied=True, engine="fabric", timeout_s=10.0).close()


@pytest.mark.mpi
@pytest.mark.parametrize("rails, chunk", [(2, None), (3, "16")], ids=["rails2", "rails3-chunk16"])
@pytest.mark.parametrize("priv", [0, None], ids=["over-only", "priv-full"])
@pytest.mark.parametrize("proxied_path", [True, False], ids=["proxied", "engine"])
def test_rows_striped_over_rails(num_ranks, mesh, monkeypatch, rails, chunk, priv, proxied_path):
    """JAX_MOE_A2A_RAILS: each rank's engine opens that many domains (shm: endpoints, each with its
    own progress thread) and the protocol splits every PRIV / OVER write of >= 64 KiB into one piece
    per rail (more with JAX_MOE_A2A_WRITE_CHUNK_KIB) and every COMB into one piece per rail, zero-
    length ones included: three steps (random, skewed, one hot expert) against the oracle, outputs
    poisoned, with rows of 4 KiB so that most PRIV / OVER writes are split; through the proxy and the
    host backend's own engine path. With the proxy its counters say PRIV / OVER writes and COMB
    writes were split."""
    monkeypatch.setenv("JAX_MOE_A2A_RAILS", str(rails))  # read when the engines are created
    if chunk:
        monkeypatch.setenv("JAX_MOE_A2A_WRITE_CHUNK_KIB", chunk)
    spec = a2a.Spec(num_experts=16, experts_per_token=4, hidden=2048, max_tokens_per_rank=48, recv_capacity=40,
                    dispatch_dtype=jnp.bfloat16)
    comm = a2a.init(spec, mesh, "ep", backend="host", proxied=proxied_path, max_private_tokens=priv, timeout_s=60.0,
                    engine="fabric")  # one process too: the in-process engine has one rail
    check_split_writes(comm, spec, num_ranks, proxied_path, split=("write_pieces", "comb_pieces"), rails=rails)


@pytest.mark.mpi
def test_rails_over_tcp(num_ranks, mesh, monkeypatch):
    """Two rails over tcp;ofi_rxm (loopback): every rail is a connection of its own, opened in rank
    order rail by rail (transfer::connect_in_order); the proxied exchange against the oracle, its
    COMB writes split over the rails (its PRIV / OVER writes are under the 64 KiB split size)."""
    monkeypatch.setenv("JAX_MOE_A2A_RAILS", "2")
    monkeypatch.setenv("JAX_MOE_A2A_PROVIDER", "tcp;ofi_rxm")
    monkeypatch.setenv("JAX_MOE_A2A_IFACE", "lo")
    spec = a2a.Spec(num_experts=8, experts_per_token=2, hidden=1024, max_tokens_per_rank=40,
                    dispatch_dtype=jnp.bfloat16)
    comm = a2a.init(spec, mesh, "ep", backend="host", proxied=True, engine="fabric", timeout_s=60.0)
    check_split_writes(comm, spec, num_ranks, proxied=True, split=("comb_pieces",), rails=2)


@pytest.mark.mpi
@pytest.mark.parametrize("node_size, priv", [(0, 1), (0, 0), (0, None), (2, None)],
                         ids=["all-via-engine-priv1", "all-via-engine-priv0", "all-via-engine-privfull",
                              "node2-hybrid"])
def test_proxy_counts_the_row_bytes_it_writes_each_rank(num_ranks, mesh, node_size, priv):
    """proxy_stats' row_bytes_to / comb_bytes_to: per destination rank, the bytes of dispatch rows
    (PRIV and OVER, split by a private block of one row, none, or every row) and of combine rows
    (COMB) the proxy wrote, over a step of fresh random inputs and one where odd ranks route nothing
    (routing "empty"): the oracle's routed rows times the proxy's row (Spec.token_bytes + token
    index and weight, padded to 16) and H * 2 bytes (bf16 out), rank by rank; node-local pairs
    (node_size 2) write nothing. And row_writes_to / comb_writes_to, the writes posted: a PRIV write
    only where a private row goes, an OVER write only where rows overflow the private block (an
    empty one is neither posted nor awaited), and one COMB write per remote rank and step, empty or
    not (its receiver cannot know the bytes)."""
    skip_unless_node_fits(node_size, num_ranks)
    from jax_moe_a2a import oracle
    spec = a2a.Spec(**BASE, dispatch_dtype=FP8, scale_block=32)
    comm = proxied(spec, mesh, priv=priv, node_size=node_size)
    seed = T.fresh_seed()
    L = spec.local_experts(num_ranks)
    rows = [[0] * num_ranks for _ in range(num_ranks)]  # rows[s][d]: rows rank s sent rank d, both steps
    writes = [[0] * num_ranks for _ in range(num_ranks)]  # PRIV and OVER writes s posted d, both steps
    for step, routing in enumerate(["random", "empty"]):
        inputs = T.make_inputs(spec, num_ranks, seed + step, routing=routing)
        T.check_all(comm, inputs, T.run_ops(comm, inputs, poison=True))
        for s, inp in enumerate(inputs):
            sent = [0] * num_ranks
            for e in np.asarray(inp.topk_ids)[oracle.routed_pairs(spec, inp)[0]]:
                sent[int(e) // L] += 1
            for d, n in enumerate(sent):
                rows[s][d] += n
                in_priv = n if priv is None else min(n, priv)
                writes[s][d] += (in_priv > 0) + (n - in_priv > 0)
    row = -(-(spec.token_bytes() + 8) // 16) * 16
    remote = lambda s, d: not node_size or s // node_size != d // node_size  # node_size 0: itself too
    # A step counts once its FREE went out, which may follow the outputs by a moment; its writes
    # were posted before.
    deadline = time.monotonic() + 10
    while True:
        stats = comm.proxy_stats()
        done = all(st["dispatches"] == 2 and st["combines"] == 2 for st in stats.values())
        if done or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    assert stats, "no proxy on this process's ranks"
    for r, st in stats.items():
        assert st["dispatches"] == 2 and st["combines"] == 2, (seed, r, st)
        want_d = [rows[r][d] * row if remote(r, d) else 0 for d in range(num_ranks)]
        want_c = [rows[d][r] * spec.hidden * 2 if remote(r, d) else 0 for d in range(num_ranks)]
        assert st["row_bytes_to"] == want_d, (seed, r, st["row_bytes_to"], want_d)
        assert st["comb_bytes_to"] == want_c, (seed, r, st["comb_bytes_to"], want_c)
        want_wd = [writes[r][d] if remote(r, d) else 0 for d in range(num_ranks)]
        want_wc = [2 if remote(r, d) else 0 for d in range(num_ranks)]
        assert st["row_writes_to"] == want_wd, (seed, r, st["row_writes_to"], want_wd)
        assert st["comb_writes_to"] == want_wc, (seed, r, st["comb_writes_to"], want_wc)
    comm.close()


def test_rails_must_be_a_small_count(num_ranks, mesh, monkeypatch):
    """JAX_MOE_A2A_RAILS outside 1..16 or not an integer is refused when the engines are created."""
    spec = a2a.Spec(num_experts=2 * num_ranks, experts_per_token=2, hidden=32, max_tokens_per_rank=4)
    for bad in ("0", "17", "1.5", "many"):
        monkeypatch.setenv("JAX_MOE_A2A_RAILS", bad)
        with pytest.raises(ValueError, match="JAX_MOE_A2A_RAILS"):
            a2a.init(spec, mesh, "ep", backend="host", proxied=True, engine="fabric", timeout_s=10.0).close()


def test_write_chunk_must_be_a_size(num_ranks, mesh, monkeypatch):
    """A negative or unparsable JAX_MOE_A2A_WRITE_CHUNK_KIB, and a JAX_MOE_A2A_COMB_PIECES that is
    not an integer in [1, 64], are refused when the exchange is created, naming the variable; so is
    a chunk so small that a write's pieces times the ranks would not fit the immediate's 16-bit rank
    field (each piece carries piece * N + rank: 1-byte pieces of 32 rows of 2 KiB)."""
    spec = a2a.Spec(num_experts=2 * num_ranks, experts_per_token=2, hidden=32, max_tokens_per_rank=4)
    wide = a2a.Spec(num_experts=2 * num_ranks, experts_per_token=2, hidden=1024, max_tokens_per_rank=16)
    for var, bad, s, why in [("WRITE_CHUNK_KIB", "-1", spec, "expected"),
                             ("WRITE_CHUNK_KIB", "lots", spec, "expected"),
                             ("COMB_PIECES", "0", spec, "expected an integer"),
                             ("COMB_PIECES", "2.5", spec, "expected an integer"),
                             ("COMB_PIECES", "65", spec, "expected an integer"),
                             ("WRITE_CHUNK_KIB", "0.001", wide, "would go in .* pieces")]:
        monkeypatch.setenv("JAX_MOE_A2A_" + var, bad)
        with pytest.raises(ValueError, match=f"JAX_MOE_A2A_{var}=.*{why}"):
            proxied(s, mesh, timeout_s=10.0).close()
        monkeypatch.delenv("JAX_MOE_A2A_" + var)


@pytest.mark.parametrize("pipeline", ["peer", "off"])
def test_proxy_timeline_cuts_each_transfer_into_parts(mesh, num_ranks, tmp_path, monkeypatch, pipeline):
    """JAX_MOE_A2A_PROXY_TIMELINE (cc/proxy/timeline.h): each proxy writes its steps when the
    communicator closes, one file per local rank, and benchmarks/benchlib/proxy_timeline.py cuts
    every landed dispatch and combine into parts that are never negative and add up to its transfer
    (the proxy's counts_to_landed / comb_to_landed, which the stats' sums must match; a combine's
    posting comes before its transfer starts). One process
    (the files of the other processes of an mpirun would live in their own tmp_path)."""
    if jax.process_count() > 1:
        pytest.skip("one process: the check reads every rank's file from this process's tmp_path")
    monkeypatch.syspath_prepend(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    from benchlib import proxy_timeline as pt
    prefix = str(tmp_path / "tl")
    monkeypatch.setenv("JAX_MOE_A2A_PROXY_TIMELINE", prefix)  # read when the proxies start
    monkeypatch.setenv("JAX_MOE_A2A_PROXY_PIPELINE", pipeline)
    comm = proxied_three_steps(mesh, num_ranks, seed=T.fresh_seed(), priv=1)
    stats = comm.proxy_stats()
    comm.close()
    by_rank = pt.read(prefix)
    assert sorted(by_rank) == list(range(num_ranks)), sorted(by_rank)
    for op, rows, parts, (ns_key, count_key) in (
            ("dispatch", pt.dispatch_parts(by_rank), pt.DISPATCH_PARTS, ("counts_to_landed_ns", "dispatches_landed")),
            ("combine", pt.combine_parts(by_rank), pt.COMBINE_PARTS, ("comb_to_landed_ns", "combines_landed"))):
        landed = sum(s[count_key] for s in stats.values())
        assert len(rows) == landed == 3 * num_ranks, (op, len(rows), landed)  # three steps, every rank
        for r in rows:
            assert all(r[k] >= 0 for k in parts), (op, r)
            within = parts if op == "dispatch" else parts[1:]  # a combine's transfer starts after its posting
            assert sum(r[k] for k in within) == pytest.approx(r["transfer"], abs=1e-3), (op, r)
        # the proxy's own clock of the same interval, summed over ranks and steps (its clock reads
        # lie a few instructions from the marks')
        total = sum(s[ns_key] for s in stats.values()) / 1e3
        assert sum(r["transfer"] for r in rows) == pytest.approx(total, rel=0.05, abs=50), (op, total)
    s = pt.summarize(by_rank)
    assert s["dispatch"]["steps"] == s["combine"]["steps"] == 3 * num_ranks
    assert any("transfer" in line for line in pt.describe(s))
    files = sorted(os.listdir(tmp_path))
    assert len(files) == num_ranks and all(f.startswith("tl.r") and f.endswith(".tsv") for f in files), files


def test_cuda_node_size_option():
    """The cuda backend's node_size / max_private_tokens / provider options (checked without a GPU)."""
    from jax_moe_a2a.backends.cuda import CudaBackend

    def opts(**kw):
        t = CudaBackend.transport(kw, 4)
        return t["node_size"], t["max_private_tokens"], t["provider"]

    if not os.environ.get("JAX_MOE_A2A_NODE_SIZE") and not os.environ.get("JAX_MOE_A2A_MAX_PRIVATE_TOKENS"):
        assert opts()[:2] == (4, -1)
    assert opts(node_size=1, max_private_tokens=0, provider="tcp;ofi_rxm") == (1, 0, "tcp;ofi_rxm")
    assert opts(node_size=8)[0] == 4  # at most every rank in one node
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="node_size"):
            opts(node_size=bad)
    with pytest.raises(ValueError, match="max_private_tokens"):
        opts(max_private_tokens=-1)


@pytest.mark.mpi
def test_proxy_times_its_posts(num_ranks, mesh):
    """proxy_stats' post_ns / post_blocked_ns (Engine::post_ns, post_blocked_ns): over the fabric
    engine (libfabric shm) the proxy's writes of a dispatch + combine step take time in posts
    (> 0), of which the part retrying on a full transmit queue is at most the whole; the local
    engine counts none. Results against the oracle, outputs poisoned."""
    spec = a2a.Spec(num_experts=2 * num_ranks, experts_per_token=2, hidden=64, max_tokens_per_rank=8)
    for engine in ("fabric", "local") if jax.process_count() == 1 else ("fabric",):
        comm = a2a.init(spec, mesh, "ep", backend="host", proxied=True, engine=engine, timeout_s=30.0)
        check_fresh_steps(comm, spec, num_ranks, 1)
        stats = comm.proxy_stats()
        comm.close()
        assert stats, "no proxy on this process's ranks"
        for r, st in stats.items():
            assert 0 <= st["post_blocked_ns"] <= st["post_ns"], (engine, r, st)
            assert (st["post_ns"] > 0) == (engine == "fabric"), (engine, r, st)


# (JAX_MOE_A2A_PROGRESS, JAX_MOE_A2A_POLL_PROGRESS): the default (the progress thread held polling
# through the proxy's transfers, the proxy's polls only reading what it delivered), a spinning
# progress thread, and the policy before the hold (backoff: the proxy's polls move the transport).
_PROGRESS_POLICIES = {"default": (None, None), "spin": ("spin", "0"), "backoff": ("backoff", None)}


@pytest.mark.mpi
@pytest.mark.parametrize("policy", sorted(_PROGRESS_POLICIES))
@pytest.mark.parametrize("staged", [False, True], ids=["registered", "staged"])
def test_proxy_progress_policies(num_ranks, mesh, monkeypatch, staged, policy):
    """Who moves the transport while the proxy transfers (the fabric engine): by default
    (JAX_MOE_A2A_PROGRESS=adaptive, JAX_MOE_A2A_POLL_PROGRESS=0) the proxy holds the engine's
    progress thread polling while a transfer is under way and its own polls only read what that
    thread delivered (over shm the provider's copy of an incoming message runs there); `spin` polls
    always; `backoff` leaves transfers to the proxy's polls. Each must move every arrival the proxy
    waits for: every op of two steps matches the oracle, outputs poisoned, rows staged in pieces too,
    nothing hangs. proxy_stats tells the policies apart: by default held polls, completions on the
    progress thread and no proxy poll that moved the transport; under backoff no held polls and the
    proxy's polls moving it."""
    mode, poll = _PROGRESS_POLICIES[policy]
    for name, value in (("JAX_MOE_A2A_PROGRESS", mode), ("JAX_MOE_A2A_POLL_PROGRESS", poll)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    if staged:
        monkeypatch.setenv("JAX_MOE_A2A_HOST_STAGED", "1")
        monkeypatch.setenv("JAX_MOE_A2A_WRITE_CHUNK_KIB", "0.25")
        monkeypatch.setenv("JAX_MOE_A2A_COMB_PIECES", "2")
    spec = a2a.Spec(num_experts=2 * num_ranks, experts_per_token=2, hidden=64, max_tokens_per_rank=8)
    comm = a2a.init(spec, mesh, "ep", backend="host", proxied=True, engine="fabric", max_private_tokens=1,
                    timeout_s=30.0)
    check_fresh_steps(comm, spec, num_ranks, 2)
    stats = comm.proxy_stats()
    comm.close()
    assert stats, "no proxy on this process's ranks"
    for r, st in stats.items():
        if policy == "backoff":
            assert st["progress_held_polls"] == 0, (r, st)
            assert st["progressing_polls"] > 0, (r, st)  # the proxy's polls moved the transport
        else:
            assert st["progress_held_polls"] > 0, (r, st)  # the proxy held it through its transfers
            assert st["progressing_polls"] == 0, (r, st)  # its polls only read the counters
        if policy == "default":
            assert st["progress_events"] > 0, (r, st)  # arrivals moved by the progress thread


def test_progress_policy_must_be_known(num_ranks, mesh, monkeypatch):
    """JAX_MOE_A2A_PROGRESS other than adaptive, spin or backoff is refused when the engines are
    created, naming the variable and the values it takes."""
    monkeypatch.setenv("JAX_MOE_A2A_PROGRESS", "fast")
    spec = a2a.Spec(num_experts=2 * num_ranks, experts_per_token=2, hidden=32, max_tokens_per_rank=4)
    with pytest.raises(Exception, match="JAX_MOE_A2A_PROGRESS=fast: expected 'adaptive', 'spin' or 'backoff'"):
        a2a.init(spec, mesh, "ep", backend="host", proxied=True, engine="fabric", timeout_s=10.0).close()


def test_poll_progress_must_be_0_or_1(num_ranks, mesh, monkeypatch):
    """JAX_MOE_A2A_POLL_PROGRESS other than 0 or 1 is refused when the engines are created, naming it."""
    monkeypatch.setenv("JAX_MOE_A2A_POLL_PROGRESS", "no")
    spec = a2a.Spec(num_experts=2 * num_ranks, experts_per_token=2, hidden=32, max_tokens_per_rank=4)
    with pytest.raises(Exception, match="JAX_MOE_A2A_POLL_PROGRESS"):
        a2a.init(spec, mesh, "ep", backend="host", proxied=True, engine="fabric", timeout_s=10.0).close()
