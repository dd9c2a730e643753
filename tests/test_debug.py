"""debug=True: a failed check ends every rank promptly, on every backend, and surfaces as
`DroppedRowsError` through `comm.checked()` / `comm.check()`."""

import dataclasses
import time

import numpy as np
import pytest

import jax_moe_a2a as a2a
from jax_moe_a2a import testing as T
from conftest import subprocess_env

BACKENDS = [b for b in ("reference", "host") if b in a2a.available_backends()]


def _all_to_rank0(spec, num_ranks, seed=1):
    """Every pair of every rank routed to rank 0's experts: rank 0 overflows, the others get nothing
    (any draw: the seed only picks x and the weights)."""
    inputs = T.make_inputs(spec, num_ranks, seed, num_tokens=spec.max_tokens_per_rank)
    for i in inputs:
        i.topk_ids[:] = np.arange(spec.experts_per_token, dtype=np.int32)
    return inputs


def _compiled(comm, inputs):
    """Compiles and runs run_ops' step on `inputs` with no pair routed (every id -1: nothing
    dropped, nothing past capacity), so that a timed run that follows measures the run alone,
    not XLA compiling the step (seconds, many more on a loaded machine)."""
    T.run_ops(comm, [dataclasses.replace(i, topk_ids=np.full_like(i.topk_ids, -1)) for i in inputs])


def _spec(**kw):
    return a2a.Spec(**{**dict(num_experts=4, experts_per_token=2, hidden=32, max_tokens_per_rank=4,
                              recv_capacity=1), **kw})


@pytest.mark.timeout(90)
@pytest.mark.parametrize("backend", BACKENDS)
def test_overflow_on_one_rank_ends_every_rank_promptly(backend):
    """Two devices of one process, recv_capacity=1, everything to rank 0. Before, rank 0 stopped at
    the check and rank 1 (no overflow of its own) went on into the combine and waited for rank 0:
    the host backend's step did not return within 120 s (timeout_s 60 per wait)."""
    mesh = T.make_mesh(2)
    comm = a2a.init(_spec(), mesh, "ep", backend=backend, debug=True, timeout_s=60)
    inputs = _all_to_rank0(comm.spec, 2)
    _compiled(comm, inputs)
    t0 = time.monotonic()
    with pytest.raises(a2a.DroppedRowsError, match="past recv_capacity"):
        with comm.checked():
            T.run_ops(comm, inputs)
    assert time.monotonic() - t0 < 20, "a rank without overflow waited for the one that stopped"


# One bad id on rank 0 only, on every backend: test_ops.py::test_debug_stops_every_rank_when_one_drops.


@pytest.mark.mpi
@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", BACKENDS)
def test_overflow_ends_every_rank_every_process(backend, mesh, num_ranks):
    """The same over every global device (under mpirun: every process stops, none waits)."""
    spec = _spec(num_experts=2 * num_ranks)
    comm = a2a.init(spec, mesh, "ep", backend=backend, debug=True, timeout_s=60)
    inputs = _all_to_rank0(spec, num_ranks)
    _compiled(comm, inputs)
    t0 = time.monotonic()
    with pytest.raises(a2a.DroppedRowsError):
        with comm.checked():
            T.run_ops(comm, inputs)
    assert time.monotonic() - t0 < 30


def test_bare_except_with_checked(mesh):
    """`except a2a.DroppedRowsError` catches the failed step when it runs inside comm.checked();
    the runtime error is its cause; nothing is left for check() or for JAX's exit."""
    import jax
    comm = a2a.init(_spec(num_experts=2 * mesh.size), mesh, "ep", backend="reference", debug=True)
    caught = None
    try:
        with comm.checked():
            T.run_ops(comm, _all_to_rank0(comm.spec, mesh.size))
    except a2a.DroppedRowsError as e:
        caught = e
    assert caught is not None and isinstance(caught.__cause__, jax.errors.JaxRuntimeError)
    assert comm.check() is None
    jax.effects_barrier()  # JAX's record of the failed step is gone: nothing raises again


def test_check_raises_what_the_step_recorded(mesh):
    """Without checked(): the step raises JaxRuntimeError; comm.check() then raises the
    DroppedRowsError once. A clean step records nothing."""
    import jax
    from jax_moe_a2a import runtime
    comm = a2a.init(_spec(num_experts=2 * mesh.size), mesh, "ep", backend="reference", debug=True)
    with pytest.raises(jax.errors.JaxRuntimeError):
        T.run_ops(comm, _all_to_rank0(comm.spec, mesh.size))
    runtime.forget_failed_effects()
    with pytest.raises(a2a.DroppedRowsError, match="recv_capacity"):
        comm.check()
    assert comm.check() is None
    ok = a2a.init(_spec(num_experts=2 * mesh.size, recv_capacity=None), mesh, "ep", backend="reference",
                  debug=True)
    with ok.checked():
        T.run_ops(ok, T.make_inputs(ok.spec, mesh.size, 2))  # any draw: no bad id, no capacity
    assert ok.check() is None


def test_checked_passes_other_errors_through(mesh):
    comm = a2a.init(_spec(num_experts=2 * mesh.size), mesh, "ep", backend="reference", debug=True)
    with pytest.raises(KeyError):
        with comm.checked():
            raise KeyError("not ours")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", BACKENDS)
