"""TransferEngine (cc/transfer) on its own: single-process (LocalEngine, two FabricEngines in one
process, error paths) and multi-process under mpirun (-n 2, -n 4) on shm and tcp;ofi_rxm.

    python -m pytest tests/test_transfer_engine.py
    mpirun --allow-run-as-root --oversubscribe -n 4 python -m pytest --color=no -m mpi \
        tests/test_transfer_engine.py

Every multi-process test is collective: all ranks run the same tests in the same order, each with
its own engines (namespaced KV keys), and ends with a barrier before closing.
"""

import contextlib
import random
import threading
import time

import numpy as np
import pytest

from jax_moe_a2a import transfer
from transfer_helpers import MPI_RANK, MPI_SIZE, PROVIDERS, connect, provider_iface, rank_bytes

pytestmark = pytest.mark.skipif(not transfer.available(), reason="built without libfabric")

T = 30.0  # generous wait timeout: a failure elsewhere ends in a TimeoutError, never a hang
needs_mpi = pytest.mark.skipif(MPI_SIZE < 2, reason="needs mpirun -n >= 2")
FINAL_TAG = 255


# --------------------------------------------------------------------------------------------------
# Multi-process tests (pytest -m mpi under mpirun)
# --------------------------------------------------------------------------------------------------

@contextlib.contextmanager
def connected(provider, name, **kwargs):
    """A Connection of all ranks; leaves with a barrier so nobody closes while a peer writes."""
    c = connect(provider, name=name, **kwargs)
    try:
        yield c
        c.engine.barrier_ranked(c.group(), FINAL_TAG, 0, T)
        c.engine.flush(T)
    finally:
        c.close()


@pytest.fixture(params=PROVIDERS)
def conn(request):
    with connected(request.param, request.node.name) as c:
        yield c


def leftover(e):
    """Unconsumed arrivals, except the closing barrier's (fast peers may have sent theirs)."""
    return {k: v for k, v in e.counts().items() if transfer.unpack_imm(k)[0] != FINAL_TAG}


def other_ranks(c):
    return [r for r in range(c.world_size) if r != c.rank]


@pytest.mark.mpi
@needs_mpi
@pytest.mark.parametrize("num_domains", [1, 2], ids=["1dom", "2dom"])
@pytest.mark.parametrize("provider", PROVIDERS)
def test_scatter_slices_offsets(request, provider, num_domains):
    with connected(provider, request.node.name, num_domains=num_domains) as c:
        assert c.engine.num_domains == num_domains
        _check_scatter(c)


def _slice(sender, receiver, n):
    """(src_offset, length, dst_offset) of sender's slice for receiver: all differ per pair."""
    length = 1 + (sender * 37 + receiver * 11) % 300
    src_offset = (receiver * 131 + sender * 7) % 700
    dst_offset = sender * 1024 + (receiver * 5 + sender) % 100
    return src_offset, length, dst_offset


def _check_scatter(c):
    e, n, me = c.engine, c.world_size, c.rank
    src = rank_bytes(me, 1024)
    dst = np.full(n * 1024, 0xAB, np.uint8)
    rsrc, rdst = c.register(src), c.register(dst)
    dsts = c.share(rdst)
    group = c.group(include_self=True)
    entries = []
    for i, r in enumerate(group.ranks):
        so, ln, do = _slice(me, r, n)
        entries.append((i, so, ln, dsts[r], do))
    random.Random(me).shuffle(entries)
    imm = transfer.pack_imm(1, 0, 0)
    e.scatter(group, rsrc, entries, imm)
    e.wait(imm, n, T)  # one arrival from every rank, ourselves included
    expected = np.full(n * 1024, 0xAB, np.uint8)
    for s in range(n):
        so, ln, do = _slice(s, me, n)
        expected[do:do + ln] = rank_bytes(s, 1024)[so:so + ln]
    np.testing.assert_array_equal(dst, expected)
    assert e.count(imm) == 0


@pytest.mark.mpi
@needs_mpi
def test_zero_length_entries_deliver_immediate(conn):
    e = conn.engine
    dst = np.full(64, 7, np.uint8)
    rdst = conn.register(dst)
    dsts = conn.share(rdst)
    src = conn.register(np.ones(64, np.uint8))
    group = conn.group()
    imm = transfer.pack_imm(2, 0, conn.rank)
    # "Nothing for you": zero bytes with or without a destination region.
    entries = [(i, 0, 0, dsts[r] if i % 2 else None, 0) for i, r in enumerate(group.ranks)]
    e.scatter(group, src, entries, imm)
    e.wait_ranks(2, 0, other_ranks(conn), T)
    assert (dst == 7).all()


