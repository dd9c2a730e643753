"""fp8 block quantiser: FFI op (CPU handler) and pure-JAX twin against the NumPy oracle, bit for bit."""

import os

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


# --- Non-finite values, values past the fp8 range, all-zero blocks (the rule of docs/api.md,
# "fp8 quantisation"): a NaN or +-Inf is left out of its block's amax and quantises to 0x7F at its
# own position; everything else in the block is as if it were 0.

def _f32(bits):
    return np.array(bits, np.uint32).view(np.float32)


def special_inputs(rows, h, block, seed):
    """x [rows, h] f32 (rows >= 12): random rows carrying the special values, one kind per row."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, h)) * rng.uniform(1e-2, 1e2, (rows, 1))).astype(np.float32)
    last = h - 1                                   # in the last block, partial when block does not divide h
    x[0, 5] = np.nan                               # one NaN in a random block
    x[1, 3], x[1, last] = np.inf, -np.inf          # +-Inf, one in the (partial) last block
    x[2, :] = 0.0
    x[2, 1::3] = -0.0                              # an all-zero row, signed zeros included
    x[3, :block] = 0.0                             # an all-zero first block, the rest random
    x[4, 0], x[4, 1], x[4, min(block, last)] = 1e30, -3e4, np.nan  # far past +-448 before scaling, and a NaN
    x[5, :block] = np.nan                          # a block of NaNs only
    x[5, block // 2: block] = np.inf
    x[6, 7] = _f32(0xFFC00000)                     # a NaN with its sign bit set
    x[6, 8] = _f32(0x7F800001)                     # a signalling NaN payload
    x[7, :] = np.float32(np.finfo(np.float32).max) * rng.choice([-1, 1], h)  # amax = f32 max
    x[8, :] = _f32(rng.integers(1, 0x007FFFFF, h)) # f32 subnormals only
    x[9, 0::2] = np.nan                            # NaN in every other value of the row
    x[10, :] = 448.0 * rng.choice([-1, 1], h)      # exactly the fp8 maximum, unscaled
    x[11, 2] = -np.inf                             # -Inf beside finite values past the range
    x[11, 3] = 1e6
    return x


SPECIAL_SHAPES = [(256, 128), (144, 128), (48, 32), (30, 16)]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16], ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("pow2", [False, True], ids=["scale", "pow2"])
@pytest.mark.parametrize("h, block", SPECIAL_SHAPES, ids=[f"h{h}-b{b}" for h, b in SPECIAL_SHAPES])
def test_non_finite_native_jax_oracle_bit_identical(dtype, pow2, h, block):
    """The native op, the pure-JAX twin and the oracle agree bit for bit on NaN, +-Inf, values past
    the fp8 range, f32 max, subnormals and all-zero blocks: scales, codes and NaN positions."""
    x = jnp.asarray(special_inputs(13, h, block, h + block + pow2)).astype(dtype)  # f16: 1e30 -> inf
    x32 = np.asarray(x.astype(jnp.float32))
    wq, ws = oracle.quantize_fp8(x32, block, pow2)
    for fn in (quant.quantize_fp8, quant.quantize_fp8_jax):
        q, s = jax.jit(lambda a: fn(a, block, pow2))(x)
        np.testing.assert_array_equal(np.asarray(s), ws, err_msg=fn.__name__)
        np.testing.assert_array_equal(np.asarray(q).view(np.uint8), wq.view(np.uint8), err_msg=fn.__name__)
    # the rule itself, not only agreement: NaN codes exactly where x is not finite (always 0x7F),
    # finite scales everywhere, and each scale that of the block with its non-finite values zeroed
    codes = wq.view(np.uint8)
    assert np.all((codes == 0x7F) == ~np.isfinite(x32)) and not np.any(codes == 0xFF)
    assert np.all(np.isfinite(ws)) and np.all(ws > 0)
    zq, zs = oracle.quantize_fp8(np.where(np.isfinite(x32), x32, 0.0), block, pow2)
    np.testing.assert_array_equal(ws, zs)
    fin = np.isfinite(x32)
    np.testing.assert_array_equal(codes[fin], zq.view(np.uint8)[fin])


def test_non_finite_rule_by_hand():
    """One row worked by hand: [NaN, 2, -Inf, 1] in one block of 4 -> amax 2, scale 2 * f32(1/448),
    codes [0x7F, 448, 0x7F, 224]; a block of zeros -> scale 1e-12 * f32(1/448), codes 0 (-0 -> 0x80)."""
    x = np.array([[np.nan, 2.0, -np.inf, 1.0, 0.0, -0.0, 0.0, 0.0]], np.float32)
    want_codes = np.array([[0x7F, 0x7E, 0x7F, 0x76, 0x00, 0x80, 0x00, 0x00]], np.uint8)
    want_scale = np.array([[np.float32(2.0) * quant.INV_FP8_MAX, np.float32(1e-12) * quant.INV_FP8_MAX]], np.float32)
    for fn in (quant.quantize_fp8, quant.quantize_fp8_jax):
        q, s = fn(jnp.asarray(x), 4)
        np.testing.assert_array_equal(np.asarray(q).view(np.uint8), want_codes, err_msg=fn.__name__)
        np.testing.assert_array_equal(np.asarray(s), want_scale, err_msg=fn.__name__)
    back = np.asarray(quant.dequantize_fp8(*quant.quantize_fp8(jnp.asarray(x), 4), 4))
    assert np.isnan(back[0, [0, 2]]).all() and back[0, 1] == 2.0 and back[0, 3] == 1.0


@pytest.mark.parametrize("pow2", [False, True], ids=["scale", "pow2"])
def test_saturation_at_the_block_maximum(pow2):
    """x * (1 / scale) of a block's largest value lands on either side of 448 by rounding: it must
    saturate to 448 (0x7E), never become a NaN code (e4m3fn has no Inf; 480 would be 0x7F)."""
    rng = np.random.default_rng(3)
    lo = int(np.float32(1e-12).view(np.uint32))                # below 1e-12 the scale is the floor's
    amax = _f32(rng.integers(lo, 0x7F7FFFFF, 4096))            # f32 magnitudes from 1e-12 to f32 max
    x = np.stack([amax, -amax / 2, amax / 3, -amax], 1).astype(np.float32)  # blocks of 4
    wq, _ = oracle.quantize_fp8(x, 4, pow2)
    for fn in (quant.quantize_fp8, quant.quantize_fp8_jax):
        q, _ = fn(jnp.asarray(x), 4, pow2)
        np.testing.assert_array_equal(np.asarray(q).view(np.uint8), wq.view(np.uint8), err_msg=fn.__name__)
    c = wq.view(np.uint8)
    assert not np.any((c & 0x7F) == 0x7F), "a finite value became the fp8 NaN"
    if not pow2:
        assert np.all(c[:, 0] == 0x7E) and np.all(c[:, 3] == 0xFE), "the block maximum must quantise to +-448"


# --- On a GPU: the CUDA quantize kernel and the cuda / nvshmem send kernels against the pure-JAX
# twin run on the CPU (XLA:GPU's reciprocal may differ in the last bit: exact_fp8_expected), on
# the special values. Skipped without a GPU; scripts/gpu_check.sh runs this file in its `single`
# stage (cuda) and its `nvshmem` stage.

def _gpu_or_skip():
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    from jax_moe_a2a import _ffi
    if not _ffi.built_with_cuda():
        pytest.skip("built without CUDA")


def _twin_on_cpu(x, block, pow2):
    """quantize_fp8_jax on the CPU: (q [rows, H] uint8 codes, scale [rows, S] f32) as NumPy."""
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        q, s = jax.jit(lambda a: quant.quantize_fp8_jax(a, block, pow2))(jax.device_put(np.asarray(x), cpu))
    return np.asarray(q).view(np.uint8), np.asarray(s)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16], ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("pow2", [False, True], ids=["scale", "pow2"])
@pytest.mark.parametrize("h, block", SPECIAL_SHAPES, ids=[f"h{h}-b{b}" for h, b in SPECIAL_SHAPES])
def test_gpu_quantize_kernel_non_finite(dtype, pow2, h, block):
    _gpu_or_skip()
    with np.errstate(over="ignore", invalid="ignore"):  # f16: 1e30 -> inf; NaN casts
        x = special_inputs(13, h, block, 2 * h + block + pow2).astype(jnp.dtype(dtype))
    q, s = jax.jit(lambda a: quant.quantize_fp8(a, block, pow2))(jnp.asarray(x))  # the CUDA kernel
    wq, ws = _twin_on_cpu(x, block, pow2)
    np.testing.assert_array_equal(np.asarray(s), ws)
    np.testing.assert_array_equal(np.asarray(q).view(np.uint8), wq)


GPU_BACKENDS = [b for b in os.environ.get("JAX_MOE_A2A_TEST_BACKENDS", "cuda,nvshmem").split(",")
                if b in ("cuda", "nvshmem")]
# (hidden, scale_block, x dtype): the staging's vector path (H % 8 == 0, scale_block % 8 == 0), its
# warp-per-block path (H = 30), partial last blocks, and DeepSeek's H = 7168
SEND_SHAPES = [(256, 128, jnp.float32), (144, 32, jnp.bfloat16), (30, 16, jnp.float16), (7168, 128, jnp.bfloat16)]


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("local_path", ["auto", "0"], ids=["ep1-local", "exchange"])
@pytest.mark.parametrize("pow2", [False, True], ids=["scale", "pow2"])
@pytest.mark.parametrize("h, block, dtype", SEND_SHAPES, ids=[f"h{h}-b{b}" for h, b, _ in SEND_SHAPES])
def test_gpu_send_kernels_non_finite(backend, local_path, pow2, h, block, dtype, monkeypatch):
    """dispatch of x with NaN, +-Inf, values past +-448 and all-zero blocks through the GPU send
    kernels (EP = 1: the local path's register quantiser, and with JAX_MOE_A2A_LOCAL_PATH=0 the
    exchange's send kernel): every received row and its scales are quantize_fp8_jax's, bit for bit."""
    _gpu_or_skip()
    import jax_moe_a2a as a2a
    from jax_moe_a2a import testing as T
    if backend not in a2a.available_backends():
        pytest.skip(f"{backend} not available")
    monkeypatch.setenv("JAX_MOE_A2A_LOCAL_PATH", local_path)
    spec = a2a.Spec(num_experts=8, experts_per_token=2, hidden=h, max_tokens_per_rank=16, scale_block=block,
                    pow2_scale=pow2, dispatch_dtype=jnp.float8_e4m3fn)
    comm = a2a.init(spec, T.make_mesh(1), "ep", backend=backend)
    inputs = T.make_inputs(spec, 1, h + block + pow2, input_dtype=jnp.dtype(dtype), specials=True, num_tokens=16)
    got = T.run_ops(comm, inputs)[0]
    wq, ws = _twin_on_cpu(inputs[0].x, block, pow2)
    src = np.asarray(got["src"]).reshape(-1, 2)
    rows = np.asarray(got["x"]).reshape(-1, h).view(np.uint8)
    scales = np.asarray(got["scale"]).reshape(rows.shape[0], -1)
    valid = src[:, 0] >= 0
    assert valid.sum() == 16 * 2, "every pair is received (no drops, no overflow)"
    tok = src[valid, 1]
    np.testing.assert_array_equal(scales[valid], ws[tok])
    np.testing.assert_array_equal(rows[valid], wq[tok])
