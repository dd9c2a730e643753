"""`comm_call`: an XLA FFI call for the communication halves that `jax.checkpoint` accepts.

`jax.ffi.ffi_call(..., has_side_effect=True)` marks its equation with JAX's `FfiEffect`, which
`jax.checkpoint` (remat) refuses ("Effects not supported in partial-eval of checkpoint"). Our
halves must stay side-effecting custom calls for XLA (never removed, merged or duplicated), and
under remat they must run exactly once: recomputing a dispatch in the backward pass would be a
second, unplanned use of its slot on every rank. So `comm_call` binds its own primitive whose
effect, `CommEffect`, is allowed under remat; JAX's partial evaluation never recomputes an
effectful equation but keeps its outputs as residuals, so a checkpointed layer recomputes its
local work (router, experts, shared expert) and reuses the communication's results.

The lowering is `jax.ffi.ffi_lowering(target, has_side_effect=True)`: the HLO is the same custom
call that `jax.ffi.ffi_call` emits. Uses JAX internals (`jax._src.effects`, the FFI abstract
evaluation); they are stable across the JAX versions we test (0.10, 0.11).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.extend.core as _jex
import numpy as np
from jax.interpreters import mlir
# No public API for these (jax 0.10, 0.11): the effect-type registries that let remat, control
# flow and custom_vjp accept our effect, eager dispatch of a primitive, the FFI call's abstract
# evaluation, and the auto-reshard of operands that jax.ffi.ffi_call does.
from jax._src import core as _core
from jax._src import dispatch as _dispatch
from jax._src import effects as _effects
from jax._src import ffi as _jffi


@dataclasses.dataclass(frozen=True)
class CommEffect(_jex.Effect):
    """The effect of a jax_moe_a2a communication half (writes peers' buffers, waits for them)."""

    def __str__(self):
        return "jax_moe_a2a"


COMM_EFFECT = CommEffect()
_effects.lowerable_effects.add_type(CommEffect)
_effects.control_flow_allowed_effects.add_type(CommEffect)
_effects.remat_allowed_effects.add_type(CommEffect)
# Newer JAX releases also have these sets (and put their own FfiEffect in them): custom_vjp
# bodies may carry the effect, and partial evaluation keeps (never recomputes) the equation.
for _name in ("custom_derivatives_allowed_effects", "partial_eval_kept_effects"):
    if hasattr(_effects, _name):
        getattr(_effects, _name).add_type(CommEffect)

_auto_reshard = getattr(_core, "auto_insert_reshard", None)

comm_call_p = _jex.Primitive("jax_moe_a2a_comm_call")
comm_call_p.multiple_results = True
comm_call_p.def_impl(functools.partial(_dispatch.apply_primitive, comm_call_p))


def _abstract_eval(*avals_in, result_avals, target_name, attributes):
    del target_name, attributes
    outs, _ = _jffi.ffi_call_abstract_eval(*avals_in, result_avals=result_avals, has_side_effect=False)
    return outs, {COMM_EFFECT}


def _lowering(ctx, *operands, result_avals, target_name, attributes):
    del result_avals
    rule = jax.ffi.ffi_lowering(target_name, has_side_effect=True)
    return rule(ctx, *operands, **dict(attributes))


comm_call_p.def_effectful_abstract_eval(_abstract_eval)
mlir.register_lowering(comm_call_p, _lowering)


def comm_call(target_name: str, result_shape_dtypes):
    """Like `jax.ffi.ffi_call(target_name, result_shape_dtypes, has_side_effect=True)` (a tuple
    of ShapeDtypeStructs, or one), with remat-compatible effect semantics (module docstring).
    Attributes are scalars (numpy ints/floats), as the handlers decode them."""
    multiple = isinstance(result_shape_dtypes, (tuple, list))
    shapes = tuple(result_shape_dtypes) if multiple else (result_shape_dtypes,)
    result_avals = tuple(jax.core.ShapedArray(s.shape, s.dtype) for s in shapes)

    def call(*operands, **attributes):
        for k, v in attributes.items():
            if not np.isscalar(v):
                raise TypeError(f"comm_call attribute {k}: expected a numpy scalar, got {type(v).__name__}")
        if _auto_reshard is not None:  # pvary operands to a common set of varying axes, as ffi_call does
            operands = _auto_reshard(*operands)
        outs = comm_call_p.bind(*operands, result_avals=result_avals, target_name=target_name,
                                attributes=tuple(sorted(attributes.items())))
        return tuple(outs) if multiple else outs[0]

    return call