def test_num_tokens_outside_the_range_is_counted_and_raised_under_debug(backend):
    """Issue 33.7: a num_tokens device array above Spec.max_tokens_per_rank (or below 0) was
    clamped silently. It is still clamped (the results are those of T, or of 0), counted in
    stats()['clamped'] (once per rank and dispatch), and debug=True raises naming it."""
    import jax
    mesh = T.make_mesh(2)
    spec = _spec(recv_capacity=None)
    t = spec.max_tokens_per_rank
    inputs = T.make_inputs(spec, 2, T.fresh_seed(), num_tokens=t)
    bad = [dataclasses.replace(inputs[0], num_tokens=t + 5), dataclasses.replace(inputs[1], num_tokens=-1)]
    comm = a2a.init(spec, mesh, "ep", backend=backend, collect_stats=True)
    res = T.run_ops(comm, bad)
    jax.effects_barrier()
    assert comm.stats()["clamped"] == 2 and comm.stats()["dispatches"] == 2
    T.check_all(comm, [inputs[0], dataclasses.replace(inputs[1], num_tokens=0)], res)
    ok = T.run_ops(comm, inputs)  # in range: nothing counted
    jax.effects_barrier()
    assert comm.stats()["clamped"] == 2
    T.check_all(comm, inputs, ok)
    dbg = a2a.init(spec, mesh, "ep", backend=backend, debug=True, timeout_s=20)
    with pytest.raises(a2a.DroppedRowsError, match=r"num_tokens (9|-1) .*outside \[0, 4\]"):
        with dbg.checked():
            T.run_ops(dbg, bad)


_ONE_BAD_ID = """
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
import jax_moe_a2a as a2a
from jax_moe_a2a import testing as T
mesh = T.make_mesh(4)
spec = a2a.Spec(num_experts=8, experts_per_token=2, hidden=32, max_tokens_per_rank=4)
comm = a2a.init(spec, mesh, "ep", backend=sys.argv[1], debug=True, timeout_s=20)
inputs = T.make_inputs(spec, 4, 1, num_tokens=4, minus_one_frac=0.0, invalid_frac=0.0)  # any draw: one bad id
inputs[2].topk_ids[3, 1] = 99
try:
    with comm.checked():
        T.run_ops(comm, inputs)
except a2a.DroppedRowsError as e:
    print("CAUGHT:", e)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", BACKENDS)
def test_one_bad_id_gives_one_concise_error(backend, tmp_path):
    """Issue 33.5: one bad expert id gave ~100 lines on stderr (every rank's callback traceback,
    logged by JAX, and a log line of ours per rank) and a vague message ("dispatch dropped 0
    pair(s) ... on this rank, 1 in all ranks"). Now: nothing on stderr, and the error names the
    rank, the token and the id."""
    import subprocess
    import sys
    script = tmp_path / "one_bad_id.py"
    script.write_text(_ONE_BAD_ID)
    env = subprocess_env()
    res = subprocess.run([sys.executable, str(script), backend], capture_output=True, text=True, timeout=100,
                         env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    caught = [line for line in res.stdout.splitlines() if line.startswith("CAUGHT:")]
    assert len(caught) == 1, res.stdout + res.stderr[-3000:]
    assert "rank 2, token 3: expert id 99 is outside [0, 8)" in caught[0], caught[0]
    assert "1 dropped pair" in caught[0] and "on this rank" not in caught[0], caught[0]
    assert len(caught[0]) < 300, caught[0]
    assert res.stderr.strip() == "", res.stderr[-3000:]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bad,want", [(8, "logical expert 8 has no replica in the expert map"),
                                      (11, r"logical expert 11 is outside \[0, 9\)"),
                                      (2, "logical expert 2 repeats an earlier id of its token")])
def test_expert_map_errors_name_the_logical_id(backend, bad, want):
    """With an expert map, debug=True named the PHYSICAL id the map produced ('expert id 8 is
    outside [0, 8)' for logical expert 8, which has no replica): an id the caller never passed.
    It names the logical id as given, and why (review finding 10)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    n = 4
    mesh = T.make_mesh(n)
    spec = a2a.Spec(num_experts=8, experts_per_token=2, hidden=16, max_tokens_per_rank=8)
    emap = a2a.ExpertMap.from_replicas([[0], [1], [2], [3], [4], [5], [6], [7], []], num_experts=8)
    comm = a2a.init(spec, mesh, "ep", backend=backend, debug=True, timeout_s=30)
    ids = np.tile(np.array([[1, 2]], np.int32), (8, 1))
    ids[3, 1 if bad != 2 else 0] = bad
    args = [T.stack_global(mesh, "ep", [np.ones((8, 16), jnp.bfloat16)] * n), T.stack_global(mesh, "ep", [ids] * n),
            T.stack_global(mesh, "ep", [np.ones((8, 2), np.float32)] * n)]

    def per_rank(x, i, w, m):
        got = comm.dispatch(x, i, w, expert_map=m)
        return comm.combine(got.x, got)[None]
    f = jax.jit(T.shard_map(per_rank, mesh=mesh, in_specs=(P("ep"),) * 3 + (P(),), out_specs=P("ep")))
    with pytest.raises(a2a.DroppedRowsError, match=f"rank 0, token 3: {want}"):
        with comm.checked():
            jax.block_until_ready(f(*args, emap))
