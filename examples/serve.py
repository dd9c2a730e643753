"""Multi-host serving example: one process per device, launched by mpirun.

    mpirun -n 4 python examples/serve.py                  # GPUs (one per process) or CPUs
    mpirun -n 2 python examples/serve.py --steps 8 --tokens 32

Each process initialises `jax.distributed` (Open MPI's environment is detected), builds the
DeepSeek-V3-shaped MoE layer of `jax_moe_a2a.models` with backend "auto" (cuda on GPUs, host on
CPUs) over a 1-D "ep" mesh of every device, and runs decode steps with a different number of
tokens per rank each step (every rank carries tokens in most steps; every third step one is
empty). Every process checks its ranks' outputs against a single-device dense computation of the
same layer (all experts, no communication), prints per-step latency and how many rows it
compared. Exits non-zero on a mismatch or when it compared no token rows.

Several processes sharing one GPU: set JAX_MOE_A2A_LOCAL_DEVICE_IDS=0 (every process takes GPU 0).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax

if int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1")) > 1:   # launched by mpirun: one JAX process per rank
    jax.config.update("jax_cpu_collectives_implementation", "gloo")   # CPU collectives (only CPUs use them)
    from jax_moe_a2a.runtime import local_device_ids_from_env  # "0": processes sharing GPU 0
    jax.distributed.initialize(local_device_ids=local_device_ids_from_env())

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import jax_moe_a2a as a2a  # noqa: E402
from jax_moe_a2a import models  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=6, help="decode steps (the first one compiles)")
    p.add_argument("--tokens", type=int, default=16, help="max tokens per rank T")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=128, help="routed expert width")
    p.add_argument("--shared-ffn", type=int, default=256)
    p.add_argument("--experts-per-rank", type=int, default=4)
    p.add_argument("--topk", type=int, default=4)
    p.add_argument("--backend", default="auto")
    p.add_argument("--no-overlap", action="store_true", help="one-shot ops instead of the split halves")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def global_rows(mesh, per_rank):
    """[N, d0, ...] numpy (every process holds all) -> global [N * d0, ...] split over "ep"."""
    full = per_rank.reshape(-1, *per_rank.shape[2:])
    return jax.make_array_from_callback(full.shape, NamedSharding(mesh, P("ep")), lambda idx: full[idx])


def token_counts(rng, step: int, n: int, t: int) -> np.ndarray:
    """[n] int32 tokens per rank for decode step `step`: 1..t on every rank, rank `step % n` full,
    and every third step (n > 1) the next rank empty, so each rank carries tokens in most steps."""
    nt = rng.integers(1, t + 1, n).astype(np.int32)
    nt[step % n] = t
    if n > 1 and step % 3 == 2:
        nt[(step + 1) % n] = 0
    return nt


def main(argv=None) -> int:
    args = parse_args(argv)
    mesh = Mesh(np.array(jax.devices()), ("ep",))
    n, t, h = mesh.size, args.tokens, args.hidden
    cfg = models.MoEConfig(hidden=h, ffn=args.ffn, num_experts=args.experts_per_rank * n, topk=args.topk,
                           shared_ffn=args.shared_ffn, score="sigmoid", param_dtype=jnp.bfloat16)
    spec = a2a.Spec(num_experts=cfg.num_experts, experts_per_token=cfg.topk, hidden=h, max_tokens_per_rank=t,
                    dispatch_dtype=jnp.bfloat16, combine_dtype=jnp.float32)
    comm = a2a.init(spec, mesh, "ep", backend=args.backend, collect_stats=False)
    me = jax.process_index()
    mine = [r for r, d in enumerate(mesh.devices.flat) if d.process_index == me]
    if me == 0:
        print(f"{jax.process_count()} processes, {n} ranks ({jax.devices()[0].platform}), backend "
              f"{comm.backend_name}, E={cfg.num_experts} K={cfg.topk} H={h} T={t}, "
              f"overlap={not args.no_overlap}", flush=True)

    local_params = models.init_moe_params(jax.random.PRNGKey(args.seed), cfg)   # the same on every process
    specs = models.moe_param_specs(cfg)
    params = {k: jax.make_array_from_callback(v.shape, NamedSharding(mesh, specs[k]), lambda idx, v=np.asarray(v): v[idx])
              for k, v in local_params.items()}
    step = jax.jit(lambda p, x, nt: models.moe_layer(comm, cfg, p, x, nt, overlap=not args.no_overlap))
    dense = jax.jit(lambda p, x, nt: models.dense_moe_block(cfg, spec, p, x, nt))

    rng = np.random.default_rng(args.seed + 1)
    failed = 0
    token_rows = pad_rows = 0   # rows this process compared: with tokens, and padding past num_tokens
    for i in range(args.steps):
        x = rng.standard_normal((n, t, h)).astype(np.float32)
        nt = token_counts(rng, i, n, t)
        xg, ng = global_rows(mesh, x.astype(jnp.bfloat16)), global_rows(mesh, nt)
        t0 = time.perf_counter()
        out = step(params, xg, ng)
        out.block_until_ready()
        ms = (time.perf_counter() - t0) * 1e3
        err = 0.0
        for sh in out.addressable_shards:
            r = (sh.index[0].start or 0) // t
            want = np.asarray(dense(local_params, jnp.asarray(x[r], jnp.bfloat16), nt[r]))
            got = np.asarray(sh.data)
            e = np.abs(got - want).max() / (np.abs(want).max() + 1e-6)
            token_rows += int(nt[r])
            pad_rows += t - int(nt[r])
            err = max(err, float(e))
            if not e <= 2e-2:
                failed += 1
                print(f"step {i} rank {r}: MISMATCH, max relative error {e:.3g}", flush=True)
        if me == 0:
            note = " (compile)" if i == 0 else ""
            print(f"step {i}: tokens/rank {nt.tolist()}  {ms:8.2f} ms{note}  max rel err {err:.2e} (process 0's ranks)", flush=True)
    if token_rows == 0:   # a check that compared no tokens checks nothing
        failed += 1
    print(f"process {me}: ranks {mine}: {'FAILED' if failed else 'OK'}: compared {token_rows} token rows "
          f"(and {pad_rows} padding rows) over {args.steps} steps", flush=True)
    comm.close()
    return 1 if failed else 0


if __name__ == "__main__":
    rc = main()
    if jax.process_count() > 1:
        jax.distributed.shutdown()
    sys.exit(rc)
