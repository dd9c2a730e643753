"""EP over one axis (or a tuple of axes) of a larger mesh: several independent EP groups side by
side, one per position along the other axes, every group with its own random inputs, every
group's outputs against the NumPy oracle (outputs poisoned beforehand).

Runs with 8 CPU devices in one process and, marked `mpi`, under mpirun (e.g. 4 processes x 2
devices: JAX_MOE_A2A_TEST_DEVICES=2 mpirun -n 4 python -m pytest -m mpi tests/test_multiaxis.py).
Mesh cases whose device count differs from the job's are skipped. The ragged backend runs through
the dense emulation of ragged_all_to_all where XLA lacks it (tests/ragged_emulation.py). The cuda
and nvshmem backends run here when available (the GPU checks); nvshmem only with one device per
process.
"""

import os
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import multihost_utils
from jax.sharding import Mesh, PartitionSpec as P

import jax_moe_a2a as a2a
from jax_moe_a2a import oracle
from jax_moe_a2a import testing as T
from jax_moe_a2a.comm import ep_groups
from ragged_emulation import emulated
from conftest import BACKENDS, PURE_JAX, xla_collectives_refused

# Under mpirun every process compiles every case: the multi-process suites run a subset (every
# mesh once, each variant on one mesh); JAX_MOE_A2A_MPI_ALL_CASES=1 runs them all (the GPU checks).
MPI_ALL_CASES = os.environ.get("JAX_MOE_A2A_MPI_ALL_CASES") == "1"
MPI = [pytest.mark.mpi]

FP8 = jnp.float8_e4m3fn
# Every backend this job can run, plus ragged through the emulation when XLA lacks its collective
# (unless JAX_MOE_A2A_TEST_BACKENDS names the backends to test).
MULTI_BACKENDS = list(BACKENDS) + ([] if "ragged" in BACKENDS or os.environ.get("JAX_MOE_A2A_TEST_BACKENDS")
                                   else ["ragged"])

# (id, mesh shape, mesh axis names, EP axis)
MESHES = [
    ("2x4-ep", (2, 4), ("dp", "ep"), "ep"),
    ("4x2-ep", (4, 2), ("dp", "ep"), "ep"),
    ("2x2x2-expert", (2, 2, 2), ("data", "expert", "tensor"), "expert"),
    ("2x2x2-data-expert", (2, 2, 2), ("data", "expert", "tensor"), ("data", "expert")),
    ("2x2x2-expert-data", (2, 2, 2), ("data", "expert", "tensor"), ("expert", "data")),  # not in mesh order
    ("2x2-ep", (2, 2), ("dp", "ep"), "ep"),  # for 4-device jobs
    ("2x1x2-data-expert", (2, 1, 2), ("data", "expert", "tensor"), ("data", "expert")),
]
MESH_IDS = [m[0] for m in MESHES]
MESH_BY_ID = {m[0]: m for m in MESHES}

BASE = dict(num_experts=16, experts_per_token=3, hidden=64, max_tokens_per_rank=12, scale_block=32)
# (id, spec overrides, run kwargs)
CASES = [
    ("bf16", {}, {}),
    ("fp8-expert-major-tp2", dict(dispatch_dtype=FP8, layout="expert_major", tp_size=2, recv_capacity=10), {}),
    ("one-shot", {}, dict(split=False)),
]


def make_mesh(mesh_id):
    _, shape, names, axis = MESH_BY_ID[mesh_id]
    if int(np.prod(shape)) != jax.device_count():
        pytest.skip(f"mesh {shape} needs {int(np.prod(shape))} devices, the job has {jax.device_count()}")
    return Mesh(np.array(jax.devices()).reshape(shape), names), axis


def make_comm(spec, mesh, axis, backend, **kw):
    if backend == "nvshmem" and jax.local_device_count() != 1:
        pytest.skip("nvshmem: one device per process")
    if backend in PURE_JAX and xla_collectives_refused():
        pytest.skip(f"{backend} needs XLA's collectives, which refuse processes sharing a GPU")
    if backend == "ragged" and "ragged" not in BACKENDS:
        with emulated():  # the communicator keeps the emulated collective
            return a2a.init(spec, mesh, axis, backend=backend, **kw)
    return a2a.init(spec, mesh, axis, backend=backend, **kw)


def data_axes(comm):
    """Mesh axes whose row-major flat index over a global array's leading dimension is
    group * N + rank (the other axes in mesh order, then the EP axes)."""
    return comm.group_axes + (comm.axis if isinstance(comm.axis, tuple) else (comm.axis,))


def group_inputs(spec, comm, seed, **kw):
    """Different random inputs for every EP group: [G][N] RankInputs."""
    return [T.make_inputs(spec, comm.num_ranks, seed + 7919 * g, **kw) for g in range(comm.num_groups)]


