"""grouped expert GEMMs (cc/gemm)"""



def built() -> bool:
    """
    True when the CUTLASS grouped-GEMM kernels were compiled into this extension.
    """

def reason() -> str:
    """Why the kernels were not built ('' when they were)."""

def workspace_bytes(fp8: bool, out_f32: bool, transpose_w: bool, num_groups: int, rows: int, n: int, k: int, expert_major: bool) -> int:
    """
    Device workspace bytes of one grouped_gemm call on the current CUDA device.
    """
