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
import threading
from typing import Dict, Iterable, List, Optional

# nvidia-smi's clocks_event_reasons bits (nvmlClocksEventReasons)
SW_POWER_CAP = 0x4
HW_SLOWDOWN = 0x8
SW_THERMAL = 0x20
HW_THERMAL = 0x40
HW_POWER_BRAKE = 0x80
POWER_BITS = SW_POWER_CAP | HW_POWER_BRAKE
THERMAL_BITS = SW_THERMAL | HW_THERMAL

QUERY = "clocks.sm,{power},clocks_event_reasons.active"
_POWER_FIELD: Dict[str, str] = {}  # nvidia-smi path -> the power field it answers


def query(exe: str, gpu: str) -> str:
    """--query-gpu's fields: power.draw.instant where this nvidia-smi answers it (driver R530 and
    newer), else power.draw. Asked once per nvidia-smi (~0.1-0.5 s)."""
    if exe not in _POWER_FIELD:
        try:
            r = subprocess.run([exe, "-i", gpu, "--query-gpu=power.draw.instant", "--format=csv,noheader,nounits"],
                               capture_output=True, text=True, timeout=10)
            ok = r.returncode == 0 and _number(r.stdout.splitlines()[0] if r.stdout else "")
        except (OSError, subprocess.TimeoutExpired):
            ok = False
        _POWER_FIELD[exe] = "power.draw.instant" if ok else "power.draw"
    return QUERY.format(power=_POWER_FIELD[exe])


def _number(text: str) -> bool:
    try:
        float(text.strip())
        return True
    except ValueError:
        return False


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
    avg = " (1 s average)" if s.get("power_field") == "power.draw" else ""
    return (f"board: SM clock p50 {s['sm_mhz_p50']:.0f} MHz (min {s['sm_mhz_min']:.0f}), power p50 "
            f"{s['power_w_p50']:.0f} W{avg} (max {s['power_w_max']:.0f}), power-capped in "
            f"{100 * s['power_capped']:.0f} % of {s['samples']} samples"
            + (f", thermal {100 * s['thermal']:.0f} %" if s["thermal"] else ""))


def _first_visible_gpu() -> str:
    """The first GPU CUDA_VISIBLE_DEVICES names (an index or a UUID, as nvidia-smi -i takes them), else 0."""
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    return first or "0"


class ClockLog:
    """Samples the first visible GPU every interval_ms while the with-block runs (nvidia-smi -lms).
    enabled=False (a CPU run) samples nothing and its summary is None.

    nvidia-smi takes a few hundred ms to start (NVML's initialisation): __enter__ returns only once
    its first sample came (at most start_timeout_s), so a short measurement is sampled from its
    start; a reader thread collects the lines as they come. Power is the board's instantaneous
    draw (power.draw.instant) where the driver has it: Ampere and newer report power.draw as a
    1 s average, which blurs a measurement shorter than that with the idle time around it."""

    def __init__(self, interval_ms: int = 20, enabled: bool = True, start_timeout_s: float = 5.0):
        self.interval_ms = interval_ms
        self.enabled = enabled
        self.start_timeout_s = start_timeout_s
        self._proc: Optional[subprocess.Popen] = None
        self._reader: Optional[threading.Thread] = None
        self._first = threading.Event()
        self._lines: List[str] = []
        self._why: Optional[str] = None
        self._power_field = "power.draw"  # the field asked for (query())

    def _read(self) -> None:
        for line in self._proc.stdout:
            self._lines.append(line.rstrip("\n"))
            self._first.set()
        self._first.set()  # exited (or terminated): nobody waits for a first line any more

    def __enter__(self) -> "ClockLog":
        if not self.enabled:
            return self
        exe = shutil.which("nvidia-smi")
        if exe is None:
            self._why = "no nvidia-smi (not a GPU machine)"
            return self
        gpu = _first_visible_gpu()
        fields = query(exe, gpu)
        self._power_field = fields.split(",")[1]
        try:
            self._proc = subprocess.Popen(
                [exe, "-i", gpu, f"--query-gpu={fields}", "--format=csv,noheader,nounits",
                 "-lms", str(self.interval_ms)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError as e:
            self._why = f"nvidia-smi did not start: {e}"
            return self
        self._reader = threading.Thread(target=self._read, name="gpu-clock-log", daemon=True)
        self._reader.start()
        self._first.wait(self.start_timeout_s)
        return self

    def __exit__(self, *exc) -> None:
        if self._proc is None:
            return
        self._proc.terminate()
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._reader.join(timeout=5)
        self._proc = None

    def summary(self) -> Optional[Dict]:
        if not self.enabled:
            return None
        if self._why:
            return {"why": self._why}
        s = summarize(list(self._lines))
        if "why" not in s:
            s["power_field"] = self._power_field
        return s
