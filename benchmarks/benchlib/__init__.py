"""Shared by the benchmark programs of benchmarks/ (run from a checkout: `python benchmarks/<name>.py`).

Running a file of benchmarks/ puts that folder, not the repository root, first on sys.path, so
`import jax_moe_a2a` finds the installed package (with its compiled _C), not the source tree
(which has no _C unless one was copied in and put on PYTHONPATH on purpose)."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import time

BENCH_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO = os.path.dirname(BENCH_DIR)
HALVES = ("dispatch_send", "dispatch_recv", "combine_send", "combine_recv", "dispatch", "combine")


def mpi_world() -> tuple:
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK", "0")))
    size = int(os.environ.get("OMPI_COMM_WORLD_SIZE", os.environ.get("PMI_SIZE", "1")))
    return rank, size


def setup_runtime(cpu_devices=None):
    """Environment before JAX initialises its backends: CPU device count, multi-process init.
    Returns the jax module."""
    _, mpi_size = mpi_world()
    ndev = cpu_devices or (8 if mpi_size == 1 else 1)
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={ndev}".strip()
    import jax
    if mpi_size > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        from jax_moe_a2a.runtime import local_device_ids_from_env  # "0": processes sharing GPU 0
        jax.distributed.initialize(local_device_ids=local_device_ids_from_env())
    warn_if_source_tree()
    return jax


def warn_if_source_tree():
    """A source tree without its extension shadows the install (e.g. `python -m benchmarks.x` from
    the repository root): say so instead of reporting the compiled backends as unavailable."""
    import importlib.util

    import jax_moe_a2a
    pkg = os.path.dirname(os.path.abspath(jax_moe_a2a.__file__))
    if os.path.dirname(pkg) == REPO and importlib.util.find_spec("jax_moe_a2a._C") is None:
        print(f"warning: imported jax_moe_a2a from the source tree {pkg}, which has no compiled _C; run "
              "`python benchmarks/<name>.py` (not `python -m benchmarks.<name>` from the repository root) "
              "so that the installed package is imported", file=sys.stderr, flush=True)


def git_commit() -> str:
    if os.environ.get("JAX_MOE_A2A_COMMIT"):  # set by scripts that run on a copy without .git
        return os.environ["JAX_MOE_A2A_COMMIT"]
    try:
        c = subprocess.run(["git", "-C", BENCH_DIR, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                           timeout=5).stdout.strip()
        dirty = subprocess.run(["git", "-C", BENCH_DIR, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return (c + ("-dirty" if dirty else "")) if c else "unknown"
    except Exception:
        return "unknown"


def run_meta(jax, **extra) -> dict:
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": git_commit(), "jax": jax.__version__, "platform": jax.default_backend(),
            "device_kind": jax.devices()[0].device_kind, "devices": jax.device_count(),
            "processes": jax.process_count(), "argv": sys.argv, "xla_flags": os.environ.get("XLA_FLAGS", ""),
            **extra}


def backend_plan(requested: str) -> tuple:
    """(backends to run, {backend: why it is skipped}) for a comma-separated request ("" = all)."""
    from jax_moe_a2a import backends as registry
    names = [b for b in requested.split(",") if b] or [b for b in registry.ORDER if b in registry.known()]
    run, skipped = [], {}
    for b in names:
        why = registry.why_unavailable(b)
        (skipped.__setitem__(b, why) if why else run.append(b))
    return run, skipped


class Progress:
    """A tqdm bar on process 0 (stderr) counting work units, so that the ETA stays stable when
    steps differ in cost (a prefill step counts as more units than a decode step). `offset` and
    `grand_total` let several programs run one after another share one bar's scale. Without a
    terminal (logs) it prints a line every 10 %, with the elapsed time and an estimate of the rest."""

    def __init__(self, total, enabled, offset=0, grand_total=None, label=""):
        self.bar = None
        self.enabled = enabled
        self.n, self.total = float(offset), float(grand_total or total)
        self.label = label
        if enabled and sys.stderr.isatty():  # logs get a line per 10 % instead
            try:
                from tqdm import tqdm
                self.bar = tqdm(total=round(self.total, 1), initial=round(self.n, 1), unit="u", dynamic_ncols=True,
                                file=sys.stderr, bar_format="{l_bar}{bar}| {percentage:3.0f}% [{elapsed}<{remaining}]")
            except ImportError:
                self.bar = None
        self._last_print = int(100 * self.n / self.total) // 10
        self._t0, self._n0 = time.monotonic(), self.n

    def update(self, desc, units=1.0):
        self.n += units
        if self.bar is not None:
            self.bar.set_description(f"{self.label}{desc}", refresh=False)
            self.bar.update(round(units, 3))
        elif self.enabled and int(100 * self.n / self.total) // 10 > self._last_print:
            self._last_print = int(100 * self.n / self.total) // 10
            spent = time.monotonic() - self._t0
            done = self.n - self._n0
            left = spent * (self.total - self.n) / done if done > 0 else float("nan")
            print(f"[{100 * self.n / self.total:3.0f}%] {self.label}{desc} ({spent:.0f} s, about {left:.0f} s left)",
                  file=sys.stderr, flush=True)

    def write(self, line):
        """A line of its own on stdout, flushed (the bar is on stderr)."""
        if self.enabled:
            if self.bar is not None:
                self.bar.clear()
            print(line, flush=True)
            if self.bar is not None:
                self.bar.refresh()

    def close(self):
        if self.bar is not None:
            self.bar.close()
