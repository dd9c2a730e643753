"""The one configuration (jax_moe_a2a.config.Config -> _C.Config): built once from the Spec, the
rank count and the backend's options; C++ derives the shape and the buffer sizes from it; the
backend is opened from it and never sees the communicator."""

import dataclasses
import inspect

import jax.numpy as jnp
import numpy as np
import pytest

import jax_moe_a2a as a2a
from jax_moe_a2a import _ffi
from jax_moe_a2a.backends.base import Backend
from jax_moe_a2a.backends import backend_class
from jax_moe_a2a.config import Config, Dtype, Layout

SPEC = a2a.Spec(num_experts=16, experts_per_token=2, hidden=32, max_tokens_per_rank=4)
SPECS = [
    a2a.Spec(num_experts=256, experts_per_token=8, hidden=7168, max_tokens_per_rank=128),
    a2a.Spec(num_experts=256, experts_per_token=8, hidden=7168, max_tokens_per_rank=128,
             dispatch_dtype=jnp.float8_e4m3fn, recv_capacity=1000),
    a2a.Spec(num_experts=64, experts_per_token=4, hidden=512, max_tokens_per_rank=17, tp_size=2,
             layout="expert_major", dispatch_dtype=jnp.float32, slots=3),
]


def _native():
    if _ffi._C is None:
        pytest.skip(f"native module not built: {_ffi._IMPORT_ERROR}")
    return _ffi._C


def test_build_reads_the_spec():
    spec = SPECS[1]
    c = Config.build(spec, 8, backend_class("reference"), timeout_s=5.0)
    assert (c.num_ranks, c.num_experts, c.experts_per_token, c.hidden, c.max_tokens_per_rank) == (8, 256, 8, 7168, 128)
    assert c.dispatch_dtype is Dtype.F8_E4M3FN and c.combine_dtype is Dtype.BF16 and c.layout is Layout.RAGGED
    assert c.num_scales == spec.num_scales == 56 and c.recv_rows == spec.recv_rows(8) == 1000
    assert c.timeout_s == 5.0 and c.local_experts == 32
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.hidden = 1
    assert hash(c) == hash(Config.build(spec, 8, backend_class("reference"), timeout_s=5.0))


def test_dtype_codes():
    assert [Dtype.of(d) for d in (jnp.float32, jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn)] == [0, 1, 2, 3]
    assert Dtype.BF16.numpy == np.dtype(jnp.bfloat16) and Dtype.F8_E4M3FN.itemsize == 1
    with pytest.raises(ValueError, match="no jax_moe_a2a dtype code"):
        Dtype.of(np.int8)


def test_python_and_cpp_enums_agree():
    c = _native()
    assert {m.name: int(m) for m in Dtype} == {m.name: int(m.value) for m in c.Dtype}
    assert {m.name: int(m) for m in Layout} == {m.name: int(m.value) for m in c.Layout}


