"""What both elastic workers (tests/elastic_worker.py, tests/elastic_recover_worker.py) share:
one device per process (a CPU device; or, with ELASTIC_BACKEND=cuda, GPU 0 shared by every
process: JAX_MOE_A2A_LOCAL_DEVICE_IDS=0), jax.distributed with a long heartbeat timeout (the
coordination service must not stop the survivors because of the dead task during the few seconds
a run takes), and the host backend (or $ELASTIC_BACKEND) on a small spec. Imported by the workers only, after they set the
environment (sys.path has tests/ first: the worker's own directory)."""

import os
import traceback

import jax


def start(timeout_s):
    """jax.distributed up, then (a2a, testing, process index, process count, mesh, N, spec, comm)
    with the host backend over $ELASTIC_PROVIDER (default shm), or $ELASTIC_BACKEND, and the
    given timeout_s."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    from jax_moe_a2a.runtime import local_device_ids_from_env
    jax.distributed.initialize(heartbeat_timeout_seconds=600, local_device_ids=local_device_ids_from_env())
    import jax_moe_a2a as a2a
    from jax_moe_a2a import testing

    mesh = testing.make_mesh()
    n = mesh.devices.size
    spec = a2a.Spec(num_experts=4 * n, experts_per_token=3, hidden=128, max_tokens_per_rank=16)
    backend = os.environ.get("ELASTIC_BACKEND", "host")
    opts = dict(provider=os.environ.get("ELASTIC_PROVIDER", "shm")) if backend == "host" else {}
    comm = a2a.init(spec, mesh, "ep", backend=backend, timeout_s=timeout_s, **opts)
    return a2a, testing, jax.process_index(), jax.process_count(), mesh, n, spec, comm


def run(main):
    """Runs a worker's main(): any failure prints ELASTIC_FAIL with the traceback and ends the
    process with exit code 1 at once (no jax.distributed.shutdown: it would wait for the dead task)."""
    try:
        main()
    except BaseException:
        print(f"ELASTIC_FAIL process {os.environ.get('OMPI_COMM_WORLD_RANK', '?')}:\n{traceback.format_exc()}",
              flush=True)
        os._exit(1)