def by_member(comm, arr):
    """Global [G * N, ...] array -> {(group, rank): row} of this process's shards."""
    n = comm.num_ranks
    return {divmod(i, n): v for i, v in T.local_ranks_of(arr).items()}


def run_groups(comm, inputs, *, y_dtype=jnp.bfloat16, split=True):
    """dispatch -> toy expert -> combine on every rank of every group; {(group, rank): fields}."""
    spec, n, mesh = comm.spec, comm.num_ranks, comm.mesh
    axes = data_axes(comm)
    flat = [i for grp in inputs for i in grp]
    has_scale = flat[0].x_scale is not None
    args = T.global_args(mesh, flat, T.INPUT_FIELDS + (("x_scale",) if has_scale else ()), axes)

    def per_rank(x, ids, w, nt, *rest):
        xs = rest[0] if has_scale else None
        if split:
            got = comm.dispatch_recv(comm.dispatch_send(x, ids, w, nt, x_scale=xs))
        else:
            got = comm.dispatch(x, ids, w, nt, x_scale=xs)
        y = T.expert_fn_jax(spec, n, got, y_dtype)
        res = comm.combine_recv(comm.combine_send(y, got)) if split else comm.combine(y, got)
        fields = {"x": got.x, "group_sizes": got.group_sizes, "weights": got.weights, "src": got.src,
                  "num_dropped": got.num_dropped, "num_overflow": got.num_overflow, "out": res}
        if got.scale is not None:
            fields["scale"] = got.scale
        return jax.tree.map(lambda a: a[None], fields)

    f = jax.jit(T.shard_map(per_rank, mesh=mesh, in_specs=(P(axes),) * len(args), out_specs=P(axes)))
    T.poison_devices(mesh)
    per = {k: by_member(comm, v) for k, v in f(*args).items()}
    return {m: {k: per[k][m] for k in per} for m in sorted(per["out"])}


def check_groups(comm, inputs, results, y_dtype=jnp.bfloat16):
    spec, n = comm.spec, comm.num_ranks
    exact = T.exact_fp8_expected(comm)
    assert results, "no rank results in this process"
    mine = {(g, r) for g, ranks in comm.local_members().items() for r in ranks}
    assert set(results) == mine, f"results for {sorted(results)}, this process holds {sorted(mine)}"
    for g in sorted({g for g, _ in results}):
        want_d = oracle.dispatch(spec, inputs[g])
        want_c = oracle.combine(spec, inputs[g], T.expert_fn_np, np.dtype(y_dtype))
        for (gg, r), res in results.items():
            if gg != g:
                continue
            try:
                T.check_dispatch(spec, n, r, want_d[r], res, exact_fp8=exact)
                T.check_combine(spec, r, want_c[r], res["out"], exact_fp8=exact)
            except AssertionError as e:
                raise AssertionError(f"EP group {g}: {e}") from None


# ---- the groups' layout -----------------------------------------------------------------------

@pytest.mark.mpi
@pytest.mark.parametrize("mesh_id", MESH_IDS)
def test_groups_follow_axis_index(mesh_id):
    """Communicator.groups[g][r] is the device where axis_index(other axes) == g and
    axis_index(axis) == r (row-major over a tuple of axes, as JAX orders it)."""
    mesh, axis = make_mesh(mesh_id)
    others, groups = ep_groups(mesh, axis)

    def f(_):
        return jnp.stack([jax.lax.axis_index(others) if others else jnp.int32(0),
                          jax.lax.axis_index(axis)]).astype(jnp.int32)[None]

    names = tuple(mesh.axis_names)
    x = T.stack_global(mesh, names, [np.zeros(1, np.float32)] * mesh.size)
    out = jax.jit(T.shard_map(f, mesh=mesh, in_specs=P(names), out_specs=P(names)))(x)
    seen = set()
    for sh in out.addressable_shards:
        g, r = (int(v) for v in np.asarray(sh.data)[0])
        assert groups[g, r] == sh.device, f"device {sh.device}: axis_index gives group {g} rank {r}"
        seen.add((g, r))
    assert len(seen) == len(out.addressable_shards)
    assert groups.shape == (mesh.size // groups.shape[1], int(np.prod([mesh.shape[a] for a in
                                                                       (axis if isinstance(axis, tuple) else (axis,))])))


def test_axis_errors():
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("dp", "ep"))
    spec = a2a.Spec(**BASE)
    with pytest.raises(ValueError, match="not an axis"):
        a2a.init(spec, mesh, "tp", backend="reference")
    with pytest.raises(ValueError, match="twice"):
        a2a.init(spec, mesh, ("ep", "ep"), backend="reference")


# ---- every group against the oracle ------------------------------------------------------------

