"""One process of tests/test_elastic.py::test_recover_after_failure (run under `mpirun -n 3`).

Every process has one CPU device (rank = process index), the host backend over libfabric, with
timeout_s 3. Step 1 runs on all three with an all-alive mask (a device array: the one compiled
step every later step reuses). In step 2 the victim (the last process) believes rank 0 is dead
(mask [0, 1, 1]): it exchanges with rank 1 only and ends for real (os._exit(0) as its step ends,
no goodbye, nobody waits for it). The survivors run step 2 with every rank alive and fail at
different points of the step: rank 0 in dispatch_recv, waiting for the victim's counts (so it
never finishes its dispatch nor sends its expert outputs), rank 1, which got every count matrix and
every row (nothing overflows the private blocks, so no OVER write is awaited), in combine_recv,
waiting for rank 0's expert outputs (its timeout names rank 0, a live rank: `missing` is a hint).
Then the survivors, without waiting for the victim's pid: a recover() with the full mask must
raise a timeout naming the victim; recover() with the victim masked succeeds, and four more
steps with that mask are checked against the oracle, in the same compiled step. ELASTIC_OK, or
ELASTIC_FAIL and exit 1; every wait is bounded.
"""

import os
import sys
import time

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=1").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402

TIMEOUT = 4.0
AFTER = 4  # oracle-checked steps after the recovery
WORKDIR = os.environ.get("ELASTIC_DIR", "/tmp")


def log(msg):
    print(f"[recover p{jax.process_index()}] {msg}", flush=True)


def main():
    from elastic_common import start
    from jax_moe_a2a.transfer import TransferTimeoutError

    _, T, me, nproc, _, n, spec, comm = start(timeout_s=TIMEOUT)
    victim = nproc - 1

    def step(seed, mask, check=True):
        inputs = T.make_inputs(spec, n, seed, num_tokens=spec.max_tokens_per_rank, invalid_frac=0.05,
                               minus_one_frac=0.05)
        res = T.run_ops(comm, inputs, rank_mask=mask)
        if check:
            live = [r for r in res if mask[r]]
            T.check_all(comm, inputs, res, rank_mask=mask, ranks=live)
        return res

    ones = np.ones(n, np.int32)
    # compile first and meet (files, bounded): a slow compile on one process must not eat the
    # others' short timeout in step 1
    T.run_ops(comm, T.make_inputs(spec, n, 1), rank_mask=ones, compile_only=True)
    open(os.path.join(WORKDIR, f"ready-{me}"), "w").close()
    t0 = time.time()
    while not all(os.path.exists(os.path.join(WORKDIR, f"ready-{p}")) for p in range(nproc)):
        if time.time() - t0 > 120:
            raise TimeoutError("waited 120 s for the others to compile")
        time.sleep(0.05)
    step(1001, ones)
    log("step 1: all alive, oracle-correct")
    if me == victim:
        view = ones.copy()
        view[0] = 0
        try:  # it exchanges with rank 1 only, then waits in vain for rank 1's expert outputs
            step(1002, view, check=False)
        except jax.errors.JaxRuntimeError:
            pass
        print(f"ELASTIC_EXIT process {me} in step 2", flush=True)
        os._exit(0)
    t0 = time.time()
    try:
        step(1002, ones)
        raise AssertionError("step 2 passed on a survivor: the victim's failure went unnoticed")
    except jax.errors.JaxRuntimeError as e:
        err = comm.last_error()
        log(f"step 2 failed after {time.time() - t0:.1f} s as expected; last_error().missing = {err.missing}")
        assert err is not None and err.missing, err
        # rank 0 waits for the victim's counts; rank 1 got every rank's counts and rows (nothing
        # overflows, so no OVER write is awaited) and waits for rank 0's expert outputs (a live
        # rank named)
        where = "dispatch_recv (route counts" if me == 0 else "combine_recv (expert outputs"
        assert where in str(e), f"rank {me} should fail at {where}: {e}"
        if me == 1:
            assert err.missing == (0,), err.missing
    # the next op on the failed communicator keeps refusing
    try:
        step(1003, ones)
        raise AssertionError("an op ran on the failed communicator")
    except jax.errors.JaxRuntimeError as e:
        assert "unusable after an earlier failure" in str(e), e
    survivors = [p for p in range(nproc) if p != victim]

    def meet(tag):
        """Wait (bounded) until every survivor got here: the survivors leave the failed recovery
        at different times (up to a timeout apart on a loaded machine), and a recovery waits only
        timeout_s for the others to join, so the masked recover() starts from a rendezvous."""
        open(os.path.join(WORKDIR, f"{tag}-{me}"), "w").close()
        t1 = time.time()
        while not all(os.path.exists(os.path.join(WORKDIR, f"{tag}-{p}")) for p in survivors):
            if time.time() - t1 > 60:
                raise TimeoutError(f"waited 60 s for the other survivors at {tag}")
            time.sleep(0.05)

    # a mask that still includes the dead rank: the recovery times out naming it, also when the
    # survivors start it together, long after the victim's process ended (over tcp;ofi_rxm the
    # write to the victim then stays at -FI_EAGAIN: bounded by timeout_s, it names the victim too;
    # it stalled 30 s in JAX_MOE_A2A_POST_TIMEOUT_S and ended in a TransferError before)
    meet("recover-all")
    t0 = time.time()
    try:
        comm.recover(ones)
        raise AssertionError("recover() with the dead rank in the mask succeeded")
    except TransferTimeoutError as e:
        assert f"ranks [{victim}] did not join the recovery" in str(e), e
        took = time.time() - t0
        log(f"recover(all alive) refused after {took:.1f} s, naming rank {victim}")
        assert took < 3 * TIMEOUT, f"recover(all alive) took {took:.1f} s to time out (timeout_s {TIMEOUT})"
    mask = ones.copy()
    mask[victim] = 0
    meet("recover-masked")
    comm.recover(mask)
    log(f"recovered with mask {mask.tolist()}")
    masked = 0
    for i in range(AFTER):
        res = step(2000 + i, mask)
        masked += sum(int(res[r]["num_masked"]) for r in res if mask[r])
    if masked == 0:
        raise AssertionError("the masked rank's experts received no pairs: the test proves nothing")
    sizes = sum(f._cache_size() for f in T.compiled_steps(comm).values())
    if sizes != 1:
        raise AssertionError(f"the step compiled {sizes} times: recovery and a new mask must reuse it")
    print(f"ELASTIC_OK process {me} steps {AFTER} after recovery", flush=True)
    open(os.path.join(WORKDIR, f"done-{me}"), "w").close()
    t0 = time.time()
    while not all(os.path.exists(os.path.join(WORKDIR, f"done-{p}")) for p in survivors):
        if time.time() - t0 > 60:
            raise TimeoutError("waited 60 s for the other survivors")
        time.sleep(0.05)
    if me == 0:
        time.sleep(1.0)  # the coordination service lives here: leave after the others
    os._exit(0)  # no jax.distributed.shutdown: its barrier would wait for the dead task


if __name__ == "__main__":
    from elastic_common import run

    run(main)