@pytest.mark.mpi
@needs_mpi
def test_barrier_repeated(conn):
    e = conn.engine
    group = conn.group()
    for i in range(100):
        e.barrier(group, transfer.pack_imm(3, i & 1, 0), T)
    for i in range(9):
        e.barrier_ranked(group, 4, i % 256, T)
    # A barrier really waits: rank 0 arrives 0.3 s late, everyone else must wait for it. Timed
    # from before the barrier rank 0 leaves before its sleep, which it cannot leave before every
    # rank has entered it: at least 0.3 s on every rank whatever the scheduling (timed from after
    # it, a rank that left it 0.1 s after rank 0 on a loaded machine saw less than 0.2 s).
    t0 = time.monotonic()
    e.barrier_ranked(group, 4, 9, T)
    if conn.rank == 0:
        time.sleep(0.3)
    e.barrier(group, transfer.pack_imm(5, 0, 0), T)
    if conn.rank != 0:
        assert time.monotonic() - t0 > 0.29
    assert leftover(e) == {}


@pytest.mark.mpi
@needs_mpi
def test_counters(conn):
    e, me = conn.engine, conn.rank
    nxt = (me + 1) % conn.world_size
    src = conn.register(np.zeros(8, np.uint8))
    imm = transfer.pack_imm(6, 0, 0)
    for _ in range(3):
        e.write(nxt, src, 0, 0, None, 0, imm)
    e.flush(T)
    deadline = time.monotonic() + T
    while e.count(imm) < 3 and time.monotonic() < deadline:
        time.sleep(0.001)
    assert e.count(imm) == 3
    e.wait(imm, 2, T)  # consumes two
    assert e.count(imm) == 1
    with pytest.raises(transfer.TransferTimeoutError, match="1 of 2 arrivals"):
        e.wait(imm, 2, 0.2)  # not enough: nothing consumed
    assert e.count(imm) == 1
    e.wait(imm, 1, T)
    assert e.count(imm) == 0


@pytest.mark.mpi
@needs_mpi
def test_many_small_writes(conn):
    e, me, n = conn.engine, conn.rank, conn.world_size
    count = 5000
    dst = np.zeros((n, count), np.uint64)
    rdst = conn.register(dst)
    dsts = conn.share(rdst)
    vals = (np.arange(count, dtype=np.uint64) * 1000003 + me * 7919 + 1).astype(np.uint64)
    src = conn.register(vals)
    imm = transfer.pack_imm(7, 0, me)
    # At most `batch` writes per peer in flight, as the backends post. Unbounded, tcp;ofi_rxm on 4
    # processes / 2 cores once stalled with a transmit queue full for 30 s (1 run in 7); the
    # likely cause, both ranks of a pair connecting at once, is gone since connect_in_order
    # (unbounded: 10 of 10 runs passed afterwards), but the bound stays.
    batch = 1000
    for k in range(count):
        for r in other_ranks(conn):
            e.write(r, src, 8 * k, 8, dsts[r], 8 * (me * count + k), imm)
        if (k + 1) % batch == 0:
            e.flush(T)
    for r in other_ranks(conn):
        e.wait(transfer.pack_imm(7, 0, r), count, T)
        expect = (np.arange(count, dtype=np.uint64) * 1000003 + r * 7919 + 1).astype(np.uint64)
        np.testing.assert_array_equal(dst[r], expect)
    e.flush(T)
    assert e.pending() == 0