def _oracle_params():
    out = []
    for c in CASES:
        for m in MESH_IDS:
            mpi = MPI_ALL_CASES or c[0] == "bf16" or m in ("2x4-ep", "2x2-ep", "2x2x2-expert-data")
            out.append(pytest.param(m, *c, id=f"{c[0]}-{m}", marks=MPI if mpi else []))
    return out


@pytest.mark.parametrize("backend", MULTI_BACKENDS)
@pytest.mark.parametrize("mesh_id, case_id, spec_kw, run_kw", _oracle_params())
def test_groups_against_oracle(backend, mesh_id, case_id, spec_kw, run_kw):
    if backend == "ragged" and case_id != "bf16" and jax.process_count() > 1 and not MPI_ALL_CASES:
        pytest.skip("multi-process suites: ragged (pure JAX, like reference) only in the bf16 case")
    mesh, axis = make_mesh(mesh_id)
    n = ep_groups(mesh, axis)[1].shape[1]
    if n % spec_kw.get("tp_size", 1):
        pytest.skip(f"tp_size does not divide {n} ranks")
    spec = a2a.Spec(**{**BASE, **spec_kw})
    comm = make_comm(spec, mesh, axis, backend)
    assert comm.num_groups * comm.num_ranks == mesh.size
    seed = zlib.crc32(f"{mesh_id}/{case_id}".encode()) % 10**6
    inputs = group_inputs(spec, comm, seed, minus_one_frac=0.1)
    check_groups(comm, inputs, run_groups(comm, inputs, **run_kw))


@pytest.mark.mpi
@pytest.mark.parametrize("backend", MULTI_BACKENDS)
def test_groups_repeated_steps(backend):
    """Two communicators on one multi-axis mesh, each run twice with fresh inputs (buffers and
    per-group state reused; one communicator's groups never see the other's)."""
    mesh_id = "2x4-ep" if jax.device_count() == 8 else "2x2-ep"
    mesh, axis = make_mesh(mesh_id)
    spec = a2a.Spec(**BASE, dispatch_dtype=FP8)
    comms = [make_comm(spec, mesh, axis, backend), make_comm(spec, mesh, axis, backend)]
    for step in range(2):
        for i, comm in enumerate(comms):
            inputs = group_inputs(spec, comm, 500 + 10 * step + i, invalid_frac=0.05)
            check_groups(comm, inputs, run_groups(comm, inputs))


# ---- gradients: every backend against reference ------------------------------------------------

@pytest.mark.parametrize("backend", [b for b in MULTI_BACKENDS if b != "reference"])
@pytest.mark.parametrize("mesh_id", [pytest.param("2x4-ep", marks=MPI), "2x2x2-data-expert",
                                     pytest.param("2x2-ep", marks=MPI)])
def test_groups_grad_matches_reference(backend, mesh_id):
    mesh, axis = make_mesh(mesh_id)
    spec = a2a.Spec(**BASE, dispatch_dtype=jnp.float32, combine_dtype=jnp.float32)
    outs = {}
    for b in ("reference", backend):
        comm = make_comm(spec, mesh, axis, b, collect_stats=False)
        n, axes = comm.num_ranks, data_axes(comm)
        inputs = [i for grp in group_inputs(spec, comm, 77, minus_one_frac=0.1) for i in grp]
        # (group 0, rank 0) sends a pair (the first to arrive at its expert: kept): the gradients
        # are not all zero for any draw (num_tokens is 0 for 1 rank in 9)
        inputs[0] = T.with_a_routed_pair(spec, inputs[0])
        rng = np.random.default_rng(4)
        gout = [rng.standard_normal((spec.max_tokens_per_rank, spec.hidden)).astype(np.float32) for _ in inputs]

        def per_rank(x, ids, w, nt, gg, comm=comm, n=n):
            def loss(x, w):
                got = comm.dispatch(x, ids, w, nt)
                return jnp.sum(comm.combine(T.expert_fn_jax(spec, n, got, jnp.float32), got) * gg)
            dx, dw = jax.grad(loss, argnums=(0, 1))(x, w)
            return dx[None], dw[None]

        args = T.global_args(mesh, inputs, axis=axes) + [T.stack_global(mesh, axes, gout)]
        f = jax.jit(T.shard_map(per_rank, mesh=mesh, in_specs=(P(axes),) * 5, out_specs=P(axes)))
        outs[b] = [by_member(comm, a) for a in f(*args)]
    for name, want, got in zip(("dx", "dw"), outs["reference"], outs[backend]):
        assert set(want) == set(got) and want
        for m in want:
            np.testing.assert_allclose(got[m], want[m], rtol=1e-5, atol=1e-5, err_msg=f"(group, rank) {m}: {name}")
        # not all zero, over every process's members (under mpirun -n 4 a process holds one)
        local = max(float(np.abs(v).max(initial=0.0)) for v in want.values())
        assert multihost_utils.process_allgather(np.float32(local)).max() > 0
