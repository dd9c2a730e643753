"""jax_moe_a2a.gemm_ffi's static checks (CPU): native_reason and native_supported."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from jax_moe_a2a import gemm_ffi

S = jax.ShapeDtypeStruct
FP8, BF16, F32 = jnp.float8_e4m3fn, jnp.bfloat16, jnp.float32


def test_native_reason_is_a_line_off_gpu():
    why = gemm_ffi.native_reason()
    if jax.default_backend() != "gpu":
        assert isinstance(why, str) and why and "\n" not in why


def test_native_reason_names_a_missing_build(monkeypatch):
    monkeypatch.setattr(gemm_ffi._ffi, "_C", None)
    assert "not built" in gemm_ffi.native_reason()


@pytest.mark.parametrize("x, w", [
    (S((300, 512), BF16), S((8, 384, 512), BF16)),
    (S((8, 16, 512), BF16), S((8, 384, 512), BF16)),
])
def test_bf16_supported(x, w):
    assert gemm_ffi.native_supported(x, w) is None


def test_fp8_supported_ragged_and_expert_major():
    w, ws = S((8, 256, 512), FP8), S((8, 2, 4), F32)
    assert gemm_ffi.native_supported(S((100, 512), FP8), w, S((100, 4), F32), ws) is None
    assert gemm_ffi.native_supported(S((8, 7, 512), FP8), w, S((8, 7, 4), F32), ws) is None


@pytest.mark.parametrize("args, kw, words", [
    ((S((10, 512), BF16), S((8, 384, 512), FP8)), {}, "one dtype"),
    ((S((10, 512), F32), S((8, 384, 512), F32)), {}, "bfloat16 or float8"),
    ((S((10, 500), BF16), S((8, 384, 500), BF16)), {}, "K % 8"),
    ((S((10, 512), BF16), S((8, 384, 256), BF16)), {}, "last dimension"),
    ((S((4, 3, 512), BF16), S((8, 384, 512), BF16)), {}, "expert_major"),
    ((S((10, 512), BF16), S((384, 512), BF16)), {}, "[L, N, K]"),
    ((S((10, 512), BF16), S((8, 384, 512), BF16), S((10, 4), F32), None), {}, "no scales"),
    ((S((10, 512), FP8), S((8, 256, 512), FP8)), {}, "needs x_scale"),
    ((S((10, 448), FP8), S((8, 256, 448), FP8), S((10, 4), F32), S((8, 2, 4), F32)), {}, "K % 128"),
    ((S((10, 512), FP8), S((8, 192, 512), FP8), S((10, 4), F32), S((8, 2, 4), F32)), {}, "N % 128"),
    ((S((10, 512), FP8), S((8, 256, 512), FP8), S((10, 8), F32), S((8, 2, 4), F32)), {}, "x_scale"),
    ((S((10, 512), FP8), S((8, 256, 512), FP8), S((10, 4), F32), S((8, 4, 8), F32)), {}, "w_scale"),
    ((S((10, 512), FP8), S((8, 512, 256), FP8), S((10, 4), F32), S((8, 2, 4), F32)), {"transpose_w": True},
     "transpose_w"),
])
def test_unsupported_says_why(args, kw, words):
    why = gemm_ffi.native_supported(*args, **kw)
    assert why is not None and words in why, why


def test_transpose_w_reads_k_from_axis_1():
    assert gemm_ffi.native_supported(S((10, 512), BF16), S((8, 512, 384), BF16), transpose_w=True) is None


def test_calls_refuse_without_native():
    if gemm_ffi.native_reason() is None:
        pytest.skip("native kernels available here")
    x, w = jnp.zeros((4, 128), BF16), jnp.zeros((2, 128, 128), BF16)
    with pytest.raises(ValueError, match="cannot run"):
        gemm_ffi.grouped_gemm(x, w, jnp.zeros((2,), jnp.int32))
    with pytest.raises(ValueError, match="cannot run"):
        gemm_ffi.grouped_gemm_wgrad(x, x, jnp.zeros((2,), jnp.int32))


def test_wgrad_supported():
    gs = S((8,), jnp.int32)
    assert gemm_ffi.wgrad_supported(S((300, 512), BF16), S((300, 384), BF16), gs) is None
    assert gemm_ffi.wgrad_supported(S((8, 7, 512), BF16), S((8, 7, 384), BF16), gs) is None
    for x, dy, words in [
        (S((300, 512), BF16), S((301, 384), BF16), "same"),
        (S((300, 512), F32), S((300, 384), BF16), "bf16"),
        (S((300, 500), BF16), S((300, 384), BF16), "K % 8"),
        (S((4, 7, 512), BF16), S((4, 7, 384), BF16), "expert_major"),
    ]:
        why = gemm_ffi.wgrad_supported(x, dy, gs)
        assert why is not None and words in why, why


def _built_gemm():
    g = gemm_ffi._gemm_module()
    if g is None or not g.built():
        pytest.skip(f"grouped-GEMM kernels not built: {gemm_ffi._build_reason()}")
    return g


def test_workspace_bytes_takes_the_mode():
    """_C.gemm.workspace_bytes sizes the kernel of the custom call's mode (host-side: no GPU needed)."""
    g = _built_gemm()
    fwd = g.workspace_bytes(False, False, gemm_ffi._MODE_FORWARD, 8, 300, 384, 512, False)
    wgrad = g.workspace_bytes(False, True, gemm_ffi._MODE_WGRAD, 8, 300, 384, 512, False)
    assert fwd > 0 and wgrad > 0
    with pytest.raises(ValueError, match="wgrad is built for bf16 in, f32 out"):
        g.workspace_bytes(True, True, gemm_ffi._MODE_WGRAD, 8, 300, 384, 512, False)
    with pytest.raises(ValueError, match="transpose_w is built for bf16 out only"):
        g.workspace_bytes(False, True, gemm_ffi._MODE_TRANSPOSE_W, 8, 300, 384, 512, False)
    with pytest.raises(ValueError, match="mode must be"):
        g.workspace_bytes(False, False, 3, 8, 300, 384, 512, False)


class _Recorder:
    """Stands in for _C.gemm: records workspace_bytes' arguments, answers the real size."""

    def __init__(self, g):
        self.g, self.calls = g, []

    def workspace_bytes(self, *args):
        self.calls.append(args)
        return self.g.workspace_bytes(*args)


@pytest.mark.parametrize("expert_major", [False, True])
def test_wgrad_asks_the_exact_workspace_of_its_mode(monkeypatch, expert_major):
    """grouped_gemm_wgrad allocates exactly what the wgrad kernel needs: it asks in the wgrad mode
    (traced with eval_shape: nothing runs)."""
    rec = _Recorder(_built_gemm())
    monkeypatch.setattr(gemm_ffi, "_gemm_module", lambda: rec)
    monkeypatch.setattr(gemm_ffi, "native_reason", lambda: None)
    monkeypatch.setattr(gemm_ffi._ffi, "register_targets", lambda: None)
    L, rows, n, k = 5, 40, 136, 264
    lead = (L, rows) if expert_major else (rows,)
    jaxpr = jax.make_jaxpr(gemm_ffi.grouped_gemm_wgrad)(S(lead + (k,), BF16), S(lead + (n,), BF16),
                                                         S((L,), jnp.int32))
    assert rec.calls == [(False, True, gemm_ffi._MODE_WGRAD, L, rows, n, k, expert_major)]
    want = rec.g.workspace_bytes(*rec.calls[0])
    assert f"u8[{want}]" in str(jaxpr), "the wgrad's workspace output must be exactly the size asked"
