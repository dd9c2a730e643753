"""Where this process's threads wait for a CPU: Linux's per-thread scheduler statistics.

/proc/self/task/<tid>/schedstat holds, per thread, the nanoseconds it ran, the nanoseconds it sat
runnable on a run queue without a CPU, and its time slices. On a machine with fewer cores than busy
threads (the 2-core development VM: per rank a Python main thread, the proxy thread and the
engine's progress thread), the run-queue wait of the threads on a transfer's critical path is what
the proxy breakdown's "unexplained" column hides; benchmarks/proxy.py reports it next to it.

Threads are grouped by role: "main" (the thread that made the reader: the one calling the ops), and
the library's own threads by the names they give themselves (cc/core/thread_name.h): "proxy"
(a2a-proxy) and "progress" (a2a-progress). Other threads (XLA's pools) are not read.
"""

from __future__ import annotations

import os
import threading
from typing import Dict, Optional, Tuple

GROUPS = ("main", "proxy", "progress")
_BY_NAME = {"a2a-proxy": "proxy", "a2a-progress": "progress"}


def _read(tid: int) -> Optional[Tuple[int, int]]:
    """(run ns, run-queue wait ns) of thread tid of this process, or None (gone, or no schedstat)."""
    try:
        with open(f"/proc/self/task/{tid}/schedstat") as f:
            run, wait = f.read().split()[:2]
        return int(run), int(wait)
    except (OSError, ValueError):
        return None


def _name(tid: int) -> str:
    try:
        with open(f"/proc/self/task/{tid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


class SchedReader:
    """Reads the scheduler statistics of this process's main thread and the library's threads.

    Make it after the communicator (its threads exist by then). snapshot() -> {group: (run_ns,
    wait_ns)} summed over the group's threads ({} where Linux offers no schedstat); delta(a, b)
    -> {group: (run_us, wait_us)} between two snapshots."""

    def __init__(self):
        self.tids: Dict[int, str] = {threading.get_native_id(): "main"}
        try:
            for t in os.listdir("/proc/self/task"):
                group = _BY_NAME.get(_name(int(t)))
                if group:
                    self.tids[int(t)] = group
        except OSError:
            pass
        self.available = _read(threading.get_native_id()) is not None

    def snapshot(self) -> Dict[str, Tuple[int, int]]:
        if not self.available:
            return {}
        out = {g: (0, 0) for g in GROUPS}
        for tid, group in self.tids.items():
            v = _read(tid)
            if v is not None:
                out[group] = (out[group][0] + v[0], out[group][1] + v[1])
        return out

    @staticmethod
    def delta(a: Dict[str, Tuple[int, int]], b: Dict[str, Tuple[int, int]]) -> Dict[str, Tuple[float, float]]:
        return {g: ((b[g][0] - a[g][0]) / 1e3, (b[g][1] - a[g][1]) / 1e3) for g in GROUPS if g in a and g in b}