@pytest.mark.mpi
@needs_mpi
def test_out_of_order_arrivals(conn):
    e, me, n = conn.engine, conn.rank, conn.world_size
    k = 200
    dst = np.zeros((n, k), np.uint32)
    dsts = conn.share(conn.register(dst))
    vals = np.arange(k, dtype=np.uint32) + 1000 * me
    src = conn.register(vals)
    group = conn.group()
    # Every write carries its own immediate (tag 8, epoch = index, rank = sender); posted shuffled.
    order = list(range(k))
    random.Random(100 + me).shuffle(order)
    for j in order:
        entries = [(i, 4 * j, 4, dsts[r], 4 * (me * k + j)) for i, r in enumerate(group.ranks)]
        random.Random(j).shuffle(entries)
        e.scatter(group, src, entries, transfer.pack_imm(8, j, me))
    # Wait in yet another order: by peer (reversed), then by a different shuffle of indices.
    waits = [(r, j) for r in reversed(other_ranks(conn)) for j in range(k)]
    random.Random(200 + me).shuffle(waits)
    for r, j in waits:
        e.wait(transfer.pack_imm(8, j, r), 1, T)
    for r in other_ranks(conn):
        np.testing.assert_array_equal(dst[r], np.arange(k, dtype=np.uint32) + 1000 * r)


@pytest.mark.mpi
@needs_mpi
def test_timeouts(conn):
    e = conn.engine
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="0 of 1 arrivals"):
        e.wait(transfer.pack_imm(9, 9, 9), 1, 0.5)
    assert 0.45 < time.monotonic() - t0 < 3.0
    # The last rank never signals: everyone's wait_ranks names it.
    e.barrier_ranked(conn.group(), 12, 0, T)  # all start together
    last = conn.world_size - 1
    if conn.rank != last:
        e.signal(conn.group(include_self=True), transfer.pack_imm(10, 0, conn.rank))
    with pytest.raises(transfer.TransferTimeoutError, match=f"missing ranks: {last}$"):
        e.wait_ranks(10, 0, list(range(conn.world_size)), 0.5)
    # Nothing was lost by the failed wait: the arrivals are still there.
    for r in range(last):
        assert e.count(transfer.pack_imm(10, 0, r)) == 1


@pytest.mark.mpi
@needs_mpi
def test_descriptor_from_unknown_engine_refused(conn):
    e, me, n = conn.engine, conn.rank, conn.world_size
    # A second engine on every rank, never introduced to the others: its descriptors are refused.
    other = transfer.FabricEngine(e.provider, rank=me, world_size=n,
                                  iface=provider_iface(e.provider) or "")
    try:
        foreign = other.register_array(np.zeros(64, np.uint8))
        blobs = conn.all_gather("foreign", foreign.descriptor())
        for blob in blobs:
            with pytest.raises(transfer.TransferError, match="stale or forged descriptor"):
                e.remote(blob)
        # Its address cannot replace the known one either.
        addrs = conn.all_gather("foreign-address", other.address())
        nxt = (me + 1) % n
        with pytest.raises(transfer.TransferError, match="already added with another address"):
            e.add_peers([(nxt, addrs[nxt])])
        # The genuine descriptors still work.
        genuine = conn.share(conn.register(np.zeros(8, np.uint8)))
        assert [d.owner for d in genuine] == list(range(n))
    finally:
        other.close()


