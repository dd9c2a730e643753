"""Timing helpers: per-iteration wall times, max across processes, percentiles.

Barriers and gathers go through the jax.distributed key-value store, not XLA collectives, so
they also work where XLA's collectives cannot (several processes sharing one GPU)."""

from __future__ import annotations

import itertools
import json
import time
from typing import Callable, List

import jax
import numpy as np

_BARRIERS = itertools.count()


def block(tree):
    jax.block_until_ready(tree)
    return tree


def barrier(name: str = "bench", timeout_s: float = 300.0):
    if jax.process_count() > 1:
        from jax_moe_a2a.runtime import kv_client
        kv_client().wait_at_barrier(f"jax_moe_a2a_bench_{name}_{next(_BARRIERS)}", int(timeout_s * 1000))


def time_once(fn: Callable, *args):
    """Runs fn(*args) to completion; returns (result, seconds)."""
    t0 = time.perf_counter()
    out = block(fn(*args))
    return out, time.perf_counter() - t0


def gather(value, name: str = "gather") -> list:
    """Every process's JSON-able `value`, in process order (collective: every process calls it in
    the same order with the same name)."""
    if jax.process_count() == 1:
        return [value]
    from jax_moe_a2a.runtime import kv_client
    client = kv_client()
    key = f"jax_moe_a2a_bench_{name}_{next(_BARRIERS)}"
    client.key_value_set(f"{key}/{jax.process_index()}", json.dumps(value))
    return [json.loads(client.blocking_key_value_get(f"{key}/{p}", 300_000)) for p in range(jax.process_count())]


def max_over_processes(samples: List[float], name: str = "times") -> np.ndarray:
    """[iters] seconds per process -> [iters] max over processes (the slowest rank decides)."""
    arr = np.asarray(samples, np.float64)
    if jax.process_count() > 1:
        arr = np.max(np.asarray(gather(arr.tolist(), name), np.float64), axis=0)
    return arr


def summarize(seconds: np.ndarray) -> dict:
    us = np.asarray(seconds) * 1e6
    return {"p50_us": float(np.percentile(us, 50)), "p99_us": float(np.percentile(us, 99)),
            "p10_us": float(np.percentile(us, 10)), "p90_us": float(np.percentile(us, 90)),
            "mean_us": float(us.mean()), "min_us": float(us.min()), "max_us": float(us.max()),
            "iters": int(us.size)}


def keep_going(done: int, spent_s: float, least: int, min_time_s: float, cap: int) -> bool:
    """Whether to time another repeat: at least `least`, then more while the timed ones took less
    than `min_time_s` seconds in all, up to `cap` (fast calls on a noisy CPU get many samples, slow
    ones the minimum)."""
    return done < least or (spent_s < min_time_s and done < max(cap, least))


def resolve_min_time(args, gpu: bool) -> float:
    """--min-time: seconds of timed repeats per backend and shape (default 2 on CPUs, 0 on GPUs and
    with --quick). 0 with several processes: each would stop after its own count, and the
    barriers between the calls need every process to make the same calls."""
    if jax.process_count() > 1:
        return 0.0
    if args.min_time is not None:
        return args.min_time
    return 0.0 if gpu or args.quick else 2.0
