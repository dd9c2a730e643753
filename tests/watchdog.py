"""A test that hangs under mpirun, made readable (JAX_MOE_A2A_TEST_WATCHDOG_S, off by default).

With the variable set to S seconds, conftest.py calls `started` when each test starts and
`finished` with each test phase's report: a daemon thread prints, S and 2 S seconds into a test
still running, every live communicator's `last_error()` and `proxy_stats()` to stderr, and a
failing test's report is printed the moment it fails (pytest prints it only at the session's end,
which a killed run never reaches). The thread needs the GIL: testing.run_ops waits for a step
with jax.block_until_ready, which releases it.
"""

import gc
import os
import sys
import threading
import time

_AFTER_S = float(os.environ.get("JAX_MOE_A2A_TEST_WATCHDOG_S", "0") or 0)
_running = {"id": None}


def enabled() -> bool:
    return _AFTER_S > 0


def _say(text: str):
    print(f"[watchdog {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def _dump(nodeid: str, after: float):
    if _running["id"] != nodeid:  # that test ended
        return
    _say(f"{nodeid} still running after {after:g} s")  # first: what follows may block
    try:
        from jax_moe_a2a.comm import Communicator
        comms = [o for o in gc.get_objects() if isinstance(o, Communicator)]
    except Exception as e:  # noqa: BLE001: a report, whatever the state
        _say(f"  the live communicators could not be listed: {type(e).__name__}: {e}")
        return
    _say(f"  {len(comms)} live communicator(s)")
    for c in comms:
        for name in ("last_error", "proxy_stats"):
            try:
                value = getattr(c, name)()
            except Exception as e:  # noqa: BLE001
                value = f"{type(e).__name__}: {e}"
            _say(f"  communicator {id(c):x} {name}: {value}")


def started(nodeid: str):
    _running["id"] = nodeid
    for after in (_AFTER_S, 2 * _AFTER_S):
        t = threading.Timer(after, _dump, args=(nodeid, after))
        t.daemon = True
        t.start()


def finished(report):
    if report.when == "teardown":
        _running["id"] = None
    if report.failed:
        _say(f"FAILED {report.nodeid} ({report.when})\n{report.longreprtext}")
