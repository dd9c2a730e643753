"""Test harness: 8 CPU devices in one process, or one JAX process per Open MPI rank.

Single process: `pytest tests/` (JAX_MOE_A2A_TEST_DEVICES, default 8, CPU devices).
Several processes: `mpirun -n 2 python -m pytest -m mpi --color=no tests/`; each process gets
JAX_MOE_A2A_TEST_DEVICES devices (default 1) and jax.distributed is initialised from Open MPI's
environment. Tests marked `mpi` run in both modes over every global device.
"""

import os

_MPI_SIZE = int(os.environ.get("OMPI_COMM_WORLD_SIZE", os.environ.get("PMI_SIZE", "1")))
_DEVICES = int(os.environ.get("JAX_MOE_A2A_TEST_DEVICES", "8" if _MPI_SIZE == 1 else "1"))
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           f" --xla_force_host_platform_device_count={_DEVICES}").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# On CPUs the suites spend most of their time in XLA compiling tiny programs (the reference
# backend's step: ~2 s of CPU each, its run 0.05 s). LLVM at -O0 compiles them in ~60 % of that
# and computes the same values (no fast-math either way); an XLA_FLAGS that sets the level wins.
# Only for CPU-only runs: GPU jobs compile as users do.
if os.environ["JAX_PLATFORMS"] == "cpu" and "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"

import jax  # noqa: E402
import pytest  # noqa: E402

import watchdog  # noqa: E402  (JAX_MOE_A2A_TEST_WATCHDOG_S: a hanging test's communicators, printed)

if os.environ.get("JAX_MOE_A2A_RAGGED_EMULATE") == "1":  # XLA:CPU lacks ragged-all-to-all
    from ragged_emulation import install  # noqa: E402
    install()

if _MPI_SIZE > 1:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if not jax.distributed.is_initialized():
        # JAX_MOE_A2A_LOCAL_DEVICE_IDS=0: several processes share GPU 0 (the one-GPU machine);
        # =local_rank: one GPU per process.
        from jax_moe_a2a.runtime import local_device_ids_from_env
        jax.distributed.initialize(local_device_ids=local_device_ids_from_env())



def _available_backends():
    import jax_moe_a2a as a2a  # after jax.distributed.initialize (above): the backends query devices
    return a2a.available_backends()


# The backends every parametrised test runs on: JAX_MOE_A2A_TEST_BACKENDS (comma-separated), or every
# available one. Test files import these from here (`from conftest import BACKENDS`).
BACKENDS = [b for b in os.environ.get("JAX_MOE_A2A_TEST_BACKENDS", ",".join(_available_backends())).split(",") if b]
# Backends written in JAX alone: differentiated by JAX autodiff, never time out (XLA collectives).
PURE_JAX = ("reference", "ragged")


def xla_collectives_refused():
    """True when several GPU processes share one GPU (JAX_MOE_A2A_LOCAL_DEVICE_IDS set to fixed
    ids under mpirun, as on the one-GPU machine): XLA's NCCL collectives refuse that ("Duplicate
    GPU detected"), so the PURE_JAX backends, and tests that compare with them, cannot run there."""
    ids = os.environ.get("JAX_MOE_A2A_LOCAL_DEVICE_IDS", "")
    return jax.process_count() > 1 and ids not in ("", "local_rank") and jax.default_backend() == "gpu"


