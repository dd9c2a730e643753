"""One process of tests/test_elastic.py::test_process_failure (run under `mpirun -n 3`).

Every process has one CPU device (rank = process index), the host backend over libfabric (shm).
Step 1 runs on all three with an all-alive mask (a device array: the step compiled for it is the
one every later step reuses). Then the last process ends for real: os._exit(0) right after its
step-1 outputs are ready, no jax.distributed.shutdown, nothing said to the others but its pid in
a file. The survivors wait until that pid is gone, then run five more steps with the mask that
masks it, each checked against the oracle with the same mask (their dispatched rows, the counts,
num_masked and the combined output), in the same compiled step. They print ELASTIC_OK and leave
without jax.distributed.shutdown (which would wait for the dead task), process 0 (the
coordination service) last. Any failure prints ELASTIC_FAIL and exits 1; every wait is bounded.
"""

import os
import sys
import time

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=1").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402

STEPS = 6
WORKDIR = os.environ.get("ELASTIC_DIR", "/tmp")


def log(msg):
    print(f"[elastic p{jax.process_index()}] {msg}", flush=True)


def wait_for(cond, timeout, what):
    t0 = time.time()
    while not cond():
        if time.time() - t0 > timeout:
            raise TimeoutError(f"waited {timeout} s for {what}")
        time.sleep(0.05)


def main():
    from elastic_common import start

    _, T, me, nproc, _, n, spec, comm = start(timeout_s=10)
    victim = nproc - 1
    log(f"{comm!r}")
    for step in range(1, STEPS + 1):
        mask = np.ones(n, np.int32)
        if step > 1:
            mask[victim] = 0
        inputs = T.make_inputs(spec, n, 1000 + step, num_tokens=spec.max_tokens_per_rank, invalid_frac=0.05,
                               minus_one_frac=0.05)
        t0 = time.time()
        res = T.run_ops(comm, inputs, rank_mask=mask)
        live = [r for r in res if mask[r]]
        T.check_all(comm, inputs, res, rank_mask=mask, ranks=live)
        masked = sum(int(res[r]["num_masked"]) for r in live)
        log(f"step {step}: mask {mask.tolist()}, oracle-correct, {masked} pair(s) masked here, "
            f"{time.time() - t0:.2f} s")
        if step > 1 and masked == 0:
            raise AssertionError("the masked rank's experts received no pairs: the test proves nothing")
        if step == 1 and me == victim:
            with open(os.path.join(WORKDIR, f"pid-{me}"), "w") as f:
                f.write(str(os.getpid()))
            print(f"ELASTIC_EXIT process {me} after step 1", flush=True)
            os._exit(0)  # ends for real: no shutdown, no goodbye
        if step == 1:  # the survivors go on only once the victim is gone
            pid_file = os.path.join(WORKDIR, f"pid-{victim}")
            wait_for(lambda: os.path.exists(pid_file) and os.path.getsize(pid_file) > 0, 60, "the victim's pid")
            pid = int(open(pid_file).read())
            wait_for(lambda: not os.path.exists(f"/proc/{pid}") or _zombie(pid), 60, f"process {pid} to end")
            log(f"process {victim} (pid {pid}) has ended; going on with it masked")
    sizes = sum(f._cache_size() for f in T.compiled_steps(comm).values())
    if sizes != 1:
        raise AssertionError(f"the step compiled {sizes} times: a new mask must reuse it")
    print(f"ELASTIC_OK process {me} steps {STEPS}", flush=True)
    open(os.path.join(WORKDIR, f"done-{me}"), "w").close()
    survivors = [p for p in range(nproc) if p != victim]
    wait_for(lambda: all(os.path.exists(os.path.join(WORKDIR, f"done-{p}")) for p in survivors), 60,
             "the other survivors")
    if me == 0:
        time.sleep(1.0)  # the coordination service lives here: leave after the others
    os._exit(0)  # no jax.distributed.shutdown: its barrier would wait for the dead task


def _zombie(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] in ("Z", "X")
    except OSError:
        return True


if __name__ == "__main__":
    from elastic_common import run

    run(main)
