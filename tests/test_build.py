"""The build compiled what this machine can build: CUDA kernels wherever nvcc exists, the
nvshmem backend wherever nvcc and the nvidia-nvshmem wheel exist, the TransferEngine wherever
libfabric's development files exist. CI runs on CPU machines, so this is where a silently
skipped part of the build (a CMake test that stopped finding something) shows up."""

import os
import shutil
import subprocess
import sys

import pytest

from build_checks import nvshmem_wheel_home
from jax_moe_a2a import _ffi


def _c():
    return _ffi.require_native()  # raises, naming the import error, when the module is missing


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc here")
def test_cuda_kernels_compiled_where_nvcc_exists():
    assert _c().built_with_cuda(), "nvcc is on PATH but the extension was built without the CUDA kernels"


def test_nvshmem_wheel_check_never_raises():
    """No `nvidia` namespace package: the check says "no wheel" instead of raising (in a fresh
    interpreter whose path has no `nvidia`, and for a parent package that does not exist)."""
    assert nvshmem_wheel_home("jax_moe_a2a_no_such_namespace.nvshmem") is None
    code = ("import sys; sys.path[:] = [p for p in sys.path if 'site-packages' not in p]; "
            f"sys.path.insert(0, {os.path.dirname(__file__)!r}); "
            "import importlib.util; from build_checks import nvshmem_wheel_home; "
            "assert importlib.util.find_spec('nvidia') is None; print(nvshmem_wheel_home())")
    out = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "None", out.stderr


@pytest.mark.skipif(shutil.which("nvcc") is None or nvshmem_wheel_home() is None,
                    reason="needs nvcc and the nvidia-nvshmem wheel")
def test_nvshmem_backend_compiled_where_the_wheel_exists():
    assert _c().built_with_nvshmem(), "nvcc and the NVSHMEM wheel exist but the nvshmem backend was not built"


def _has_libfabric_dev():
    if shutil.which("pkg-config") is None:
        return False
    return subprocess.run(["pkg-config", "--exists", "libfabric"]).returncode == 0


@pytest.mark.skipif(not _has_libfabric_dev(), reason="no libfabric development files")
def test_transfer_engine_compiled_where_libfabric_exists():
    assert _c().built_with_libfabric(), "libfabric is installed but the TransferEngine was not built"


@pytest.mark.skipif(shutil.which("nvcc") is None or not _has_libfabric_dev(), reason="needs nvcc and libfabric")
def test_cuda_inter_node_path_compiled_where_nvcc_and_libfabric_exist():
    c = _c().cuda
    assert hasattr(c, "connect_remote"), \
        "nvcc and libfabric exist but the cuda backend's inter-node path (proxy) was not built"


def test_benchmark_module_compiled_beside_the_library():
    """One build makes the benchmarks' own module jax_moe_a2a_bench (cc/bench) too, with the parts
    this machine can build; none of its loops is in the library's module."""
    import jax_moe_a2a_bench as loops
    assert hasattr(loops, "signal_roundtrip") == _c().built_with_cuda()
    assert all(hasattr(loops, n) for n in ("pingpong", "stream", "scatter", "barrier", "RawPingPong")) \
        == _c().built_with_libfabric()
    names = set(dir(_c())) | {n for m in ("cuda", "transfer") if hasattr(_c(), m) for n in dir(getattr(_c(), m))}
    assert not {n for n in names if "bench" in n or n in ("signal_roundtrip", "RawPingPong")}


def _cutlass_include():
    import importlib.util
    spec = importlib.util.find_spec("cutlass_library")
    if spec is None or not spec.submodule_search_locations:
        return None
    inc = os.path.join(list(spec.submodule_search_locations)[0], "source", "include")
    return inc if os.path.isdir(inc) else None


@pytest.mark.skipif(shutil.which("nvcc") is None or _cutlass_include() is None,
                    reason="needs nvcc and the nvidia-cutlass wheel's headers")
