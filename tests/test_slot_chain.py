"""Uses of one slot in one trace that share no data run one after another (slots.SlotChain): XLA
orders custom calls only through data, and two independent layers on one slot, which XLA:CPU
runs side by side, made the FFI backends wait for each other's FREE signals until timeout_s
(host: "dispatch_send (waiting for peers to free the slot) ... did not arrive"). Every backend,
oracle-checked on fresh inputs with poisoned devices."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import jax_moe_a2a as a2a
from jax_moe_a2a import oracle
from jax_moe_a2a import testing as T
from conftest import BACKENDS

pytestmark = pytest.mark.mpi

VARIANTS = list(BACKENDS) + (["host-proxied"] if "host" in BACKENDS else [])


def _init(spec, mesh, variant):
    # A timeout that ends the test (without the chain the first step timed out: it fails, it does
    # not hang), yet longer than one process can start its first step after another: the wait
    # includes the peers compiling the step, seconds apart under mpirun -n 4 on a loaded 2-core
    # machine (5 s left that to chance).
    if variant == "host-proxied":
        return a2a.init(spec, mesh, "ep", backend="host", proxied=True, timeout_s=20)
    return a2a.init(spec, mesh, "ep", backend=variant, timeout_s=20)


def _spec(n):
    return a2a.Spec(num_experts=2 * n, experts_per_token=2, hidden=32, max_tokens_per_rank=8, slots=2,
                    dispatch_dtype=jnp.float32, combine_dtype=jnp.float32)


def _inputs(spec, n, mesh, count):
    seed = T.fresh_seed()
    ins = [T.make_inputs(spec, n, seed + j, invalid_frac=0.05, minus_one_frac=0.05) for j in range(count)]
    args = []
    for inp in ins:
        args += T.global_args(mesh, inp)
    return ins, args


def _check(spec, ins, outs):
    for inp, out in zip(ins, outs, strict=True):
        want = oracle.combine(spec, inp, T.expert_fn_np, jnp.float32)
        for r, got in T.local_ranks_of(out).items():
            T.check_combine(spec, r, want[r], got)


def _run_and_check(comm, spec, mesh, per_rank, ins, args, steps=3):
    """`steps` runs of per_rank, each from poisoned memory and checked against the oracle; closes comm."""
    f = jax.jit(T.shard_map(per_rank, mesh=mesh, in_specs=(P("ep"),) * len(args),
                            out_specs=tuple(P("ep") for _ in ins)))
    try:
        for _ in range(steps):
            T.poison_devices(mesh)
            _check(spec, ins, jax.block_until_ready(f(*args)))
    finally:
        comm.close()


def _layer(comm, spec, n, x, i, w, nt, **kw):
    got = comm.dispatch(x, i, w, nt[0], **kw)
    return comm.combine(T.expert_fn_jax(spec, n, got, jnp.float32), got)[None]


@pytest.mark.parametrize("variant", VARIANTS)
def test_independent_layers_on_one_slot(variant, mesh):
    """Three layers on slot 0 whose inputs do not depend on each other (e.g. micro-batches given
    the same slot): each dispatch_send runs after the previous combine_recv on the slot."""
    n = mesh.size
    spec = _spec(n)
    comm = _init(spec, mesh, variant)
    ins, args = _inputs(spec, n, mesh, 3)

    def per_rank(*a):
        return tuple(_layer(comm, spec, n, *a[4 * j:4 * j + 4], slot=0) for j in range(3))

    _run_and_check(comm, spec, mesh, per_rank, ins, args)


@pytest.mark.parametrize("variant", VARIANTS)
def test_independent_uses_after_a_combine_on_another_slot(variant, mesh):
    """A: dispatch on slot 0, combine onto slot 1 (slot 0 is free from A's combine_send, slot 1
    busy until A's combine_recv). B, independent of A: a layer on slot 1 (after A's combine_recv).
    C, independent of both: a layer on slot 0 (after A's combine_send)."""
    n = mesh.size
    spec = _spec(n)
    comm = _init(spec, mesh, variant)
    ins, args = _inputs(spec, n, mesh, 3)

    def per_rank(xa, ia, wa, na, xb, ib, wb, nb, xc, ic, wc, nc):
        got = comm.dispatch(xa, ia, wa, na[0], slot=0)
        ha = comm.combine_send(T.expert_fn_jax(spec, n, got, jnp.float32), got, slot=1)
        oc = _layer(comm, spec, n, xc, ic, wc, nc, slot=0)
        oa = comm.combine_recv(ha)[None]
        ob = _layer(comm, spec, n, xb, ib, wb, nb, slot=1)
        return oa, ob, oc

    _run_and_check(comm, spec, mesh, per_rank, ins, args)