def subprocess_env(*, drop=(), keep_xla_flags: bool = False, **set_vars) -> dict:
    """os.environ for a child process run as a user's shell would run it: without an outer
    mpirun's variables (OMPI_*, PMI*; outside one, the machine's Open MPI settings OMPI_MCA_* stay,
    e.g. plm_rsh_agent on the GPU machine, without which a child mpirun looks for ssh), without
    the names in `drop` (exact names or prefixes), without the harness's XLA_FLAGS (keep_xla_flags:
    all of them but its device count), JAX_PLATFORMS=cpu, and the jax_moe_a2a under test first on
    PYTHONPATH; then `set_vars` (which win)."""
    import pathlib
    import jax_moe_a2a as a2a
    keep_mca = "OMPI_COMM_WORLD_SIZE" not in os.environ
    drop = tuple(drop)
    env = {k: v for k, v in os.environ.items()
           if ((keep_mca and k.startswith("OMPI_MCA_")) or not k.startswith(("OMPI_", "PMI")))
           and not (drop and k.startswith(drop))}
    flags = env.pop("XLA_FLAGS", "")
    if keep_xla_flags:
        env["XLA_FLAGS"] = " ".join(f for f in flags.split() if not f.startswith("--xla_force_host_platform_device_count"))
    env["JAX_PLATFORMS"] = "cpu"
    pkg = str(pathlib.Path(a2a.__file__).resolve().parent.parent)   # the jax_moe_a2a under test
    env["PYTHONPATH"] = os.pathsep.join([pkg] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.update(set_vars)
    return env


def pytest_sessionfinish(session, exitstatus):
    if _MPI_SIZE > 1:  # leave together: a process exiting early aborts the others' coordination
        jax.distributed.shutdown()


def pytest_runtest_logstart(nodeid, location):
    if watchdog.enabled():
        watchdog.started(nodeid)


def pytest_runtest_logreport(report):
    if watchdog.enabled():
        watchdog.finished(report)


def pytest_collection_modifyitems(config, items):
    if _MPI_SIZE > 1:
        skip = pytest.mark.skip(reason="single-process test (run without mpirun)")
        for item in items:
            if "mpi" not in item.keywords:
                item.add_marker(skip)


@pytest.fixture(autouse=True)
def _collect_communicators():
    """Communicators own engines and threads: collect the ones a test dropped right away. Only
    after a test that made one (a full collection cost ~0.4 s on the 2-core CI machine: the 1,231
    after every test were 23 % of the single-process stage's test time, 2026-12-06); the ones of
    module-scoped fixtures are collected by _no_communicator_outlives_its_module."""
    from jax_moe_a2a import comm
    before = set(comm._OPEN)
    yield
    if set(comm._OPEN) - before:
        import gc
        gc.collect()


# Communicators alive when the previous test file ended (weak references).
_ALIVE_AT_LAST_FILE_END: list = []


@pytest.fixture(scope="module", autouse=True)
def _no_communicator_outlives_its_module(request):
    """No communicator of a test file may still be alive one file later (this fixture is set up
    first, so it is torn down after the file's own fixtures). One that is leaks its buffers,
    engines and progress threads for the rest of the run: until 2026-12-02 every communicator did
    (compiled steps held it through their host callbacks), and mpirun -n 2 took 28 min instead of
    5. Checked one file late, because the last test's objects can stay alive for a while for
    reasons that are not leaks: pytest keeps its fixture values and the last raised exception's
    traceback (its frames hold the communicator) until later tests replace them."""
    yield
    import gc
    import weakref
    from jax_moe_a2a.comm import Communicator
    gc.collect()
    leaked = [c for c in (r() for r in _ALIVE_AT_LAST_FILE_END) if c is not None]
    _ALIVE_AT_LAST_FILE_END[:] = [weakref.ref(o) for o in gc.get_objects()
                                  if isinstance(o, Communicator) and all(o is not c for c in leaked)]
    if leaked:
        for c in leaked:  # free them, so that one leak does not slow every later file
            c.close()
        pytest.fail(f"{len(leaked)} communicator(s) of an earlier test file still alive at the end of this one: "
                    f"{leaked[:3]}", pytrace=False)


@pytest.fixture(scope="session")
def num_ranks():
    return jax.device_count()


@pytest.fixture(scope="session")
def mesh():
    from jax_moe_a2a.testing import make_mesh
    return make_mesh()


def pytest_report_header(config):
    return (f"jax {jax.__version__}, process {jax.process_index()}/{jax.process_count()}, "
            f"{jax.local_device_count()} local / {jax.device_count()} global devices")
