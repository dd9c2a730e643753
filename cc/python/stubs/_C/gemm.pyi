"""grouped expert GEMMs (cc/gemm)"""



def built() -> bool:
    """
    True when the CUTLASS grouped-GEMM kernels were compiled into this extension.
    """

def reason() -> str:
    """Why the kernels were not built ('' when they were)."""

def workspace_bytes(fp8: bool, out_f32: bool, mode: int, num_groups: int, rows: int, n: int, k: int, expert_major: bool, tile_m: int = 0, raster: int = 0, swizzle: int = 1, kernel: int = 0) -> int:
    """
    Device workspace bytes of one grouped_gemm call in `mode` (0 forward, 1 transpose_w, 2 wgrad) with the kernel configuration tile_m (0 auto, 64, 128), raster (0 along M, 1 along N, 2 heuristic), swizzle (1, 2, 4, 8), kernel (0 auto, 1 cutlass, 2 wgmma, 3 swap): the custom call's attributes. On the current CUDA device: exactly what the handler checks.
    """

def swiglu_reason(num_groups: int, rows: int, n: int, k: int, expert_major: bool, tile_m: int = 0, raster: int = 0, swizzle: int = 1, kernel: int = 0) -> str:
    """
    Why the fused SwiGLU GEMM (jax_moe_a2a_grouped_gemm_swiglu) cannot take an fp8 call with L = num_groups, rows (R, or C when expert_major), n = 2F and k, in the kernel configuration given ('' when it can): the rule its handler applies.
    """

def swiglu_by_default(num_groups: int, rows: int, n: int, k: int, expert_major: bool, tile_m: int = 0, raster: int = 0, swizzle: int = 1, kernel: int = 0) -> bool:
    """
    Whether an fp8 gate+up call with L = num_groups, rows (R, or C when expert_major), n = 2F and k, in the kernel configuration given, runs as the fused SwiGLU GEMM when the call does not say (neither `fused` nor `unfused` in JAX_MOE_A2A_GEMM_TILE_M): it can, and the swap-AB kernel's token tile is one where the fused epilogue measured faster than the GEMM and the SwiGLU kernel.
    """

def choice(num_groups: int, rows: int, n: int, k: int, expert_major: bool, tile_m: int = 0, raster: int = 0, swizzle: int = 1, kernel: int = 0) -> tuple[str, int, int]:
    """
    The kernel an fp8 forward call with L = num_groups, rows (R, or C when expert_major), n and k runs in the configuration given: (kernel 'cutlass' or 'wgmma', CUTLASS's tile rows 64 or 128, the swap-AB token tile (0: row-major)). Static shapes only, as the handler chooses.
    """
