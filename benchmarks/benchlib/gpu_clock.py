"""The GPU's SM clock and board power while a measurement runs, sampled by nvidia-smi in the
background, so a benchmark can say whether its numbers ran at the boost clock or under the power
limit (issue 31: an H100 running the decode MLP back to back reaches its 700 W limit and drops
the SM clock from 1,980 to 1,450-1,900 MHz; the same kernels in short bursts do not).

    with gpu_clock.ClockLog() as log:
        r = timeit(fn, *args)
    r["board"] = log.summary()   # {"sm_mhz_p50", "sm_mhz_min", "power_w_p50", "power_w_max",
                                 #  "power_capped", "thermal", "samples"} or {"why": ...}

`power_capped` / `thermal` are the fractions of samples whose clock-event reasons
(nvidia-smi's clocks_event_reasons.active) had a power (SW power cap, HW power brake) or thermal
(SW / HW slowdown) bit set. No nvidia-smi (a CPU machine): the summary says why, nothing runs.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
from typing import Dict, Iterable, List, Optional

# nvidia-smi's clocks_event_reasons bits (nvmlClocksEventReasons)
SW_POWER_CAP = 0x4
HW_SLOWDOWN = 0x8
SW_THERMAL = 0x20
HW_THERMAL = 0x40
HW_POWER_BRAKE = 0x80
POWER_BITS = SW_POWER_CAP | HW_POWER_BRAKE
THERMAL_BITS = SW_THERMAL | HW_THERMAL

QUERY = "clocks.sm,power.draw,clocks_event_reasons.active"


def summarize(lines: Iterable[str]) -> Dict:
    """The summary of nvidia-smi lines "<sm MHz>, <power W>, <reasons hex>" (csv, noheader,
    nounits); lines that do not parse (a GPU's "[N/A]", a header) are skipped. Samples with the
    GPU idle (reason bit 0x1 alone) are left out: they are the gaps between measurements."""
    clocks: List[float] = []
    power: List[float] = []
    capped = thermal = 0
    for line in lines:
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 3:
            continue
        try:
            mhz, watts, reasons = float(parts[0]), float(parts[1]), int(parts[2], 16)
        except ValueError:
            continue
        if reasons == 0x1:  # GPU idle
            continue
        clocks.append(mhz)
        power.append(watts)
        capped += bool(reasons & POWER_BITS)
        thermal += bool(reasons & THERMAL_BITS)
    if not clocks:
        return {"why": "no busy samples (the measurement was shorter than the sampling interval, or the GPU idle)"}
    n = len(clocks)
    return {"sm_mhz_p50": statistics.median(clocks), "sm_mhz_min": min(clocks),
            "power_w_p50": statistics.median(power), "power_w_max": max(power),
            "power_capped": capped / n, "thermal": thermal / n, "samples": n}


def describe(s: Optional[Dict]) -> str:
    """One line for a report: the clock and power, and how often the power limit held the clock."""
    if not s:
        return "board: not sampled"
    if "why" in s:
        return f"board: {s['why']}"
    return (f"board: SM clock p50 {s['sm_mhz_p50']:.0f} MHz (min {s['sm_mhz_min']:.0f}), power p50 "
            f"{s['power_w_p50']:.0f} W (max {s['power_w_max']:.0f}), power-capped in {100 * s['power_capped']:.0f} % "
            f"of {s['samples']} samples" + (f", thermal {100 * s['thermal']:.0f} %" if s["thermal"] else ""))


def _first_visible_gpu() -> str:
    """The first GPU CUDA_VISIBLE_DEVICES names (an index or a UUID, as nvidia-smi -i takes them), else 0."""
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    return first or "0"


class ClockLog:
    """Samples the first visible GPU every interval_ms while the with-block runs (nvidia-smi -lms).
    enabled=False (a CPU run) samples nothing and its summary is None."""

    def __init__(self, interval_ms: int = 50, enabled: bool = True):
        self.interval_ms = interval_ms
        self.enabled = enabled
        self._proc: Optional[subprocess.Popen] = None
        self._lines: List[str] = []
        self._why: Optional[str] = None

    def __enter__(self) -> "ClockLog":
        if not self.enabled:
            return self
        exe = shutil.which("nvidia-smi")
        if exe is None:
            self._why = "no nvidia-smi (not a GPU machine)"
            return self
        try:
            self._proc = subprocess.Popen(
                [exe, "-i", _first_visible_gpu(), f"--query-gpu={QUERY}", "--format=csv,noheader,nounits",
                 "-lms", str(self.interval_ms)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError as e:
            self._why = f"nvidia-smi did not start: {e}"
        return self

    def __exit__(self, *exc) -> None:
        if self._proc is None:
            return
        self._proc.terminate()
        try:
            out, _ = self._proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            out, _ = self._proc.communicate()
        self._lines = out.splitlines()
        self._proc = None

    def summary(self) -> Optional[Dict]:
        if not self.enabled:
            return None
        if self._why:
            return {"why": self._why}
        return summarize(self._lines)
