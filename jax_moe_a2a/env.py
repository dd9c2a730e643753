"""Every `JAX_MOE_A2A_*` environment variable, in one table.

The Python library reads its variables only through the accessors here (`get`, `get_str`,
`get_int`, `get_bool`), and only variables of the table can be read. The C++ side reads some
itself, when it creates an engine, a proxy thread or a communicator: they are in the table too,
with the file that reads them. Test-, script- and benchmark-only variables are listed as such.
docs/api.md's table is `markdown_table()` (a test keeps them equal).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

PREFIX = "JAX_MOE_A2A_"


@dataclasses.dataclass(frozen=True)
class Var:
    name: str          # without the prefix
    type: str          # "str", "int", "float", "bool" (1/0), or a choice such as "spin|adaptive"
    default: str       # what unset means, in words
    read_by: str       # where it is read
    meaning: str
    scope: str = "library"   # "library" (Python), "native" (C++), "test", "script", "benchmark"

    @property
    def full_name(self) -> str:
        return PREFIX + self.name


_LIB, _NATIVE, _TEST, _SCRIPT, _BENCH = "library", "native", "test", "script", "benchmark"

VARS = (
    # ---- the Python library --------------------------------------------------------------------
    Var("PROVIDER", "str", "shm", "jax_moe_a2a/backends/{host,cuda}.py; cc/transfer/engine.cc",
        "libfabric provider between processes (host backend, cuda inter-node path, TransferEngine), "
        "e.g. `tcp;ofi_rxm`, `efa`, `verbs;ofi_rxm`; the `provider` option wins"),
    Var("HOST_PROXIED", "bool", "0", "jax_moe_a2a/backends/host.py",
        "host backend: run the protocol on a proxy thread per rank (the `proxied` option wins)"),
    Var("NODE_SIZE", "int", "every rank on one node", "jax_moe_a2a/backends/cuda.py",
        "cuda backend: ranks per node (the `node_size` option wins)"),
    Var("MAX_PRIVATE_TOKENS", "int", "all rows", "jax_moe_a2a/backends/cuda.py",
        "cuda backend: rows per remote sender written before the counts arrive (the `max_private_tokens` "
        "option wins)"),
    Var("NVSHMEM_ARENA", "int", "2x the first communicator's need, >= 256 MiB", "jax_moe_a2a/backends/nvshmem.py",
        "nvshmem backend: bytes of the symmetric arena (fixed by the process's first communicator)"),
    Var("NVSHMEM_REMOTE", "auto|all", "auto", "jax_moe_a2a/backends/nvshmem.py (at init)",
        "nvshmem: `auto` puts combine rows for peers that loads and stores cannot reach (another node) "
        "through symmetric bounce rows; `all` for every other rank (tests)"),
    Var("LOCAL_PATH", "auto|0", "auto", "jax_moe_a2a/backends/ffi.py (at the first call of a communicator)",
        "cuda, nvshmem at EP = 1: `auto` runs dispatch and combine as one kernel each, without "
        "communication buffers; `0` runs the exchange halves"),
    Var("LOCAL_DEVICE_IDS", "str", "JAX decides", "jax_moe_a2a/runtime.py (examples/serve.py, tests/conftest.py)",
        "`local_device_ids` for jax.distributed.initialize: `0`, `0,1` (every process takes those) or "
        "`local_rank` (the Open MPI / Slurm node-local rank)"),
    Var("GEMM_TILE_M", "auto or a comma list", "auto", "jax_moe_a2a/gemm_ffi.py, at trace",
        "grouped GEMMs, measurements: tile rows, raster order, max swizzle, fp8 forward kernel, fused / unfused SwiGLU (docs/api.md, "
        "Grouped expert GEMMs: native kernels); else ValueError"),
    # ---- read by the extension (C++) -----------------------------------------------------------
    Var("IFACE", "str", "any", "cc/transfer/engine.cc, cc/transfer/fabric.cc",
        "libfabric domain names to open, comma-separated (e.g. `lo`)", _NATIVE),
    Var("HMEM", "bool", "0", "cc/transfer/engine.cc", "ask the provider for FI_HMEM", _NATIVE),
    Var("POST_TIMEOUT_S", "float", "30", "cc/transfer/engine.cc, cc/transfer/fabric_engine.cc",
        "seconds of -FI_EAGAIN retries before a post fails", _NATIVE),
    Var("RX_CQ_SIZE", "int", "16384", "cc/transfer/engine.cc", "receive completion queue entries", _NATIVE),
    Var("FI_THREADING", "domain", "provider's choice", "cc/transfer/fabric_engine.cc",
        "`domain` forces FI_THREADING_DOMAIN", _NATIVE),
    Var("PROGRESS", "adaptive|spin|backoff", "adaptive", "cc/transfer/progress.cc",
        "progress thread: `adaptive` polls during a proxy's transfers, else sleeps; `spin` never sleeps; "
        "`backoff` sleeps in transfers too, leaving them to the proxy's polls", _NATIVE),
    Var("PROGRESS_SPIN_US", "float", "50", "cc/transfer/progress.cc",
        "progress thread: keep polling this long after progress", _NATIVE),
    Var("PROGRESS_MAX_SLEEP_US", "float", "500", "cc/transfer/progress.cc",
        "progress thread: longest sleep", _NATIVE),
    Var("WAIT_SPIN_US", "float", "5", "cc/transfer/progress.cc", "waiters: busy-poll this long", _NATIVE),
    Var("WAIT_YIELD_US", "float", "20000", "cc/transfer/progress.cc",
        "waiters: yield this long, then sleep 20 us per poll", _NATIVE),
    Var("POLL_PROGRESS", "1|0", "0 (1 under PROGRESS=backoff)", "cc/transfer/progress.cc",
        "`0`: the proxy thread's polls only read what the progress thread delivered (over shm the copy of "
        "an incoming message runs there); `1`: they move the transport themselves", _NATIVE),
    Var("PROXY", "adaptive|spin|backoff", "adaptive", "cc/proxy/proxy.cc",
        "proxy thread (cuda inter-node path, host `proxied`): `adaptive` polls through transfers, "
        "`spin` never sleeps, `backoff` sleeps unless a packer waits", _NATIVE),
    Var("PROXY_CPUS", "str", "a CPU of the GPU's NUMA node; no GPU: not pinned", "cc/proxy/proxy.cc",
        "CPUs of the proxy threads, one per local rank (`3,7`), or `none`", _NATIVE),
    Var("PROXY_SPIN_US", "float", "20", "cc/proxy/proxy.cc", "proxy: keep polling this long after progress",
        _NATIVE),
    Var("PROXY_PIPELINE", "peer|priv|off", "peer", "cc/proxy/proxy.cc",
        "proxy: `peer` writes each peer's rows once packed, each OVER once its offset is known, and lets a "
        "receiver unpack per source; `priv`: OVER after every COUNTS; `off`: all after the whole pack",
        _NATIVE),
    Var("PROXY_MAX_SLEEP_US", "float", "100", "cc/proxy/proxy.cc", "proxy: longest sleep in the first idle_ms",
        _NATIVE),
    Var("PROXY_IDLE_MS", "float", "20", "cc/proxy/proxy.cc", "proxy: after this long without progress ...",
        _NATIVE),
    Var("PROXY_IDLE_SLEEP_US", "float", "2000", "cc/proxy/proxy.cc", "... sleeps grow up to this", _NATIVE),
    Var("PROXY_REPORT_S", "float", "the communicator's timeout_s", "cc/proxy/proxy.cc",
        "proxy: a slot with an op in flight and no step for this many seconds prints its flags and the proxy's "
        "steps to stderr, once per stall (a report, not an error); `0`: never", _NATIVE),
    Var("PROXY_TIMELINE", "str (a path prefix)", "off", "cc/proxy/timeline.h",
        "proxy: record the time of every protocol step and write them when the communicator closes, one file "
        "per proxy, `<prefix>.r<rank>.p<pid>.<n>.tsv` (benchmarks/proxy.py --timeline reads them)", _NATIVE),
    Var("WRITE_CHUNK_KIB", "float", "0 (one write a peer); cuda, copy rows, one remote peer a rank: 512",
        "cc/protocol/exchange.cc",
        "inter-node paths: PRIV and OVER writes in pieces of at most this many KiB, each staged apart "
        "(`STAGING=copy`); alike everywhere (checked)", _NATIVE),
    Var("COMB_PIECES", "int 1..64", "1 (or one a rail); cuda, copy rows, one remote peer a rank: 4",
        "cc/protocol/exchange.cc",
        "inter-node paths: each COMB write in this many pieces, empty ones too, copied like "
        "`WRITE_CHUNK_KIB`'s; alike everywhere (checked)", _NATIVE),
    Var("COPY_DEPTH", "int 1..16", "16", "cc/proxy/proxy.cc",
        "row staging (`STAGING=copy`): copies of one buffer in flight at once (1: one after another)", _NATIVE),
    Var("RAILS", "int 1..16", "1; cuda, copy rows: 2", "cc/transfer/engine.cc (at communicator creation)",
        "fabric engines' domains (rails) per rank, each with its own progress thread; large "
        "PRIV / OVER writes and every COMB split over them; alike everywhere (checked)", _NATIVE),
    Var("KERNEL_TIMING", "0|1|nosync", "0", "cc/gpu/kernel_timer.h (cuda, nvshmem: at communicator creation)",
        "GPU backends: CUDA events around each launch (`comm.kernel_seconds`); `1` with a GPU-side "
        "barrier of the EP group before each, `nosync` without",
        _NATIVE),
    Var("PRELOAD_KERNELS", "bool", "1", "cc/cuda/preload.cc (at communicator creation)",
        "cuda: load every kernel at communicator creation, not at its first launch in a step "
        "(docs/gpu_kernels.md); `0` leaves them to CUDA_MODULE_LOADING", _NATIVE),
    Var("LAUNCH_INFO", "bool", "0", "cc/cuda/preload.cc (at communicator creation)",
        "cuda: print the device's SM count, the context's SM limit, module loading and every kernel's grid, "
        "registers and occupancy to stderr", _NATIVE),
    Var("DISPATCH_SEND", "auto|grid|block", "auto", "cc/cuda/dispatch/send.cu (once per process)",
        "cuda: the dispatch_send kernel; `auto` the block-routed one where it applies, `block` "
        "with shared-memory staging, `grid` the grid-routed one (docs/gpu_kernels.md)",
        _NATIVE),
    Var("GDRCOPY", "auto|0|1", "auto", "cc/proxy/gdrcopy.cc, cc/cuda/remote_path.cc",
        "cuda inter-node path: the proxy writes its flags into GPU memory through GDRCopy where "
        "/dev/gdrdrv and libgdrapi.so.2 exist (`1`: required, `0`: never)", _NATIVE),
    Var("STAGING", "auto|host|copy|device", "auto", "cc/cuda/remote_path.cc",
        "cuda inter-node path: where rows from and to other nodes live: `host` pinned, `copy` GPU "
        "memory copied, `device` GPU memory (GPUDirect); `auto`: `copy` under eager module loading, "
        "else `host`", _NATIVE),
    Var("GDRCOPY_LIB", "str", "libgdrapi.so.2", "cc/proxy/gdrcopy.cc", "GDRCopy library to dlopen (tests)", _NATIVE),
    Var("GDRCOPY_DEV", "str", "/dev/gdrdrv", "cc/proxy/gdrcopy.cc", "GDRCopy device node to look for (tests)",
        _NATIVE),
    Var("HOST_FLAG_MIRROR", "bool", "0", "cc/host/host_comm.cc",
        "host backend, proxied: the proxy stores its flags into a second block as it would through GDRCopy, "
        "and the host reads them only there (tests of the GDRCopy store path on CPUs)", _NATIVE),
    Var("HOST_STAGED", "bool", "0", "cc/host/host_comm.cc (at communicator creation)",
        "host backend, proxied, tests: rows packed in buffers apart from the registered ones, the "
        "proxy copying them as under `STAGING=copy`",
        _NATIVE),
    Var("HOST_RECV_PAUSE_S", "float", "0", "cc/host/host_comm.cc (at communicator creation)",
        "host backend, tests: each dispatch_recv sleeps this long after its rows arrived and before it reads "
        "them (a receiver held in the middle of its read: tests/test_elastic.py)", _NATIVE),
    Var("HOST_PACK_PAUSE_S", "float", "0", "cc/host/host_comm.cc (at communicator creation)",
        "host backend, proxied, tests: dispatch_send sleeps this long after publishing each remote "
        "destination's rows but the last (tests/test_proxy_pipeline.py)", _NATIVE),
    Var("HOST_COPY_PAUSE_S", "float", "0", "cc/host/host_comm.cc (at communicator creation)",
        "host backend, `HOST_STAGED`, tests: each row copy of the proxy takes at least this long (a slow "
        "copy engine: the pieces of a write go out apart; tests/test_staging.py)", _NATIVE),
    # ---- tests ---------------------------------------------------------------------------------
    Var("TEST_DEVICES", "int", "8 (1 per process under mpirun)", "tests/conftest.py",
        "CPU devices per test process", _TEST),
    Var("TEST_BACKENDS", "str", "every available backend", "tests/test_ops.py, test_grad.py, test_protocol.py",
        "comma-separated backends the op tests run", _TEST),
    Var("MPI_ALL_CASES", "bool", "0", "tests/test_ops.py", "run every op case under mpirun too", _TEST),
    Var("SOAK_STEPS", "int", "1000 (100 under mpirun)", "tests/test_protocol.py", "steps of the soak test", _TEST),
    Var("PROXY_SOAK_STEPS", "int", "300", "tests/test_proxy.py", "steps of the proxy soak",
        _TEST),
    Var("TEST_TIMEOUT", "bool", "0", "tests/test_protocol.py",
        "run the never-calls timeout test on the GPU backends", _TEST),
    Var("TEST_WATCHDOG_S", "float", "0", "tests/watchdog.py, tests/conftest.py",
        "tests: S seconds (and 2 S) into a test still running, print every live communicator's "
        "last error and proxy counters; print a failure's report at once (0: off)", _TEST),
    Var("TEST_WORKERS", "int", "2", "scripts/test.sh",
        "pytest-xdist workers of the single-process suite (0: none)", _TEST),
    Var("RAGGED_EMULATE", "bool", "0", "tests/conftest.py, tests/ragged_emulation.py",
        "emulate ragged-all-to-all on XLA:CPU so the ragged backend's tests run", _TEST),
    # ---- scripts and benchmarks ----------------------------------------------------------------
    Var("NO_VENV", "bool", "0", "scripts/setup.sh", "use the current Python as is, no .venv", _SCRIPT),
    Var("EXTRAS", "str", "bench,test", "scripts/setup.sh", "pip extras to install", _SCRIPT),
    Var("NO_APT", "bool", "0", "scripts/setup.sh", "install no system packages; print the apt-get line instead",
        _SCRIPT),
    Var("SETUP_DRY_RUN", "bool", "0", "scripts/setup.sh", "print the apt-get and pip commands without running them",
        _SCRIPT),
    Var("PIP_CHECK_DIR", "str", "a fresh temporary folder, removed at the end", "scripts/pip_install_check.sh",
        "where the clean virtual environment and the checkout's copy go (kept)", _SCRIPT),
    Var("COMMIT", "str", "git rev-parse HEAD", "benchmarks, scripts/gpu_check.sh",
        "commit recorded in benchmark results (copies without .git)", _BENCH),
    Var("ANCHOR_JSON", "str", "none", "benchmarks/halves.py, benchmarks/bench.py",
        "folder of the pplx anchor kit's pplx_N.json to merge into the halves table (as --anchor-json)", _BENCH),
)

TABLE = {v.full_name: v for v in VARS}


def var(name: str) -> Var:
    """The table's entry for `name` (with or without the prefix); KeyError if it is not listed."""
    full = name if name.startswith(PREFIX) else PREFIX + name
    if full not in TABLE:
        raise KeyError(f"{full} is not in jax_moe_a2a.env.VARS (every JAX_MOE_A2A_ variable is listed there)")
    return TABLE[full]


