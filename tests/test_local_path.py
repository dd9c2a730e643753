"""The GPU backends' EP = 1 local path (jax_moe_a2a/backends/ffi.py, cc/gpu/local), checked on CPUs:
which communicators take it, and the plumbing of its two FFI calls (which targets, operands in
the handlers' order, results where the exchange halves put theirs). The kernels themselves run on
the GPU only: there the single-process suite (EP = 1) runs every oracle case through them, and
the same cases with JAX_MOE_A2A_LOCAL_PATH=0 through the exchange kernels."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_moe_a2a as a2a
from jax_moe_a2a.backends.base import Ctx
from jax_moe_a2a.backends.cuda import CudaBackend
from jax_moe_a2a.backends.host import HostBackend
from jax_moe_a2a.backends.nvshmem import NvshmemBackend
from jax_moe_a2a.types import Route

SPEC = a2a.Spec(num_experts=8, experts_per_token=2, hidden=32, max_tokens_per_rank=4,
                dispatch_dtype=jnp.float8_e4m3fn, combine_dtype=jnp.bfloat16)


@pytest.mark.parametrize("cls", [CudaBackend, NvshmemBackend])
def test_gpu_backends_take_it_at_ep1_only(cls, monkeypatch):
    monkeypatch.delenv("JAX_MOE_A2A_LOCAL_PATH", raising=False)
    assert cls().uses_local_path(1) is True
    assert cls().uses_local_path(2) is False
    monkeypatch.setenv("JAX_MOE_A2A_LOCAL_PATH", "0")
    assert cls().uses_local_path(1) is False
    b = cls()  # decided once per communicator: a later change of the variable does not split its calls
    monkeypatch.setenv("JAX_MOE_A2A_LOCAL_PATH", "auto")
    assert b.uses_local_path(1) is True
    monkeypatch.setenv("JAX_MOE_A2A_LOCAL_PATH", "0")
    assert b.uses_local_path(1) is True


def test_host_backend_never_does():
    assert HostBackend().uses_local_path(1) is False


def _recorder(cls):
    """A backend of class cls whose FFI calls are recorded (half, operand shapes, attribute names)
    and answered with zeros of the declared shapes."""

    class Recorder(cls):
        def __init__(self):
            self.calls = []

        def _call(self, half, outs, ctx, *operands, **attrs):
            self.calls.append((half, [tuple(np.shape(o)) for o in operands], sorted(attrs)))
            return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), outs)

    return Recorder()


def _ctx(n):
    return Ctx(spec=SPEC, num_ranks=n, axis="ep", rank=jnp.int32(0), comm_id=7, call_id=3)


@pytest.mark.parametrize("n", [1, 2])
def test_halves_call_the_local_targets_at_ep1(n, monkeypatch):
    monkeypatch.delenv("JAX_MOE_A2A_LOCAL_PATH", raising=False)
    b = _recorder(CudaBackend)
    ctx = _ctx(n)
    t, k, h = SPEC.max_tokens_per_rank, SPEC.experts_per_token, SPEC.hidden
    x = jnp.zeros((t, h), jnp.float32)
    ids = jnp.zeros((t, k), jnp.int32)
    w = jnp.ones((t, k), jnp.float32)
    sent = b.dispatch_send(ctx, x, None, ids, w, jnp.int32(t), 0)
    got = b.dispatch_recv(ctx, sent.wire, sent.placement, 0)
    gx, scale, sizes, placement = got.x, got.scale, got.group_sizes, got.placement
    rows = SPEC.recv_rows(n)
    assert gx.shape == (rows, h) and gx.dtype == jnp.float8_e4m3fn and scale.shape == (rows, SPEC.num_scales)
    assert sizes.shape == (SPEC.local_experts(n),) and placement.recv_counts.shape == (n, SPEC.local_experts(n) + 1)
    route = Route(w, jnp.int32(t), ids, placement)
    y = jnp.zeros((rows, h), jnp.bfloat16)
    back = b.combine_send(ctx, y, route, 0)
    out = b.combine_recv(ctx, back, route, 0, None)
    assert out.shape == (t, h) and out.dtype == SPEC.combine_dtype
    halves = [c[0] for c in b.calls]
    if n == 1:  # one call per op; combine_send passes y on to the combine call
        assert halves == ["local_dispatch", "local_combine"]
        # x, x_scale, ids, weights, num_tokens, after, rank mask (empty: none)
        assert b.calls[0][1] == [(t, h), (0,), (t, k), (t, k), (), (0,), (0,)]
        assert b.calls[1][1] == [(rows, h), (1, SPEC.local_experts(1) + 1), (t, k), (t, k), (t, k), (), (0,), (0,)]
        assert back.y is not None and back.handle is None
        assert b.calls[0][2] == b.calls[1][2] == ["call_id", "slot"]  # SendAttrs (comm_id: added by _call)
    else:
        assert halves == ["dispatch_send", "dispatch_recv", "combine_send", "combine_recv"]


@pytest.mark.parametrize("cls, carried", [(CudaBackend, None), (NvshmemBackend, (2,))])
def test_dest_counts_travel_only_when_not_empty(cls, carried):
    """dispatch_send's dest_counts rides in the placement on nvshmem ([N]); cuda's handlers return
    an empty one, which is not carried (a jitted half taking a zero-size array from a handle
    crashed XLA's Shardy pass on jax 0.11.2, GPU) and combine_recv passes a fresh [0] operand in
    its place, so both handlers see the operands they declare."""
    b, ctx = _recorder(cls), _ctx(2)
    t, k, h = SPEC.max_tokens_per_rank, SPEC.experts_per_token, SPEC.hidden
    ids, w = jnp.zeros((t, k), jnp.int32), jnp.ones((t, k), jnp.float32)
    sent = b.dispatch_send(ctx, jnp.zeros((t, h), jnp.float32), None, ids, w, jnp.int32(t), 0)
    dc = sent.placement.dest_counts
    assert (dc is None) if carried is None else (dc.shape == carried)
    assert all(np.size(leaf) > 0 or np.ndim(leaf) == 0 for leaf in jax.tree.leaves(sent)), \
        [np.shape(leaf) for leaf in jax.tree.leaves(sent)]
    got = b.dispatch_recv(ctx, sent.wire, sent.placement, 0)
    route = Route(w, jnp.int32(t), ids, got.placement)
    b.combine_recv(ctx, b.combine_send(ctx, jnp.zeros((SPEC.recv_rows(2), h), jnp.bfloat16), route, 0), route, 0, None)
    half, shapes, _ = b.calls[-1]
    assert half == "combine_recv" and shapes[0] == (2,)  # the handle, then dest_counts
    assert shapes[1] == ((0,) if carried is None else carried)
