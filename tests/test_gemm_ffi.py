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

    def workspace_bytes(self, *args, **kw):
        self.calls.append((args, kw))
        return self.g.workspace_bytes(*args, **kw)


def _traced_natively(monkeypatch):
    """gemm_ffi traces its custom calls here as on a GPU (nothing runs): a recorder for _C.gemm."""
    rec = _Recorder(_built_gemm())
    monkeypatch.setattr(gemm_ffi, "_gemm_module", lambda: rec)
    monkeypatch.setattr(gemm_ffi, "native_reason", lambda: None)
    monkeypatch.setattr(gemm_ffi._ffi, "register_targets", lambda: None)
    return rec


@pytest.mark.parametrize("expert_major", [False, True])
def test_wgrad_asks_the_exact_workspace_of_its_mode(monkeypatch, expert_major):
    """grouped_gemm_wgrad allocates exactly what the wgrad kernel needs: it asks in the wgrad mode
    (traced with eval_shape: nothing runs)."""
    monkeypatch.delenv("JAX_MOE_A2A_GEMM_TILE_M", raising=False)
    rec = _traced_natively(monkeypatch)
    L, rows, n, k = 5, 40, 136, 264
    lead = (L, rows) if expert_major else (rows,)
    jaxpr = jax.make_jaxpr(gemm_ffi.grouped_gemm_wgrad)(S(lead + (k,), BF16), S(lead + (n,), BF16),
                                                         S((L,), jnp.int32))
    assert rec.calls == [((False, True, gemm_ffi._MODE_WGRAD, L, rows, n, k, expert_major),
                          dict(tile_m=0, raster=0, swizzle=1, kernel=0))]
    want = rec.g.workspace_bytes(*rec.calls[0][0], **rec.calls[0][1])
    assert f"u8[{want}]" in str(jaxpr), "the wgrad's workspace output must be exactly the size asked"


# --- JAX_MOE_A2A_GEMM_TILE_M: parsed once, when a call is traced, into the custom call's attributes ---------
@pytest.mark.parametrize("text, want", [
    (None, gemm_ffi.Tuning()),
    ("", gemm_ffi.Tuning()),
    ("auto", gemm_ffi.Tuning()),
    ("64", gemm_ffi.Tuning(tile_m=64)),
    ("128,rasterH,s2", gemm_ffi.Tuning(tile_m=128, raster=2, swizzle=2)),
    ("64,rasterN,s4", gemm_ffi.Tuning(tile_m=64, raster=1, swizzle=4)),
    ("rasterM,s8,", gemm_ffi.Tuning(raster=0, swizzle=8)),
    ("s1, 128", gemm_ffi.Tuning(tile_m=128)),
    ("64,128", gemm_ffi.Tuning(tile_m=128)),   # a later word wins
    ("wgmma", gemm_ffi.Tuning(kernel=2)),
    ("64,cutlass", gemm_ffi.Tuning(tile_m=64, kernel=1)),
    ("wgmma,cutlass,s2", gemm_ffi.Tuning(kernel=1, swizzle=2)),
    ("wgmma,fused", gemm_ffi.Tuning(kernel=2, fuse_swiglu=True)),
    ("swap", gemm_ffi.Tuning(kernel=3)),
    ("swap,fused", gemm_ffi.Tuning(kernel=3, fuse_swiglu=True)),
    ("unfused", gemm_ffi.Tuning(fuse_swiglu=False)),
    ("fused,unfused", gemm_ffi.Tuning(fuse_swiglu=False)),
])
def test_parse_tuning(text, want):
    assert gemm_ffi.parse_tuning(text) == want


@pytest.mark.parametrize("text", ["32", "rastern", "s3", "64x", "auto,64", "tile64", "64;s2", "WGMMA", "cutlas"])
def test_parse_tuning_refuses_unknown_words(text):
    with pytest.raises(ValueError, match=r"JAX_MOE_A2A_GEMM_TILE_M=.*unknown word.*accepted words.*64, 128, "
                                         r"rasterM, rasterN, rasterH, s1, s2, s4, s8, cutlass, wgmma"):
        gemm_ffi.parse_tuning(text)


def _call_attrs(jaxpr):
    """The attributes of the one grouped-GEMM custom call of a jaxpr, as ints."""
    eqns = [e for e in jaxpr.jaxpr.eqns if e.params.get("target_name") == "jax_moe_a2a_grouped_gemm"]
    assert len(eqns) == 1, jaxpr
    return {k: int(v) for k, v in eqns[0].params["attributes"]}