@pytest.mark.mpi
@needs_mpi
def test_concurrent_posting_threads(conn):
    e, me, n = conn.engine, conn.rank, conn.world_size
    threads_n, per = 4, 500
    dst = np.zeros((n, threads_n, per), np.uint32)
    dsts = conn.share(conn.register(dst))
    vals = np.arange(threads_n * per, dtype=np.uint32) + 7 * me
    src = conn.register(vals)
    errors = []

    def post(t):
        try:
            for j in range(per):
                for r in other_ranks(conn):
                    k = t * per + j
                    e.write(r, src, 4 * k, 4, dsts[r], 4 * (me * threads_n * per + k),
                            transfer.pack_imm(11, t, me))
        except Exception as ex:  # pragma: no cover - reported below
            errors.append(ex)

    ts = [threading.Thread(target=post, args=(t,)) for t in range(threads_n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors
    for r in other_ranks(conn):
        for t in range(threads_n):
            e.wait(transfer.pack_imm(11, t, r), per, T)
        np.testing.assert_array_equal(dst[r].ravel(), np.arange(threads_n * per, dtype=np.uint32) + 7 * r)


# --------------------------------------------------------------------------------------------------
# Single-process tests
# --------------------------------------------------------------------------------------------------

def test_pack_imm():
    imm = transfer.pack_imm(0xAB, 0xCD, 0x1234)
    assert imm == 0xABCD1234
    assert transfer.unpack_imm(imm) == (0xAB, 0xCD, 0x1234)
    with pytest.raises(ValueError, match="8, 8 and 16 bits"):
        transfer.pack_imm(256, 0, 0)
    with pytest.raises(ValueError):
        transfer.pack_imm(0, 0, 1 << 16)


def test_unknown_provider_is_a_clear_error():
    with pytest.raises(transfer.TransferError, match=r"provider='no-such-provider'.*shm"):
        transfer.FabricEngine("no-such-provider")
    with pytest.raises(transfer.TransferError, match="no domain named nope0"):
        transfer.FabricEngine("tcp;ofi_rxm", iface="nope0")
    with pytest.raises(ValueError, match="rank=3"):
        transfer.FabricEngine("shm", rank=3, world_size=2)


def test_provider_from_env(monkeypatch):
    monkeypatch.setenv("JAX_MOE_A2A_PROVIDER", "no-such-provider-from-env")
    with pytest.raises(transfer.TransferError, match="no-such-provider-from-env"):
        transfer.FabricEngine()
    monkeypatch.delenv("JAX_MOE_A2A_PROVIDER")
    with transfer.FabricEngine() as e:
        assert e.provider == "shm"


def _pair(provider, num_domains=1):
    iface = provider_iface(provider) or ""
    e = [transfer.FabricEngine(provider, num_domains, r, 2, iface) for r in range(2)]
    for x in e:
        x.add_peers([(r, e[r].address()) for r in range(2)])
    return e


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("num_domains", [1, 2], ids=["1dom", "2dom"])
def test_fabric_pair_in_one_process(provider, num_domains):
    e0, e1 = _pair(provider, num_domains)
    try:
        assert e0.num_domains == num_domains
        src = rank_bytes(0, 4096)
        dst = np.zeros(8192, np.uint8)
        r0, r1 = e0.register_array(src), e1.register_array(dst)
        d1 = e0.remote(r1.descriptor())
        assert (d1.owner, d1.size, d1.num_domains) == (1, 8192, num_domains)
        e0.write(1, r0, 100, 3000, d1, 5000, 42)
        e1.wait(42, 1, T)
        np.testing.assert_array_equal(dst[5000:8000], src[100:3100])
        assert not dst[:5000].any() and not dst[8000:].any()
        # scatter through a group with ourselves in it (self writes are local copies)
        mine = np.zeros(16, np.uint8)
        rmine = e0.register_array(mine)  # a region lives as long as its handle
        d0 = e0.remote(rmine.descriptor())
        g = e0.peer_group([1, 0])
        e0.scatter(g, r0, [(0, 0, 16, d1, 0), (1, 16, 16, d0, 0)], 43)
        e1.wait(43, 1, T)
        e0.wait(43, 1, T)
        np.testing.assert_array_equal(dst[:16], src[:16])
        np.testing.assert_array_equal(mine, src[16:32])
        # barrier between two threads
        g1 = e1.peer_group([0])
        t = threading.Thread(target=e1.barrier, args=(g1, 44, T))
        t.start()
        e0.barrier(e0.peer_group([1]), 44, T)
        t.join()
        e0.flush(T)
        e1.flush(T)
    finally:
        e0.close()
        e1.close()


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("domains", [(3, 3), (3, 2), (1, 2)], ids=["3to3", "3to2", "1to2"])
def test_write_on_every_rail(provider, domains):
    """write_on(rail, ...) (the striping of the inter-node protocol, JAX_MOE_A2A_RAILS): every rail,
    also past the domain count (rail % num_domains) and between engines of different domain counts,
    delivers its slice and its immediate; a negative rail is refused. The in-process engine has one
    rail (write)."""
    iface = provider_iface(provider) or ""
    e = [transfer.FabricEngine(provider, domains[r], r, 2, iface) for r in range(2)]
    for x in e:
        x.add_peers([(r, e[r].address()) for r in range(2)])
    e0, e1 = e
    try:
        src = rank_bytes(0, 8 * 512)
        dst = np.zeros(8 * 512, np.uint8)
        r0, r1 = e0.register_array(src), e1.register_array(dst)
        d1 = e0.remote(r1.descriptor())
        for rail in range(7):
            e0.write_on(rail, 1, r0, rail * 512, 512, d1, rail * 512, 50 + rail)
        e0.write_on(7, 1, r0, 0, 0, None, 0, 57)  # an immediate alone
        for rail in range(8):
            e1.wait(50 + rail, 1, T)
        np.testing.assert_array_equal(dst[:7 * 512], src[:7 * 512])
        assert not dst[7 * 512:].any()
        with pytest.raises(ValueError, match="rail -1"):
            e0.write_on(-1, 1, r0, 0, 8, d1, 0, 58)
        e0.flush(T)
    finally:
        e0.close()
        e1.close()
    local = transfer.local_engines(2)
    try:
        a = np.arange(64, dtype=np.uint8)
        b = np.zeros(64, np.uint8)
        ra, rb = local[0].register_array(a), local[1].register_array(b)
        local[0].write_on(5, 1, ra, 0, 64, local[0].remote(rb.descriptor()), 0, 9)
        local[1].wait(9, 1, T)
        np.testing.assert_array_equal(a, b)
    finally:
        for x in local:
            x.close()


def test_unknown_and_forged_descriptors_refused():
    e = transfer.FabricEngine("shm", rank=0, world_size=4)
    stranger = transfer.FabricEngine("shm", rank=1, world_size=4)
    impostor = transfer.FabricEngine("shm", rank=2, world_size=4)
    try:
        buf = np.zeros(64, np.uint8)
        blob = stranger.register_array(buf).descriptor()
        with pytest.raises(transfer.TransferError, match="unknown peer rank 1"):
            e.remote(blob)
        with pytest.raises(transfer.TransferError, match="bad magic"):
            e.remote(b"\x00" * 64)
        with pytest.raises(transfer.TransferError, match="truncated"):
            e.remote(blob[:20])
        e.add_peers([(1, stranger.address())])
        assert e.remote(blob).owner == 1  # known now
        # A descriptor claiming rank 1 from another engine instance (forged / stale).
        forged = bytearray(impostor.register_array(buf).descriptor())
        forged[8:12] = (1).to_bytes(4, "little")
        with pytest.raises(transfer.TransferError, match="stale or forged"):
            e.remote(bytes(forged))
        # Addresses: another rank's address given for rank 3, or a rank out of range.
        with pytest.raises(transfer.TransferError, match="is rank 2's"):
            e.add_peers([(3, impostor.address())])
        with pytest.raises(IndexError):
            e.add_peers([(7, impostor.address())])
        # Writes to a rank that was never added.
        src = e.register_array(np.zeros(8, np.uint8))
        with pytest.raises(transfer.TransferError, match="rank 2 is not a peer"):
            e.write(2, src, 0, 0, None, 0, 1)
        with pytest.raises(transfer.TransferError, match="rank 3 is not a peer"):
            e.peer_group([1, 3])
    finally:
        for x in (e, stranger, impostor):
            x.close()


def test_bounds_and_argument_errors():
    e0, e1 = _pair("shm")
    try:
        r0 = e0.register_array(np.zeros(100, np.uint8))
        d1 = e0.remote(e1.register_array(np.zeros(50, np.uint8)).descriptor())
        with pytest.raises(IndexError, match="exceeds the region's 50 bytes"):
            e0.write(1, r0, 0, 51, d1, 0, 1)
        with pytest.raises(IndexError, match="source slice"):
            e0.write(1, r0, 90, 20, d1, 0, 1)
        with pytest.raises(ValueError, match="need a destination"):
            e0.write(1, r0, 0, 8, None, 0, 1)
        with pytest.raises(transfer.TransferError, match="belongs to rank 1"):
            e0.write(0, r0, 0, 8, d1, 0, 1)  # rank 1's region used for a write to rank 0
        g = e0.peer_group([1])
        with pytest.raises(IndexError, match="group member 1 of a group of 1"):
            e0.scatter(g, r0, [(1, 0, 0, None, 0)], 1)
        # nothing was posted by the failed scatter: validation comes first
        with pytest.raises(IndexError):
            e0.scatter(g, r0, [(0, 0, 0, None, 0), (0, 0, 99, d1, 0)], 77)
        assert e1.count(77) == 0
        with pytest.raises(ValueError, match="appears twice"):
            e0.peer_group([1, 1])
        with pytest.raises(transfer.TransferError, match="FI_HMEM"):
            e0.register_ptr(r0.address, 64, memory="cuda")
        with pytest.raises(ValueError, match="memory kind"):
            e0.register_ptr(r0.address, 64, memory="tpu")
    finally:
        e0.close()
        e1.close()


def test_register_refuses_copies_and_readonly_arrays():
    with transfer.connect("shm", transfer.DictKV(), name="register-checks") as c:
        with pytest.raises(ValueError, match="C-contiguous"):
            c.register(np.zeros((4, 4))[:, ::2])
        ro = np.zeros(8)
        ro.setflags(write=False)
        with pytest.raises(ValueError, match="writeable"):
            c.register(ro)
        with pytest.raises(TypeError):  # the binding itself never converts (no hidden copy)
            c.engine.register_array(np.zeros((4, 4))[:, ::2])
        r = c.register(np.zeros(16, np.float32))
        assert r.size == 64 and r.memory == "host"


def test_close_deregisters_and_refuses_calls():
    e0, e1 = _pair("shm")
    r0 = e0.register_array(np.zeros(8, np.uint8))
    g = e0.peer_group([1])
    r0.close()
    assert r0.closed
    with pytest.raises(transfer.TransferError, match="source region is closed"):
        e0.write(1, r0, 0, 0, None, 0, 1)
    e0.signal(g, 1)
    e1.wait(1, 1, T)
    keep = e0.register_array(np.zeros(8, np.uint8))
    e0.close()
    e0.close()  # idempotent
    assert keep.closed and e0.closed
    with pytest.raises(transfer.TransferError, match="closed"):
        e0.wait(1, 1, 0.1)
    with pytest.raises(transfer.TransferError, match="closed"):
        keep.descriptor()
    e1.close()


def test_timeout_is_prompt_and_a_timeout_error():
    with transfer.FabricEngine("shm") as e:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError) as info:
            e.wait(0xDEAD, 3, 0.5)
        assert 0.45 < time.monotonic() - t0 < 2.0
        assert isinstance(info.value, transfer.TransferTimeoutError)
        assert "0 of 3 arrivals" in str(info.value)
        with pytest.raises(transfer.TransferTimeoutError, match="missing ranks: 0"):
            e.wait_ranks(1, 2, [0], 0.1)


def test_threads_post_concurrently_in_one_process():
    e0, e1 = _pair("shm")
    try:
        n_threads, per = 4, 1000
        dst = np.zeros(n_threads * per, np.uint32)
        r1 = e1.register_array(dst)
        d1 = e0.remote(r1.descriptor())
        vals = np.arange(n_threads * per, dtype=np.uint32) * 3 + 1
        src = e0.register_array(vals)

        def post(t):
            for j in range(per):
                k = t * per + j
                e0.write(1, src, 4 * k, 4, d1, 4 * k, 100 + t)

        ts = [threading.Thread(target=post, args=(t,)) for t in range(n_threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        for t in range(n_threads):
            e1.wait(100 + t, per, T)
        np.testing.assert_array_equal(dst, vals)
        e0.flush(T)
    finally:
        e0.close()
        e1.close()


def test_local_engines_scatter_barrier_counters():
    n = 4
    engines = transfer.local_engines(n)
    assert [e.rank for e in engines] == list(range(n))
    dst = [np.full(n * 64, 0xAB, np.uint8) for _ in range(n)]
    src = [rank_bytes(r, 64) for r in range(n)]
    rdst = [engines[r].register_array(dst[r]) for r in range(n)]
    rsrc = [engines[r].register_array(src[r]) for r in range(n)]
    descs = [rd.descriptor() for rd in rdst]
    for e in engines:  # addresses are accepted (and checked) as for the fabric engine
        e.add_peers([(r, engines[r].address()) for r in range(n)])
    errors = []

    def rank_main(r):
        try:
            e = engines[r]
            remotes = [e.remote(d) for d in descs]
            g = e.peer_group(list(range(n)))
            for it in range(20):
                e.barrier(g, transfer.pack_imm(1, it & 1, 0), T)
            entries = [(p, p * 8, 8 + p, remotes[p], r * 64) for p in range(n)]
            random.Random(r).shuffle(entries)
            e.scatter(g, rsrc[r], entries, 5)
            e.wait(5, n, T)
            e.barrier_ranked(g, 2, 0, T)
        except Exception as ex:  # reported below
            errors.append(ex)

    ts = [threading.Thread(target=rank_main, args=(r,)) for r in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors, errors
    for r in range(n):
        expected = np.full(n * 64, 0xAB, np.uint8)
        for s in range(n):
            expected[s * 64:s * 64 + 8 + r] = src[s][r * 8:r * 8 + 8 + r]
        np.testing.assert_array_equal(dst[r], expected)
        assert engines[r].counts() == {}
    # Timeout, and a descriptor from another hub (an unknown peer) is refused.
    with pytest.raises(transfer.TransferTimeoutError, match="0 of 1"):
        engines[0].wait(99, 1, 0.2)
    other = transfer.local_engines(n)
    with pytest.raises(transfer.TransferError, match="refused"):
        engines[0].remote(other[1].register_array(np.zeros(4, np.uint8)).descriptor())
    with pytest.raises(transfer.TransferError, match="not rank 1 of this in-process hub"):
        engines[0].add_peers([(1, other[1].address())])
    # Writing into a closed peer fails cleanly.
    d3 = engines[0].remote(descs[3])
    engines[3].close()
    with pytest.raises(transfer.TransferError, match="closed"):
        engines[0].write(3, rsrc[0], 0, 4, d3, 0, 1)
    for e in engines + other:
        e.close()


def test_connect_single_process():
    with transfer.connect("shm", transfer.DictKV(), name="single") as c:
        assert (c.rank, c.world_size) == (0, 1)
        buf = np.zeros(32, np.uint8)
        (me,) = c.share(c.register(buf))
        src = c.register(np.arange(32, dtype=np.uint8))
        g = c.group(include_self=True)
        c.engine.scatter(g, src, [(0, 4, 8, me, 16)], 3)
        c.engine.wait(3, 1, T)
        np.testing.assert_array_equal(buf[16:24], np.arange(4, 12, dtype=np.uint8))


def test_shm_engine_starts_beside_stale_regions_of_its_pid():
    """A process killed without cleanup leaves its shm regions in /dev/shm, named (libfabric's
    default) after its pid, uid and endpoint count; a later process given the same pid must still
    get an engine, and its own region must go when it closes. Before the engine named its shm
    endpoints itself, libfabric 1.17 mapped such a stale file and faulted (or refused: EBUSY). In a
    child process, which fakes stale regions under its own pid."""
    import os
    import subprocess
    import sys
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    code = (
        "import os\n"
        "from jax_moe_a2a import transfer\n"
        "stale = [f'/dev/shm/{os.getpid()}:{os.getuid()}:{i}' for i in range(8)]\n"
        "before = set(os.listdir('/dev/shm'))\n"
        "try:\n"
        "    for n in stale:\n"
        "        with open(n, 'wb') as f:\n"
        "            f.truncate(1 << 20)\n"
        "    e = [transfer.FabricEngine('shm', 2, r, 2, '') for r in range(2)]\n"
        "    for x in e:\n"
        "        x.add_peers([(r, e[r].address()) for r in range(2)])\n"
        "    for x in e:\n"
        "        x.close()\n"
        "    left = set(os.listdir('/dev/shm')) - before - {os.path.basename(n) for n in stale}\n"
        "    print('LEFT', sorted(left))\n"
        "finally:\n"
        "    for n in stale:\n"
        "        os.unlink(n)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "LEFT []" in out.stdout, out.stdout


def test_hmem_engine_registers_device_memory_or_says_why():
    """hmem=True: a provider without FI_HMEM refuses to open with an error naming FI_HMEM. One with
    it opens, but FI_HMEM alone does not promise CUDA (Debian's libfabric offers it for host memory
    only): registering memory as CUDA fails there with a clear error, and host memory named CUDA
    is refused by every libfabric (never a region). The cuda backend's inter-node path probes with
    a real GPU buffer (JAX_MOE_A2A_STAGING=device)."""
    try:
        e = transfer.FabricEngine(provider="shm", hmem=True)
    except transfer.TransferError as err:
        assert "FI_HMEM" in str(err), err
        return
    try:
        host = e.register_array(np.zeros(4096, np.uint8))
        try:  # host memory named CUDA: refused by every libfabric (no CUDA, or not a device pointer)
            e.register_ptr(host.address, 64, memory="cuda")
        except transfer.TransferError as err:
            assert "cuda" in str(err), err
        else:
            pytest.fail("host memory registered as CUDA memory")
    finally:
        e.close()
