"""Bad inputs raise ValueError at trace time, naming the argument and the expected value."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import jax_moe_a2a as a2a
from jax_moe_a2a.testing import shard_map

SPEC = a2a.Spec(num_experts=16, experts_per_token=2, hidden=128, max_tokens_per_rank=8,
                dispatch_dtype=jnp.float8_e4m3fn, scale_block=64)
T, H, K = 8, 128, 2


def _trace(comm, fn, *shapes):
    """Traces fn per rank under shard_map (no execution)."""
    N = comm.num_ranks
    f = shard_map(fn, mesh=comm.mesh, in_specs=tuple(P("ep") for _ in shapes), out_specs=P("ep"))
    args = [jax.ShapeDtypeStruct((N * s[0][0],) + tuple(s[0][1:]), s[1]) for s in shapes]
    return jax.eval_shape(f, *args)


@pytest.fixture(scope="module")
def comm(mesh):
    return a2a.init(SPEC, mesh, "ep", backend="reference")


def _dispatch(comm, x_shape, x_dtype, ids_shape, ids_dtype, w_shape, w_dtype, **kw):
    def fn(x, ids, w):
        got = comm.dispatch(x, ids, w, **kw)
        return got.x
    return _trace(comm, fn, (x_shape, x_dtype), (ids_shape, ids_dtype), (w_shape, w_dtype))


GOOD = dict(x_shape=(T, H), x_dtype=jnp.bfloat16, ids_shape=(T, K), ids_dtype=jnp.int32,
            w_shape=(T, K), w_dtype=jnp.float32)


def test_good_call_traces(comm):
    out = _dispatch(comm, **GOOD)
    n = comm.num_ranks
    assert out.shape == (n * SPEC.recv_rows(n), H) and out.dtype == jnp.float8_e4m3fn


@pytest.mark.parametrize("change, needle", [
    (dict(x_shape=(T + 1, H)), r"x: expected shape \[T, H\] = \[8, 128\]"),
    (dict(x_shape=(T, H * 2)), r"x: expected shape"),
    (dict(x_dtype=jnp.int32), r"x: expected dtype"),
    (dict(ids_shape=(T, K + 1)), r"topk_ids: expected shape \[T, K\] = \[8, 2\]"),
    (dict(ids_dtype=jnp.float32), r"topk_ids: expected dtype int32"),
    (dict(w_shape=(T, 1)), r"topk_weights: expected shape"),
    (dict(w_dtype=jnp.bfloat16), r"topk_weights: expected dtype float32"),
    (dict(x_dtype=jnp.float8_e4m3fn), r"x_scale: required"),
], ids=lambda v: "-".join(v) if isinstance(v, dict) else None)
def test_bad_dispatch_args(comm, change, needle):
    with pytest.raises(ValueError, match=needle):
        _dispatch(comm, **{**GOOD, **change})


@pytest.mark.parametrize("slot", [-1, 2, 1.0, True])
def test_bad_slot(comm, slot):
    with pytest.raises(ValueError, match=r"slot: expected an int in \[0, 2\)"):
        _dispatch(comm, **GOOD, slot=slot)


def test_bad_num_tokens(comm):
    with pytest.raises(ValueError, match="num_tokens"):
        _dispatch(comm, **GOOD, num_tokens=T + 1)
    with pytest.raises(ValueError, match="num_tokens"):
        _dispatch(comm, **GOOD, num_tokens=jnp.zeros((2,), jnp.int32))


def test_fp8_input_needs_fp8_spec(mesh):
    c = a2a.init(SPEC.replace(dispatch_dtype=jnp.bfloat16), mesh, "ep", backend="reference")
    with pytest.raises(ValueError, match="fp8 input needs"):
        _dispatch(c, **{**GOOD, "x_dtype": jnp.float8_e4m3fn})


def test_combine_checks(comm, mesh):
    other = a2a.init(SPEC, mesh, "ep", backend="reference")

    def bad_y(x, ids, w):
        got = comm.dispatch(x, ids, w)
        return comm.combine(jnp.zeros((3, H), jnp.bfloat16), got)

    def wrong_comm(x, ids, w):
        got = comm.dispatch(x, ids, w)
        return other.combine(jnp.zeros(got.x.shape, jnp.bfloat16), got)

    def bad_out(x, ids, w):
        got = comm.dispatch(x, ids, w)
        return comm.combine(jnp.zeros(got.x.shape, jnp.bfloat16), got, out=jnp.zeros((T, 3)))

    def bad_y_dtype(x, ids, w):
        got = comm.dispatch(x, ids, w)
        return comm.combine(jnp.zeros(got.x.shape, jnp.int8), got)

    shapes = ((GOOD["x_shape"], jnp.bfloat16), ((T, K), jnp.int32), ((T, K), jnp.float32))
    for fn, needle in [(bad_y, r"y: expected shape \[\d+, 128\]"), (wrong_comm, "another communicator"),
                       (bad_out, r"out: expected shape \[T, H\]"), (bad_y_dtype, "y: expected dtype")]:
        with pytest.raises(ValueError, match=needle):
            _trace(comm, fn, *shapes)


def test_outside_shard_map(comm):
    with pytest.raises(ValueError, match="inside jax.shard_map"):
        jax.eval_shape(lambda x, i, w: comm.dispatch(x, i, w).x,
                       jax.ShapeDtypeStruct((T, H), jnp.bfloat16), jax.ShapeDtypeStruct((T, K), jnp.int32),
                       jax.ShapeDtypeStruct((T, K), jnp.float32))


def test_init_errors(mesh):
    if mesh.size > 1:
        with pytest.raises(ValueError, match="num_experts .* divisible"):
            a2a.init(SPEC.replace(num_experts=mesh.size * 2 + 1, experts_per_token=2), mesh, "ep",
                     backend="reference")
    with pytest.raises(ValueError, match="axis: 'tp' is not an axis"):
        a2a.init(SPEC, mesh, "tp", backend="reference")
    with pytest.raises(ValueError, match="unknown backend"):
        a2a.init(SPEC, mesh, "ep", backend="nccl")
    with pytest.raises(ValueError, match="spec: expected"):
        a2a.init({"num_experts": 16}, mesh, "ep")
    with pytest.raises(ValueError, match="tp_size"):
        a2a.init(SPEC.replace(tp_size=mesh.size + 1), mesh, "ep", backend="reference")


def test_auto_never_picks_nvshmem(monkeypatch):
    """backend="auto" skips nvshmem even where it is the only one usable (it is used by name only)."""
    from jax_moe_a2a import backends
    for name in backends.known():
        monkeypatch.setitem(backends._AVAILABLE, name, (lambda n: lambda: None if n == "nvshmem" else "off")(name))
    assert a2a.available_backends() == ["nvshmem"]
    with pytest.raises(RuntimeError, match="no jax_moe_a2a backend is available"):
        backends.create("auto")


def test_gpu_kernel_limits_are_clear_errors():
    """Past the GPU kernels' limits (64 ranks; the receive arrangement in a block's 48 KiB of shared
    memory, about 4,000 experts) the cuda and nvshmem backends refuse at init with a ValueError
    naming the limit; no GPU needed to check the rule."""
    import pytest
    from jax_moe_a2a.backends.cuda import CudaBackend
    from jax_moe_a2a.backends.nvshmem import NvshmemBackend
    for be in (CudaBackend, NvshmemBackend):
        be.check_shape(a2a.Spec(num_experts=1024, experts_per_token=16, hidden=128, max_tokens_per_rank=8), 8)
        with pytest.raises(ValueError, match="shared memory"):
            be.check_shape(a2a.Spec(num_experts=8192, experts_per_token=8, hidden=128, max_tokens_per_rank=8), 1)
        with pytest.raises(ValueError, match="at most 64 ranks"):
            be.check_shape(a2a.Spec(num_experts=128, experts_per_token=8, hidden=128, max_tokens_per_rank=8), 128)
