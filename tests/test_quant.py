"""fp8 block quantiser: FFI op (CPU handler) and pure-JAX twin against the NumPy oracle, bit for bit."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jax_moe_a2a import oracle, quant


def _inputs(seed, rows, h, dtype):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, h)) * rng.uniform(1e-3, 1e3, (rows, 1))
    x[0, :] = 0.0                      # an all-zero block
    x[1, 0] = 448.0 * 3                # a large outlier
    x[2, :] = 1e-30                    # tiny values (denormal scale floor)
    return jnp.asarray(x.astype(np.float32)).astype(dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16], ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("pow2", [False, True], ids=["scale", "pow2"])
@pytest.mark.parametrize("impl", ["ffi", "jax"])
@pytest.mark.parametrize("block", [128, 64, 32])
def test_matches_oracle(dtype, pow2, impl, block):
    x = _inputs(block + pow2, 33, 512, dtype)      # odd row count
    fn = quant.quantize_fp8 if impl == "ffi" else quant.quantize_fp8_jax
    q, s = jax.jit(lambda a: fn(a, block, pow2))(x)
    wq, ws = oracle.quantize_fp8(np.asarray(x.astype(jnp.float32)), block, pow2)
    assert q.dtype == jnp.float8_e4m3fn and s.dtype == jnp.float32
    assert q.shape == (33, 512) and s.shape == (33, 512 // block)
    np.testing.assert_array_equal(np.asarray(s), ws)
    np.testing.assert_array_equal(np.asarray(q).view(np.uint8), wq.view(np.uint8))
    if pow2:
        m, _ = np.frexp(np.asarray(s))
        assert np.all(m == 0.5), "pow2 scales must be powers of two"


def test_roundtrip_error_bound():
    x = _inputs(7, 16, 256, jnp.float32)
    q, s = quant.quantize_fp8(x, 128)
    back = np.asarray(quant.dequantize_fp8(q, s, 128))
    xs = np.asarray(x)
    amax = np.abs(xs.reshape(16, 2, 128)).max(-1, keepdims=True).repeat(128, -1).reshape(16, 256)
    # e4m3 has 3 mantissa bits: relative error <= 2^-4 of the value, plus subnormal spacing.
    assert np.all(np.abs(back - xs) <= np.abs(xs) / 16 + amax / 448 * 2.0**-9 + 1e-30)


def test_e4m3_codes_exhaustive():
    """Every e4m3fn value and every midpoint between neighbours rounds like ml_dtypes."""
    codes = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    finite = np.sort(np.unique(codes[np.isfinite(codes)]))
    mids = (finite[:-1] + finite[1:]) / 2
    vals = np.concatenate([finite, mids, -mids]).astype(np.float32)
    vals = vals[np.abs(vals) <= 448]
    vals = np.pad(vals, (0, -len(vals) % 32))
    x = jnp.asarray(vals.reshape(-1, 32))
    # a 448 in every block makes the scale 448 * f32(1/448), so values are quantised near as-is
    got, s = quant.quantize_fp8(jnp.concatenate([x, jnp.full((x.shape[0], 32), 448.0)], 1), 64)
    assert np.all(np.asarray(s) == np.float32(448.0) * (np.float32(1) / np.float32(448)))
    want, _ = oracle.quantize_fp8(np.concatenate([np.asarray(x), np.full((x.shape[0], 32), 448.0, np.float32)], 1), 64)
    np.testing.assert_array_equal(np.asarray(got).view(np.uint8), want.view(np.uint8))


# Partial last blocks (block does not divide H): gpt-oss's H = 2880 with 128 (22 full + 64), and
# small shapes of the same kind, one with H % 8 != 0.
PARTIAL = [(2880, 128), (144, 128), (48, 32), (30, 16), (100, 128)]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("pow2", [False, True], ids=["scale", "pow2"])
@pytest.mark.parametrize("impl", ["ffi", "jax"])
@pytest.mark.parametrize("h, block", PARTIAL, ids=[f"h{h}-b{b}" for h, b in PARTIAL])
def test_partial_block_matches_oracle(dtype, pow2, impl, h, block):
    x = _inputs(h + block + pow2, 9, h, dtype)
    fn = quant.quantize_fp8 if impl == "ffi" else quant.quantize_fp8_jax
    q, s = jax.jit(lambda a: fn(a, block, pow2))(x)
    wq, ws = oracle.quantize_fp8(np.asarray(x.astype(jnp.float32)), block, pow2)
    nb = -(-h // block)
    assert q.shape == (9, h) and s.shape == (9, nb) and ws.shape == (9, nb)
    np.testing.assert_array_equal(np.asarray(s), ws)
    np.testing.assert_array_equal(np.asarray(q).view(np.uint8), wq.view(np.uint8))


@pytest.mark.parametrize("h, block", PARTIAL, ids=[f"h{h}-b{b}" for h, b in PARTIAL])
def test_partial_block_scale_from_its_own_values(h, block):
    """The last block's scale comes from its H % block values only: huge values in the full
    blocks do not reach it, and a tiny last block keeps a tiny scale (fine resolution)."""
    rng = np.random.default_rng(h)
    x = rng.standard_normal((4, h)).astype(np.float32) * 1e3
    tail = h - (h // block) * block
    x[:, h - tail:] = rng.standard_normal((4, tail)) * 1e-2
    x[1, h - tail:] = 0.0                                     # an all-zero partial block
    q, s = oracle.quantize_fp8(x, block)
    amax_tail = np.abs(x[:, h - tail:]).max(-1)
    np.testing.assert_array_equal(s[:, -1], np.maximum(amax_tail, np.float32(1e-12)) * quant.INV_FP8_MAX)
    for b in range(h // block):
        np.testing.assert_array_equal(s[:, b], np.abs(x[:, b * block:(b + 1) * block]).max(-1) * quant.INV_FP8_MAX)
    # the largest value of the partial block quantises to +-448 exactly as in a full block
    big = np.abs(q[:, h - tail:].astype(np.float32)).max(-1)
    assert np.all(big[[0, 2, 3]] == 448.0) and big[1] == 0.0
    fq, fs = quant.quantize_fp8(jnp.asarray(x), block)
    np.testing.assert_array_equal(np.asarray(fs), s)
    np.testing.assert_array_equal(np.asarray(fq).view(np.uint8), q.view(np.uint8))


@pytest.mark.parametrize("h, block", PARTIAL, ids=[f"h{h}-b{b}" for h, b in PARTIAL])
def test_partial_block_roundtrip_error_bound(h, block):
    x = np.asarray(_inputs(h * 3 + block, 16, h, jnp.float32))
    q, s = quant.quantize_fp8(jnp.asarray(x), block)
    back = np.asarray(quant.dequantize_fp8(q, s, block))
    np.testing.assert_array_equal(back, oracle.dequantize_fp8(np.asarray(q), np.asarray(s), block))
    amax = np.repeat(np.asarray(s) * 448.0, block, axis=-1)[:, :h]  # each value's own block amax
    assert np.all(np.abs(back - x) <= np.abs(x) / 16 + amax / 448 * 2.0**-9 + 1e-30)
    # batched dequantisation ([..., H], as got.x of expert_major) agrees with the 2-D one
    b3 = np.asarray(quant.dequantize_fp8(q.reshape(4, 4, h), s.reshape(4, 4, -1), block))
    np.testing.assert_array_equal(b3.reshape(16, h), back)


@pytest.mark.parametrize("shape, block, needle", [((4, 100), 0, "positive"), ((4, 100), True, "positive"),
                                                  ((4,), 128, "2-D")])
def test_bad_inputs(shape, block, needle):
    with pytest.raises(ValueError, match=needle):
        quant.quantize_fp8(jnp.zeros(shape, jnp.float32), block)


def test_bad_dtype():
    with pytest.raises(ValueError, match="f32, bf16 or f16"):
        quant.quantize_fp8(jnp.zeros((4, 128), jnp.int32))


def test_targets_registered():
    from jax_moe_a2a import _ffi
    regs = _ffi.register_targets()
    assert "jax_moe_a2a_quantize_fp8" in regs["cpu"]
    if _ffi.built_with_cuda():
        assert "jax_moe_a2a_quantize_fp8" in regs["CUDA"]