def test_tuning_reaches_the_workspace_and_the_call(monkeypatch):
    """The setting at trace time sizes the workspace and becomes the custom call's attributes (the
    kernel launched is the one sized); a misspelt setting fails the trace."""
    rec = _traced_natively(monkeypatch)
    x, w, gs = S((100, 512), BF16), S((4, 256, 512), BF16), S((4,), jnp.int32)
    monkeypatch.setenv("JAX_MOE_A2A_GEMM_TILE_M", "64,rasterN,s4")
    want = dict(tile_m=64, raster=1, swizzle=4, kernel=0)
    attrs = _call_attrs(jax.make_jaxpr(lambda *a: gemm_ffi.grouped_gemm(*a))(x, w, gs))
    assert rec.calls[-1][1] == want and attrs == dict(mode=gemm_ffi._MODE_FORWARD, **want)
    attrs = _call_attrs(jax.make_jaxpr(lambda *a: gemm_ffi.grouped_gemm_wgrad(*a))(x, S((100, 256), BF16), gs))
    assert rec.calls[-1][1] == want and attrs == dict(mode=gemm_ffi._MODE_WGRAD, **want)
    monkeypatch.delenv("JAX_MOE_A2A_GEMM_TILE_M")
    attrs = _call_attrs(jax.make_jaxpr(lambda *a: gemm_ffi.grouped_gemm(*a, transpose_w=True))(
        x, S((4, 512, 256), BF16), gs))
    assert rec.calls[-1][1] == dict(tile_m=0, raster=0, swizzle=1, kernel=0)
    assert attrs == dict(mode=gemm_ffi._MODE_TRANSPOSE_W, tile_m=0, raster=0, swizzle=1, kernel=0)
    monkeypatch.setenv("JAX_MOE_A2A_GEMM_TILE_M", "wgmma")
    attrs = _call_attrs(jax.make_jaxpr(lambda *a: gemm_ffi.grouped_gemm(*a))(x, w, gs))
    assert rec.calls[-1][1] == dict(tile_m=0, raster=0, swizzle=1, kernel=2)
    assert attrs == dict(mode=gemm_ffi._MODE_FORWARD, tile_m=0, raster=0, swizzle=1, kernel=2)
    monkeypatch.setenv("JAX_MOE_A2A_GEMM_TILE_M", "64,rasterX")
    with pytest.raises(ValueError, match="unknown word 'rasterX'"):   # a fresh function: jax caches traces
        jax.make_jaxpr(lambda *a: gemm_ffi.grouped_gemm(*a))(x, w, gs)


def test_workspace_bytes_refuses_a_tuning_out_of_its_set():
    g = _built_gemm()
    assert g.workspace_bytes(False, False, 0, 8, 300, 384, 512, False, tile_m=64, raster=2, swizzle=8) > 0
    for kw in (dict(tile_m=32), dict(raster=3), dict(swizzle=3), dict(swizzle=0), dict(kernel=4), dict(kernel=-1)):
        with pytest.raises(ValueError, match="tile_m must be 0 \\(auto\\), 64 or 128"):
            g.workspace_bytes(False, False, 0, 8, 300, 384, 512, False, **kw)


