"""grouped expert GEMMs (cc/gemm)"""



def built() -> bool:
    """
    True when the CUTLASS grouped-GEMM kernels were compiled into this extension.
    """

def reason() -> str:
    """Why the kernels were not built ('' when they were)."""

def workspace_bytes(fp8: bool, out_f32: bool, mode: int, num_groups: int, rows: int, n: int, k: int, expert_major: bool) -> int:
    """
    Device workspace bytes of one grouped_gemm call in `mode` (0 forward, 1 transpose_w, 2 wgrad: the custom call's attribute) on the current CUDA device: exactly what the handler checks.
    """
