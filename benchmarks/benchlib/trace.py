"""Where a jitted step's time goes on the device: a JAX profiler trace of a few steps, read back
with jax.profiler.ProfileData (no TensorBoard needed).

    summary = trace.device_profile(lambda: f_step(...), steps=3, per=layers)

The GPU planes (`/device:GPU:<i>`) hold one event per kernel or copy the device ran, with its start
and duration in ns. From them, per step (divided by `per`, e.g. the layers in a step):

  busy_us  the union of every kernel's interval: time the device was doing our step's work;
  span_us  first kernel start to last kernel end of the back-to-back steps / steps: busy + gaps;
  gap_us   span - busy: time the device waited (for the host to launch, or between launches).

When span ~ the step's wall time and gaps are large, the host sets the pace (launch overhead);
when busy ~ span, the kernels do. `kernels` lists the kernels by total time (name, calls per
step, µs per step / per, and idle_before_us: the device's idle time just before each of its
calls, summed per step / per: where the gaps fall). On CPUs there are no device planes: the
summary says so (None values).
"""

from __future__ import annotations

import glob
import os
import shutil
import tempfile
from typing import Callable, Dict, List, Optional, Tuple


def _device_events(path: str) -> Tuple[List[Tuple[int, int, str]], List[str]]:
    """(start_ns, end_ns, name) of every event on the trace's GPU stream lines, and the names of
    the GPU lines seen (to check the filter)."""
    from jax.profiler import ProfileData
    data = ProfileData.from_file(path)
    out, seen = [], []
    for plane in data.planes:
        if not plane.name.startswith("/device:GPU:"):
            continue
        for line in plane.lines:
            seen.append(f"{plane.name}:{line.name}")
            # XLA's GPU planes also carry per-op summary lines ("XLA Ops", "XLA Modules", "Steps"):
            # only the stream lines hold the kernels and copies the device ran
            if not line.name.startswith("Stream"):
                continue
            for e in line.events:
                start = int(e.start_ns)
                out.append((start, start + int(e.duration_ns), e.name))
    return out, seen


def summarize_events(events: List[Tuple[int, int, str]], steps: int, per: int = 1, top: int = 12) -> Dict:
    """busy / span / gap per step / per and the top kernels, from (start_ns, end_ns, name) events
    of `steps` steps."""
    if not events:
        return {"busy_us": None, "span_us": None, "gap_us": None, "kernels": [],
                "why": "no GPU device events in the trace (a CPU run, or the profiler saw no device)"}
    events = sorted(events)
    busy, cur_s, cur_e = 0, None, None
    for s, e, _ in events:
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    span = max(e for _, e, _ in events) - events[0][0]
    div = 1e3 * steps * per
    by_name: Dict[str, List[float]] = {}
    last_end = None
    for s, e, name in events:
        c = by_name.setdefault(name, [0, 0.0, 0.0])
        c[0] += 1
        c[1] += e - s
        if last_end is not None and s > last_end:
            c[2] += s - last_end  # the device idle right before this call
        last_end = e if last_end is None else max(last_end, e)
    rows = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
    return {"busy_us": busy / div, "span_us": span / div, "gap_us": (span - busy) / div,
            "kernels": [{"name": n[:80], "calls_per_step": c / steps, "us": t / div, "idle_before_us": g / div}
                        for n, (c, t, g) in rows]}


def device_profile(run_step: Callable[[], object], steps: int = 3, per: int = 1,
                   keep_dir: Optional[str] = None) -> Dict:
    """Traces `steps` back-to-back calls of run_step (queued as the benchmark queues them, one
    block at the end), after the caller's warm-up; returns summarize_events' dict plus `lines`
    (the GPU lines seen). keep_dir: copy the raw trace there."""
    import jax
    d = tempfile.mkdtemp(prefix="a2a_trace_")
    try:
        jax.profiler.start_trace(d)
        try:
            out = None
            for _ in range(steps):
                out = run_step()
            jax.block_until_ready(out)
        finally:
            jax.profiler.stop_trace()
        paths = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)
        if not paths:
            return {"busy_us": None, "span_us": None, "gap_us": None, "kernels": [], "why": "no trace file written"}
        if keep_dir:
            os.makedirs(keep_dir, exist_ok=True)
            shutil.copy(paths[0], keep_dir)
        events, lines = _device_events(paths[0])
        return {**summarize_events(events, steps, per), "lines": sorted(set(lines))[:16]}
    finally:
        shutil.rmtree(d, ignore_errors=True)
