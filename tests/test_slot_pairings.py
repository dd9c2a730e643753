"""Every pairing of dispatch slot and combine slot the contract allows, against the NumPy oracle,
on every backend (and the host backend's proxied mode, every pair through the engine and with
node-local pairs), in one process and under mpirun.

`combine_send(y, got, slot=...)` may use another free slot than the dispatch's: the combine must
still put each row at the offsets of *its* dispatch. Until 2026-12-04 the host backend (and the
proxy that also serves the cuda backend's inter-node path) read the combine offsets of the
combine's slot, a snapshot of whatever dispatch ran there last: silently wrong outputs. The slot
tests before this file always combined on the dispatch's own slot, so none saw it.

Cases (Spec.slots = 3; each compiled step runs twice on fresh inputs, epochs advancing):
  cross-d{d}-c{c}: one dispatch on slot d, its combine on slot c, for every (d, c);
  two-in-flight-{order}: dispatches A (slot 0) and B (slot 1) in flight together, then B's and
    A's combines in either order, the first one on the third slot (2);
  four-slots: slots = 4, dispatches on 3 and 1 in flight, combined on 0 and 2.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_moe_a2a as a2a
from jax_moe_a2a import oracle
from jax_moe_a2a import testing as T

from conftest import BACKENDS, xla_collectives_refused

# (id, backend, init options); the host backend's proxied mode runs the proxy thread's code path.
VARIANTS = [(b, b, {}) for b in BACKENDS]
if "host" in BACKENDS:
    VARIANTS += [("host-proxied", "host", dict(proxied=True, max_private_tokens=1)),
                 ("host-proxied-node2", "host", dict(proxied=True, max_private_tokens=1, node_size=2))]
BASE = dict(num_experts=16, experts_per_token=3, hidden=64, max_tokens_per_rank=8)


def _comm(variant, mesh, num_ranks, slots):
    name, backend, opts = variant
    if backend in ("reference", "ragged") and xla_collectives_refused():
        pytest.skip("XLA collectives refuse several processes on one GPU")
    if opts.get("node_size") and (jax.local_device_count() % opts["node_size"] or opts["node_size"] >= num_ranks):
        pytest.skip(f"node_size {opts['node_size']} does not fit {jax.local_device_count()} device(s) per process")
    if BASE["num_experts"] % num_ranks:
        pytest.skip(f"{BASE['num_experts']} experts over {num_ranks} ranks")
    spec = a2a.Spec(**BASE, slots=slots)
    return a2a.init(spec, mesh, "ep", backend=backend, timeout_s=30, **opts)


def _run(comm, mesh, per_rank, num_batches, seed):
    """per_rank(*[x, ids, w, num_tokens [1]] * num_batches) -> tuple of [T, H] outputs, one per
    batch, each the combine of batch i with expert_fn_jax; checked against the oracle, two steps
    (all tokens, then 5 per rank)."""
    spec, n = comm.spec, comm.num_ranks
    f = jax.jit(T.shard_map(lambda *a: tuple(o[None] for o in per_rank(*a)), mesh=mesh,
                            in_specs=(P("ep"),) * (4 * num_batches), out_specs=P("ep")))
    for step in range(2):
        batches = [T.make_inputs(spec, n, seed + 31 * step + 7 * i, num_tokens=[None, 5][step],
                                 routing=["random", "skewed"][(i + step) % 2], minus_one_frac=0.1)
                   for i in range(num_batches)]
        args = [T.stack_global(mesh, "ep", [np.atleast_1d(np.asarray(getattr(r, k), np.int32 if k == "num_tokens" else None))
                                            for r in inp])
                for inp in batches for k in ("x", "topk_ids", "topk_weights", "num_tokens")]
        T.poison_devices(mesh)
        outs = f(*args)
        for inp, out in zip(batches, outs):
            want = oracle.combine(spec, inp, T.expert_fn_np, np.dtype(jnp.bfloat16))
            for r, v in T.local_ranks_of(out).items():
                T.check_combine(spec, r, want[r], v)


def _experts(comm, got):
    return T.expert_fn_jax(comm.spec, comm.num_ranks, got, jnp.bfloat16)


@pytest.mark.mpi
@pytest.mark.parametrize("d, c", list(itertools.product(range(3), range(3))), ids=lambda v: str(v))
@pytest.mark.parametrize("variant", VARIANTS, ids=[v[0] for v in VARIANTS])
def test_combine_on_another_slot(variant, d, c, mesh, num_ranks):
    comm = _comm(variant, mesh, num_ranks, slots=3)

    def per_rank(x, i, w, m):
        got = comm.dispatch_recv(comm.dispatch_send(x, i, w, m[0], slot=d))
        return (comm.combine_recv(comm.combine_send(_experts(comm, got), got, slot=c)),)

    _run(comm, mesh, per_rank, 1, 100 + 3 * d + c)
    comm.close()


@pytest.mark.mpi
@pytest.mark.parametrize("b_first", [True, False], ids=["b-then-a", "a-then-b"])
@pytest.mark.parametrize("variant", VARIANTS, ids=[v[0] for v in VARIANTS])
def test_two_in_flight_combined_in_either_order(variant, b_first, mesh, num_ranks):
    comm = _comm(variant, mesh, num_ranks, slots=3)

    def per_rank(xa, ia, wa, ma, xb, ib, wb, mb):
        ga = comm.dispatch_recv(comm.dispatch_send(xa, ia, wa, ma[0], slot=0))
        gb = comm.dispatch_recv(comm.dispatch_send(xb, ib, wb, mb[0], slot=1))
        first, second = (gb, ga) if b_first else (ga, gb)
        h1 = comm.combine_send(_experts(comm, first), first, slot=2)  # the free third slot
        o1 = comm.combine_recv(h1)
        o2 = comm.combine_recv(comm.combine_send(_experts(comm, second), second))  # its own slot
        return (o2, o1) if b_first else (o1, o2)

    _run(comm, mesh, per_rank, 2, 300 + b_first)
    comm.close()


@pytest.mark.mpi
@pytest.mark.parametrize("variant", VARIANTS, ids=[v[0] for v in VARIANTS])
def test_four_slots_crossed(variant, mesh, num_ranks):
    comm = _comm(variant, mesh, num_ranks, slots=4)

    def per_rank(xa, ia, wa, ma, xb, ib, wb, mb):
        ha = comm.dispatch_send(xa, ia, wa, ma[0], slot=3)
        hb = comm.dispatch_send(xb, ib, wb, mb[0], slot=1)
        ga, gb = comm.dispatch_recv(ha), comm.dispatch_recv(hb)
        ca = comm.combine_send(_experts(comm, ga), ga, slot=0)
        cb = comm.combine_send(_experts(comm, gb), gb, slot=2)
        return comm.combine_recv(ca), comm.combine_recv(cb)

    _run(comm, mesh, per_rank, 2, 500)
    comm.close()
