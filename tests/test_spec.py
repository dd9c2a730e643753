"""Spec validation and layout math (no devices needed)."""

import jax.numpy as jnp
import numpy as np
import pytest

from jax_moe_a2a import Spec

BASE = dict(num_experts=256, experts_per_token=8, hidden=7168, max_tokens_per_rank=128)


def test_defaults_and_derived():
    s = Spec(**BASE, dispatch_dtype=jnp.float8_e4m3fn)
    assert s.is_fp8 and s.num_scales == 56
    assert s.local_experts(8) == 32
    assert s.rows_per_peer(8) == 128 * 8
    assert s.worst_case_rows(8) == 128 * 8 * 8          # T * N * min(K, L)
    assert s.recv_shape(8) == (128 * 8 * 8,)
    assert s.token_bytes() == 7168 + 56 * 4
    em = s.replace(layout="expert_major")
    assert em.recv_shape(8) == (32, 128 * 8)             # [L, C], C = N * T
    assert Spec(**BASE, tp_size=2).worst_case_rows(8) == 8 * 64 * 8


@pytest.mark.parametrize("h, block, s", [(7168, 128, 56), (2880, 128, 23), (144, 128, 2), (48, 32, 2),
                                         (30, 16, 2), (100, 128, 1), (96, 32, 3)])
def test_num_scales_partial_last_block(h, block, s):
    """S = ceil(H / scale_block): a block that does not divide H leaves a partial last block."""
    spec = Spec(**{**BASE, "hidden": h}, dispatch_dtype=jnp.float8_e4m3fn, scale_block=block)
    assert spec.num_scales == s
    assert spec.token_bytes() == h + 4 * s
    assert Spec(**{**BASE, "hidden": h}, scale_block=block).num_scales == 0  # bf16: no scales


def test_min_k_l():
    s = Spec(num_experts=16, experts_per_token=8, hidden=64, max_tokens_per_rank=10)
    assert s.rows_per_peer(8) == 10 * 2                  # L = 2 < K


def test_capacity_clamped():
    s = Spec(**BASE, recv_capacity=10**9)
    assert s.recv_rows(8) == s.worst_case_rows(8)
    assert Spec(**BASE, recv_capacity=100).recv_rows(8) == 100


def test_hashable_and_frozen():
    s = Spec(**BASE)
    assert hash(s) == hash(Spec(**BASE))
    with pytest.raises(Exception):
        s.hidden = 3


@pytest.mark.parametrize("bad, needle", [
    (dict(num_experts=0), "num_experts"),
    (dict(experts_per_token=-1), "experts_per_token"),
    (dict(hidden=1.5), "hidden"),
    (dict(max_tokens_per_rank=True), "max_tokens_per_rank"),
    (dict(experts_per_token=300), "experts_per_token"),
    (dict(dispatch_dtype=jnp.int8), "dispatch_dtype"),
    (dict(combine_dtype=jnp.float8_e4m3fn), "combine_dtype"),
    (dict(layout="dense"), "layout"),
    (dict(dispatch_dtype=jnp.float8_e4m3fn, scale_block=0), "scale_block"),
    (dict(dispatch_dtype=jnp.float8_e4m3fn, scale_block=16.0), "scale_block"),
    (dict(recv_capacity=0), "recv_capacity"),
    (dict(tp_size=0), "tp_size"),
    (dict(slots=0), "slots"),
    (dict(recv_dtype=jnp.bfloat16), "recv_dtype.*fp8"),  # 16/32-bit rows arrive as they travel
    (dict(dispatch_dtype=jnp.float8_e4m3fn, recv_dtype=jnp.float8_e4m3fn), "recv_dtype"),
    (dict(dispatch_dtype=jnp.float8_e4m3fn, recv_dtype="not-a-dtype"), "recv_dtype"),
], ids=lambda v: v if isinstance(v, str) else "-".join(v))
def test_invalid_spec(bad, needle):
    with pytest.raises(ValueError, match=needle):
        Spec(**{**BASE, **bad})


@pytest.mark.parametrize("n, needle", [(3, "num_experts"), (0, "at least one")])
def test_rank_divisibility(n, needle):
    with pytest.raises(ValueError, match=needle):
        Spec(**BASE).check_ranks(n)


def test_tp_divisibility():
    with pytest.raises(ValueError, match="tp_size"):
        Spec(**BASE, tp_size=3).check_ranks(8)


def test_dtypes_normalised():
    s = Spec(**BASE, dispatch_dtype="bfloat16", combine_dtype=np.float32)
    assert s.dispatch_dtype == np.dtype(jnp.bfloat16) and s.combine_dtype == np.dtype(np.float32)


def test_recv_dtype():
    """fp8 dispatch dequantised on receive: Dispatched.x's dtype, no scales, the wire unchanged."""
    fp8 = Spec(**BASE, dispatch_dtype=jnp.float8_e4m3fn)
    deq = Spec(**BASE, dispatch_dtype=jnp.float8_e4m3fn, recv_dtype="bfloat16")
    assert fp8.recv_is_fp8 and fp8.recv_dtype is None
    assert not deq.recv_is_fp8 and deq.recv_dtype == np.dtype(jnp.bfloat16)
    assert deq.token_bytes() == fp8.token_bytes() and deq.num_scales == fp8.num_scales
    assert deq != fp8 and hash(deq) != hash(fp8)
    bf16 = Spec(**BASE)
    assert not bf16.recv_is_fp8 and bf16.recv_dtype is None
