"""Timing helpers: per-iteration wall times, max across processes, percentiles."""

from __future__ import annotations

import time
from typing import Callable, List

import jax
import numpy as np


def block(tree):
    jax.block_until_ready(tree)
    return tree


def barrier(name: str = "bench"):
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices(name)


def time_once(fn: Callable, *args):
    """Runs fn(*args) to completion; returns (result, seconds)."""
    t0 = time.perf_counter()
    out = block(fn(*args))
    return out, time.perf_counter() - t0


def max_over_processes(samples: List[float]) -> np.ndarray:
    """[iters] seconds per process -> [iters] max over processes (the slowest rank decides)."""
    arr = np.asarray(samples, np.float64)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        arr = np.asarray(multihost_utils.process_allgather(arr)).reshape(jax.process_count(), -1).max(axis=0)
    return arr


def summarize(seconds: np.ndarray) -> dict:
    us = np.asarray(seconds) * 1e6
    return {"p50_us": float(np.percentile(us, 50)), "p99_us": float(np.percentile(us, 99)),
            "mean_us": float(us.mean()), "min_us": float(us.min()), "max_us": float(us.max()),
            "iters": int(us.size)}