@pytest.mark.parametrize("spec", SPECS, ids=["bf16", "fp8-capacity", "f32-tp2-expert-major"])
def test_native_config_and_its_shape(spec):
    _native()
    cfg = Config.build(spec, 8, backend_class("reference"))
    nat = cfg.native()
    for f in dataclasses.fields(cfg):
        if f.name != "backend":
            assert int(getattr(nat, f.name)) == int(getattr(cfg, f.name)) if not isinstance(
                getattr(cfg, f.name), str) else getattr(nat, f.name) == getattr(cfg, f.name), f.name
    s = nat.shape()
    assert (s["N"], s["E"], s["L"], s["K"], s["H"], s["T"], s["tp"], s["S"]) == (
        8, spec.num_experts, spec.local_experts(8), spec.experts_per_token, spec.hidden, spec.max_tokens_per_rank,
        spec.tp_size, spec.num_scales)
    assert s["P"] == spec.rows_per_peer(8) and s["capacity"] == spec.recv_rows(8)
    assert s["payload"] == spec.hidden * spec.dispatch_dtype.itemsize
    assert s["c_row"] == spec.hidden * spec.combine_dtype.itemsize
    assert s["row"] == -(-(spec.token_bytes() + 8) // 16) * 16
    assert s["wire_kind"] == int(Dtype.of(spec.dispatch_dtype)) and s["layout"] == int(Layout.of(spec.layout))


def test_unknown_options_raise_naming_the_valid_ones(mesh):
    with pytest.raises(ValueError, match=r"reference backend: unknown option\(s\) unknown_option; its options: none"):
        a2a.init(SPEC, mesh, "ep", backend="reference", unknown_option=1)
    with pytest.raises(ValueError, match=r"cuda backend: unknown option\(s\) unknown_option; its options: "
                                         r"max_private_tokens, node_size, provider"):
        Config.build(SPEC, 8, backend_class("cuda"), options={"unknown_option": 1})
    with pytest.raises(ValueError, match=r"host backend: unknown option\(s\) unknown_option; its options: "
                                         r"engine, max_private_tokens, node_size, provider, proxied"):
        Config.build(SPEC, 8, backend_class("host"), options={"unknown_option": 1})


def _pad(b):
    return (b + 15) // 16 * 16


def _host_bytes(spec, n, priv_rows):
    """The host backend's size by its formula (protocol::SlotLayout): combine rows of H values of
    Spec.combine_dtype (a wider y is cast to it before combine_send)."""
    l_count, p = spec.local_experts(n), spec.rows_per_peer(n)
    priv = p if priv_rows is None else min(priv_rows, p)
    row = _pad(spec.hidden * spec.dispatch_dtype.itemsize + 4 * spec.num_scales + 8)
    d_recv = _pad(n * n * l_count * 4) + n * priv * row + n * (p - priv) * row
    d_send = _pad(n * l_count * 4) + n * p * row
    c_row = spec.hidden * spec.combine_dtype.itemsize
    q = spec.tokens_per_member() * spec.experts_per_token  # combine rows per tp member: [tp][Q]
    return spec.slots * (d_recv + d_send + n * p * c_row + spec.tp_size * q * c_row)


def _cuda_bytes(spec, n):
    """cuda::make_geometry's shared + private bytes by formula (combine rows in the combine dtype)."""
    l_count, p, t = spec.local_experts(n), spec.rows_per_peer(n), spec.max_tokens_per_rank
    row = _pad(spec.hidden * spec.dispatch_dtype.itemsize + 4 * spec.num_scales + 8)
    q = spec.tokens_per_member() * spec.experts_per_token  # combine rows per tp member: [tp][Q]
    off_rows = _pad(5 * 64 * 8) + _pad(n * (l_count + 1) * 4)  # SyncFlags: five [64] uint64 flag arrays
    shared = _pad(off_rows + n * p * row + spec.tp_size * q * spec.hidden * spec.combine_dtype.itemsize)
    scratch = 4 * (2 * t * spec.experts_per_token + 2 * spec.tp_size * spec.num_experts + spec.tp_size * n)
    # Epochs: 64 bytes of counters, proxy_seen [4] uint64, over_base [64] int64; owed FREE values [2][N] uint64
    private = _pad(t * row + _pad(scratch) + 64 + 4 * 8 + 64 * 8 + 2 * 8 * n)
    return spec.slots * (shared + private)


@pytest.mark.parametrize("spec", SPECS, ids=["bf16", "fp8-capacity", "f32-tp2-expert-major"])
def test_buffer_sizes_come_from_cpp(spec):
    c = _native()
    n = 8
    if c.built_with_libfabric():
        from jax_moe_a2a.backends.host import HostBackend
        for priv in (None, 0, 3):
            cfg = Config.build(spec, n, backend_class("host"), options={} if priv is None else {"max_private_tokens": priv})
            regions = HostBackend().buffer_regions(cfg)
            assert sum(regions.values()) == HostBackend().buffer_bytes(cfg) == _host_bytes(spec, n, priv)
    if c.built_with_cuda():
        from jax_moe_a2a.backends.cuda import CudaBackend
        cfg = Config.build(spec, n, backend_class("cuda"))
        regions = CudaBackend().buffer_regions(cfg)
        assert CudaBackend().buffer_bytes(cfg) == sum(regions.values()) == _cuda_bytes(spec, n)
        assert not any(k.startswith("remote_") for k in regions)
        if c.built_with_libfabric():  # peers on other nodes: the inter-node buffers are listed, not counted
            far = Config.build(spec, n, backend_class("cuda"), options={"node_size": 4})
            r = CudaBackend().buffer_regions(far)
            assert {k for k in r if k.startswith("remote_")} == {
                "remote_counts", "remote_dispatch_send", "remote_dispatch_recv", "remote_combine_send",
                "remote_combine_recv"}
            assert CudaBackend().buffer_bytes(far) == _cuda_bytes(spec, n)
    if c.built_with_nvshmem():
        from jax_moe_a2a.backends.nvshmem import NvshmemBackend
        cfg = Config.build(spec, n, backend_class("nvshmem"))
        assert NvshmemBackend().buffer_bytes(cfg) == sum(NvshmemBackend().buffer_regions(cfg).values())
        assert NvshmemBackend().buffer_bytes(cfg) % 256 == 0


@pytest.mark.parametrize("backend", ["reference", "host"])
def test_communicator_reports_and_the_backend_never_holds_it(mesh, backend):
    if backend not in a2a.available_backends():
        pytest.skip(f"{backend} backend not available")
    comm = a2a.init(SPEC, mesh, "ep", backend=backend)
    try:
        assert comm.config == Config.build(SPEC, comm.num_ranks, backend_class(backend), timeout_s=comm.timeout_s)
        regions = comm.buffer_regions()
        assert regions and sum(regions.values()) == comm.buffer_bytes() == comm.stats()["buffer_bytes_per_rank"]
        assert comm.proxy_stats() == {} if backend == "reference" else set(comm.proxy_stats()) <= set(range(8))
        assert comm.kernel_seconds("dispatch_send") is None and comm.last_error() is None
        assert comm.diagnostics()["backend"] == backend
        with pytest.raises(ValueError, match="half"):
            comm.kernel_seconds("dispatch")
        assert not any(v is comm for v in vars(comm._backend).values())
    finally:
        comm.close()
    comm.close()  # idempotent


def test_backend_contract_is_declared():
    assert list(inspect.signature(Backend.open).parameters) == ["self", "config", "mesh", "axis", "comm_id"]
    for name in ("proxy_stats", "kernel_seconds", "last_error", "diagnostics", "close", "buffer_regions",
                 "buffer_bytes", "transport"):
        assert callable(getattr(Backend, name)), name
    assert not hasattr(Backend, "init")


def test_ep8_decode_buffers():
    """Issue 15 item 4, computed for EP8 without eight GPUs: DeepSeek-V3 decode (E=256, top-8,
    H=7168, T=128 per rank, fp8 dispatch, bf16 combine, two slots) on the cuda backend, at most
    256 MiB per rank. The combine region holds bf16 rows (it held f32 rows before: 565.6 MiB) and
    [tp][Q] of them, Q = ceil(T / tp) * K, each source laying the rows from expert rank d after
    those of lower ranks (it held [N][tp][P], P = ceil(T / tp) * min(K, L): 341.6 MiB)."""
    c = _native()
    if not c.built_with_cuda():
        pytest.skip("built without the CUDA kernels")
    from jax_moe_a2a.backends.cuda import CudaBackend
    spec = a2a.Spec(num_experts=256, experts_per_token=8, hidden=7168, max_tokens_per_rank=128,
                    dispatch_dtype=jnp.float8_e4m3fn, combine_dtype=jnp.bfloat16, slots=2)
    cfg = Config.build(spec, 8, backend_class("cuda"))
    regions = CudaBackend().buffer_regions(cfg)
    total = CudaBackend().buffer_bytes(cfg)
    assert total == sum(regions.values()) == _cuda_bytes(spec, 8) == 152_658_496
    assert regions["shared_combine_rows"] == 2 * 1024 * 7168 * 2     # [tp][Q][H] bf16, per slot
    assert regions["shared_dispatch_rows"] == 2 * 8 * 1024 * 7408     # [N src][P][row], fp8 rows + scales
    assert total / 2**20 < 146 <= 256
    if c.built_with_nvshmem():  # the same regions, and the meta blocks instead of counts records
        from jax_moe_a2a.backends.nvshmem import NvshmemBackend
        nv = NvshmemBackend().buffer_regions(cfg)
        assert nv["shared_combine_rows"] == regions["shared_combine_rows"]
        assert NvshmemBackend().buffer_bytes(cfg) / 2**20 < 256