@pytest.mark.parametrize("L, f, block, tune, words", [
    (8, 256, 128, "wgmma,fused", None),
    (8, 256, 128, "fused,wgmma", None),
    (8, 256, 128, "wgmma", None),                  # mean 8 rows: token tile 32, fused by default
    (8, 256, 128, "wgmma,unfused", "turned off"),
    (8, 256, 128, "cutlass,fused", "only with our own fp8 kernel"),
    (8, 192, 128, "wgmma,fused", "F % 128 == 0"),
    (8, 256, 64, "wgmma,fused", "128-column blocks"),
    (1025, 256, 128, "wgmma,fused", "groups must be 1..1024"),
    (1024, 2**20, 128, "wgmma,fused", "L*N reach 2^31"),
])
def test_fused_swiglu_reason(monkeypatch, L, f, block, tune, words):
    """When grouped_gemm_swiglu runs as one kernel (checked from shapes only: the Python wrapper's
    own conditions, then the kernel's rule from _C.gemm.swiglu_reason; native_reason stubbed so a
    CPU reaches every branch), and why not otherwise."""
    _built_gemm()
    monkeypatch.setattr(gemm_ffi, "native_reason", lambda: None)
    k = 256
    x = jax.ShapeDtypeStruct((64, k), jnp.float8_e4m3fn)
    w = jax.ShapeDtypeStruct((L, 2 * f, k), jnp.float8_e4m3fn)
    xs = jax.ShapeDtypeStruct((64, k // 128), jnp.float32)
    ws = jax.ShapeDtypeStruct((L, 2 * f // 128, k // 128), jnp.float32)
    why = gemm_ffi.fused_swiglu_reason(x, w, xs, ws, block=block, tune=gemm_ffi.parse_tuning(tune))
    assert why is None if words is None else words in why, why


@pytest.mark.parametrize("rows, tune, words", [
    (64, "fused", None),                          # decode (mean 8 rows per expert): the swap-AB epilogue
    (64, "auto", None),                           # token tile 32: fused by default (measured faster)
    (8 * 51, "auto", None),                       # mean 51: 63.75 -> token tile 64, the largest fused by default
    (8 * 52, "auto", "by default"),               # mean 52: 65 -> 128, the pair (the fused epilogue lost at 160)
    (8 * 100, "auto", "by default"),              # mean 100: 125 -> 128
    (8 * 100, "fused", None),                     # asked for: fused at any token tile
    (8 * 100, "wgmma", "by default"),             # our kernel asked for, fusing not: the default rule
    (64, "unfused", "turned off"),                # never
    (64, "wgmma,unfused", "turned off"),
    (8 * 129, "fused", "auto at decode shapes"),  # mean 129: CUTLASS's GEMM, then the SwiGLU kernel
    (8 * 129, "auto", "auto at decode shapes"),
    (8 * 129, "wgmma,fused", None),               # the row-major kernel's epilogue
    (8 * 129, "wgmma", "by default"),             # the row-major kernel is fused only when asked
    (64, "64,fused", "our own fp8 kernel only"),  # a CUTLASS tile asked for
    (64, "64", "our own fp8 kernel only"),
])
def test_fused_swiglu_where_our_kernel_runs(monkeypatch, rows, tune, words):
    """Where the fp8 gate+up GEMM and the SwiGLU run as one kernel: by default at the swap-AB
    kernel's token tiles <= 64 (where it measured faster than the pair), with `fused` wherever our
    own kernel takes the call (kernel auto: decode shapes; wgmma: everywhere), with `unfused`
    never; the C++ rules decide (_C.gemm.swiglu_reason, swiglu_by_default)."""
    _built_gemm()
    monkeypatch.setattr(gemm_ffi, "native_reason", lambda: None)
    L, f, k = 8, 256, 256
    x = jax.ShapeDtypeStruct((rows, k), jnp.float8_e4m3fn)
    w = jax.ShapeDtypeStruct((L, 2 * f, k), jnp.float8_e4m3fn)
    xs = jax.ShapeDtypeStruct((rows, k // 128), jnp.float32)
    ws = jax.ShapeDtypeStruct((L, 2 * f // 128, k // 128), jnp.float32)
    why = gemm_ffi.fused_swiglu_reason(x, w, xs, ws, tune=gemm_ffi.parse_tuning(tune))
    assert why is None if words is None else words in why, why


@pytest.mark.parametrize("L, rows, n, expert_major, tune, want", [
    # decode (mean rows per expert <= 128): the default runs our swap-AB kernel, its token tile the
    # smallest of 32 / 64 / 128 / 160 holding 1.25x the mean
    (8, 1024, 4096, False, "auto", ("wgmma", 64, 160)),
    (32, 1024, 4096, False, "auto", ("wgmma", 64, 64)),
    (256, 1024, 7168, False, "auto", ("wgmma", 64, 32)),
    (8, 900, 4096, False, "auto", ("wgmma", 64, 160)),      # mean 112.5: 140.6 -> 160
    (8, 800, 4096, False, "auto", ("wgmma", 64, 128)),      # mean 100: 125 -> 128
    (4, 96, 384, True, "auto", ("wgmma", 64, 128)),         # expert_major: the mean is C
    # prefill: CUTLASS's 128-row tiles
    (32, 32768, 4096, False, "auto", ("cutlass", 128, 0)),
    (4, 200, 256, True, "auto", ("cutlass", 128, 0)),
    # an explicit request wins
    (8, 1024, 4096, False, "cutlass", ("cutlass", 64, 0)),
    (8, 1024, 4096, False, "64", ("cutlass", 64, 0)),
    (32, 32768, 4096, False, "wgmma", ("wgmma", 128, 0)),  # ours, row-major, at prefill
    (8, 1024, 4096, False, "wgmma", ("wgmma", 64, 160)),
    # swap: the swap-AB kernel everywhere, at prefill its largest token tile
    (32, 32768, 4096, False, "swap", ("wgmma", 128, 160)),
    (4, 200, 256, True, "swap", ("wgmma", 128, 160)),
    (8, 1024, 4096, False, "swap", ("wgmma", 64, 160)),
    (256, 1024, 7168, False, "swap", ("wgmma", 64, 32)),
])
def test_kernel_choice(L, rows, n, expert_major, tune, want):
    """Which kernel an fp8 forward call runs, from static shapes only (_C.gemm.choice: the handler's
    own gemm::detail::choose): the measured default (docs/api.md, "Grouped expert GEMMs") and the
    JAX_MOE_A2A_GEMM_TILE_M requests over it. Host-side: no GPU needed."""
    g = _built_gemm()
    t = gemm_ffi.parse_tuning(tune)
    got = g.choice(L, rows, n, 256, expert_major, tile_m=t.tile_m, raster=t.raster, swizzle=t.swizzle,
                   kernel=t.kernel)
    assert tuple(got) == want, got
