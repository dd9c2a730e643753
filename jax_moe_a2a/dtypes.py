"""Dtypes and layouts: the dtype sets the ops accept, and the codes shared with C++
(cc/core/dtype.h ElemKind, cc/core/shape.h Layout; _C.Dtype, _C.Layout). No other module of ours."""

from __future__ import annotations

import enum

import jax.numpy as jnp
import numpy as np

LAYOUTS = ("ragged", "expert_major")
FP8_DTYPES = (np.dtype(jnp.float8_e4m3fn),)
# The 16/32-bit float dtypes: dispatch's input dtypes (x, without fp8 scales) and combine's
# dtypes (y, Spec.combine_dtype, Spec.recv_dtype) are this one set; two names for the two roles.
FLOAT_DTYPES = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16), np.dtype(jnp.float32))
WIRE_DTYPES = FLOAT_DTYPES + FP8_DTYPES  # dispatch's wire dtypes (Spec.dispatch_dtype)
INPUT_DTYPES = FLOAT_DTYPES              # x (fp8 x comes with x_scale)
COMBINE_DTYPES = FLOAT_DTYPES            # y, combine's output, Spec.recv_dtype


class Dtype(enum.IntEnum):
    """Element dtype codes shared with C++ (cc/core/dtype.h ElemKind, _C.Dtype): the wire dtype of
    dispatch, the dtypes of combine's rows and outputs, the FFI `y_kind` attribute."""

    F32 = 0
    BF16 = 1
    F16 = 2
    F8_E4M3FN = 3

    @classmethod
    def of(cls, dtype) -> "Dtype":
        """The code of a NumPy / JAX dtype; ValueError for any other."""
        d = np.dtype(dtype)
        for code, np_dtype in _NUMPY.items():
            if np_dtype == d:
                return code
        raise ValueError(f"no jax_moe_a2a dtype code for {d} (valid: {[str(v) for v in _NUMPY.values()]})")

    @property
    def numpy(self) -> np.dtype:
        return _NUMPY[self]

    @property
    def itemsize(self) -> int:
        return _NUMPY[self].itemsize


_NUMPY = {Dtype.F32: np.dtype(jnp.float32), Dtype.BF16: np.dtype(jnp.bfloat16), Dtype.F16: np.dtype(jnp.float16),
          Dtype.F8_E4M3FN: np.dtype(jnp.float8_e4m3fn)}


class Layout(enum.IntEnum):
    """Receive layout codes shared with C++ (cc/core/shape.h Layout, _C.Layout)."""

    RAGGED = 0
    EXPERT_MAJOR = 1

    @classmethod
    def of(cls, name: str) -> "Layout":
        """The code of a layout name ("ragged", "expert_major"); ValueError for any other."""
        codes = {"ragged": cls.RAGGED, "expert_major": cls.EXPERT_MAJOR}
        if name not in codes:
            raise ValueError(f"layout: expected one of {LAYOUTS}, got {name!r}")
        return codes[name]


# The fp8 dtype of the library (e4m3fn, the dtype of FP8_DTYPES): quantised rows and weights.
FP8 = jnp.float8_e4m3fn

__all__ = ["Dtype", "Layout", "LAYOUTS", "FP8", "FP8_DTYPES", "FLOAT_DTYPES", "WIRE_DTYPES", "INPUT_DTYPES",
           "COMBINE_DTYPES"]