def get(name: str) -> Optional[str]:
    """The raw value, None when unset or empty."""
    return os.environ.get(var(name).full_name) or None


def get_str(name: str, default: Optional[str] = None) -> Optional[str]:
    v = get(name)
    return default if v is None else v


def get_int(name: str, default: Optional[int] = None) -> Optional[int]:
    v = get(name)
    if v is None:
        return default
    try:
        return int(v)
    except ValueError:
        raise ValueError(f"{var(name).full_name}={v!r}: expected an integer") from None


def get_bool(name: str, default: bool = False) -> bool:
    """Unset or empty: `default`; "0", "false", "no", "off": False; anything else True."""
    v = get(name)
    if v is None:
        return default
    return v.strip().lower() not in ("0", "false", "no", "off")


def markdown_table() -> str:
    """The table of docs/api.md."""
    rows = ["| variable | for | type | unset | read by | meaning |", "|---|---|---|---|---|---|"]
    for scope, title in ((_LIB, "library (Python)"), (_NATIVE, "extension (C++)"), (_TEST, "tests only"),
                         (_SCRIPT, "scripts only"), (_BENCH, "benchmarks only")):
        for v in VARS:
            if v.scope == scope:
                cells = (f"`{v.full_name}`", title, v.type, v.default, v.read_by, v.meaning)
                rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(rows)