def test_gemm_probe_compiles(tmp_path):
    """benchmarks/gemm_probe.cu (our own fp8 GEMM checked and timed without Python, the first thing
    a GPU call runs: scripts/gpu_check.sh stage probe) still compiles against cc/gemm, as that stage
    compiles it (sm_90a; CPU machines compile, they cannot run it)."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    # with the measurement parts (the swap-AB kernel's ablations and trace) that the probe stage
    # compiles in; the library's own build compiles the kernels without them
    cmd = ["nvcc", "-std=c++17", "-O1", "-arch=sm_90a", "--expt-relaxed-constexpr", "-DA2A_GEMM_ABLATIONS", f"-I{repo}/cc",
           f"-I{_cutlass_include()}", f"{repo}/benchmarks/gemm_probe.cu", f"{repo}/cc/gemm/gemm_fp8_wgmma.cu",
           f"{repo}/cc/gemm/swiglu.cu", "-o", str(tmp_path / "gemm_probe")]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]


@pytest.mark.skipif(shutil.which("nvcc") is None or _cutlass_include() is None,
                    reason="needs nvcc and the nvidia-cutlass wheel's headers")
def test_swap_kernel_promotion_reads_its_scales_from_shared_memory(tmp_path):
    """Every instance of the swap-AB fp8 kernel (cc/gemm/fp8_wgmma_swap.cuh, as the library builds
    it) reads a k-block's scales from the stage in shared memory: the x scales as
    ld.shared.v2.f32 (at least kTok / 8 of them, promote_swap), the weight scale copied there by
    warp 1, so no global f32 load and no generic (address-space-less) load is left. Both used to
    be there (the storage's address went through an integer, so the compiler lost the address
    space, and the weight scale was loaded from global memory in the promotion) and cost ~8 % at
    decode L = 8 on an H100 (notes/benchmarks.md, 2026-12-05, twenty-second session). The
    row-major kernel (fp8_wgmma.cuh) shares the storage helper (aligned_storage): no generic
    load or store in any of its instances either (it had 12 loads and 3 stores)."""
    import re
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ptx = tmp_path / "gemm_fp8_wgmma.ptx"
    cmd = ["nvcc", "-std=c++17", "-O3", "-arch=sm_90a", "--expt-relaxed-constexpr", f"-I{repo}/cc",
           f"-I{_cutlass_include()}", "-ptx", f"{repo}/cc/gemm/gemm_fp8_wgmma.cu", "-o", str(ptx)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    text = ptx.read_text()
    starts = [m.start() for m in re.finditer(r"\.entry ", text)] + [len(text)]
    seen, row_major = [], 0
    for a, b in zip(starts, starts[1:]):
        body = text[a:b]
        if "fp8_grouped_kernel" in body[:400]:
            row_major += 1
            generic = re.findall(r"\b(?:ld|st)\.(?!shared|global|param|local|const)[a-z0-9.]*\s", body)
            assert not generic, f"row-major kernel: generic accesses {generic[:4]} (shared memory seen as generic?)"
        m = re.search(r"fp8_swap_kernelI(?:13__nv_bfloat16|f)Li(\d+)ELi(\d+)E", body[:400])
        if m is None:
            continue
        tok = int(m.group(1))
        seen.append((tok, int(m.group(2))))
        generic = re.findall(r"\bld\.(?!shared|global|param|local|const)[a-z0-9.]*\s", body)
        assert not generic, f"swap kernel kTok={tok}: generic loads {generic[:4]} (shared memory seen as generic?)"
        assert not re.findall(r"ld\.global\.nc\.f32", body), f"swap kernel kTok={tok}: a global f32 load (a scale?) left"
        assert len(re.findall(r"ld\.shared\.v2\.f32", body)) >= tok // 8, f"swap kernel kTok={tok}: promotion not reading sx by LDS"
    assert sorted(set(seen)) == [(t, c) for t in (32, 64, 128, 160) for c in (1, 2)], seen
    assert row_major == 6, row_major  # {bf16, f32} x {overlap, serial} stores, and the fused SwiGLU's two
