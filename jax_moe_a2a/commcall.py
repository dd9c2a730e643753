"""`comm_call`: the XLA FFI call of the communication halves, with no JAX-level effect.

Our halves must stay side-effecting custom calls for XLA (never removed, merged or duplicated):
the lowering is `jax.ffi.ffi_lowering(target, has_side_effect=True)`, the same custom call that
`jax.ffi.ffi_call(..., has_side_effect=True)` emits, and every call site carries a distinct
`call_id` attribute.

At the JAX level the equation carries NO effect, unlike `ffi_call(has_side_effect=True)` (whose
`FfiEffect` makes the whole executable "effectful"). An executable with any effect leaves JAX's
C++ dispatch fast path: every call of the jitted step goes through Python (`_run_python_pjit`)
and threads runtime tokens, 0.2-0.8 ms of host time per call measured on the GPU machine
(2026-12-02, `benchmarks/layers.py --trace`): at decode that, not the kernels, set the pace of an
MoE layer. What the effect gave us is kept by two rules on our primitive instead:

- dead-code elimination (`pe.dce_rules`): the equation is never removed from its jaxpr, even
  when none of its outputs is used (a half is a collective: every rank must run it);
- remat (`pe.partial_eval_jaxpr_custom_rules`): under `jax.checkpoint` the equation is never
  recomputed. It runs once in the forward pass and its outputs are saved as residuals, exactly
  as JAX treats effectful equations: recomputing a dispatch in the backward pass would be a
  second, unplanned use of its slot on every rank. A checkpointed layer recomputes its local
  work (router, experts, shared expert) and reuses the communication's results.

Uses JAX internals (`jax._src.interpreters.partial_eval`'s rule tables, the FFI abstract
evaluation); they are stable across the JAX versions we test (0.10, 0.11).
"""

from __future__ import annotations

import functools

import jax
import jax.extend.core as _jex
import numpy as np
from jax.interpreters import ad, mlir
# No public API for these (jax 0.10, 0.11): the DCE and remat rule tables, eager dispatch of a
# primitive, the FFI call's abstract evaluation, and the auto-reshard of operands that
# jax.ffi.ffi_call does.
from jax._src import ad_util as _ad_util
from jax._src import core as _core
from jax._src import dispatch as _dispatch
from jax._src import ffi as _jffi
from jax._src.interpreters import partial_eval as _pe

_auto_reshard = getattr(_core, "auto_insert_reshard", None)

comm_call_p = _jex.Primitive("jax_moe_a2a_comm_call")
comm_call_p.multiple_results = True
comm_call_p.def_impl(functools.partial(_dispatch.apply_primitive, comm_call_p))


def _abstract_eval(*avals_in, result_avals, target_name, attributes):
    del target_name, attributes
    outs, _ = _jffi.ffi_call_abstract_eval(*avals_in, result_avals=result_avals, has_side_effect=False)
    return outs


def _lowering(ctx, *operands, result_avals, target_name, attributes):
    del result_avals
    rule = jax.ffi.ffi_lowering(target_name, has_side_effect=True)
    return rule(ctx, *operands, **dict(attributes))


def _keep_dce(used_outputs, eqn):
    """Never dead-code eliminated: every input stays used, the equation stays."""
    del used_outputs
    return [True] * len(eqn.invars), eqn


def _never_recompute(saveable, unks_in, inst_in, eqn):
    """Partial evaluation under remat, as JAX treats an effectful equation: with every input
    known it runs on the known (forward) side only and its outputs become residuals where the
    staged side needs them; with an unknown input it is staged, its known inputs residuals."""
    del saveable
    n = len(eqn.outvars)
    if not any(unks_in):
        return eqn, None, [False] * n, [False] * n, []
    res = [v for v, inst in zip(eqn.invars, inst_in) if type(v) is _core.Var and not inst]
    return None, eqn, [True] * n, [True] * n, res


def _jvp(primals, tangents, **params):
    """The calls have no derivative of their own: the custom_vjp rules of jax_moe_a2a/autodiff.py
    give the halves theirs, and pass the float operands through stop_gradient. What still reaches
    here are integer operands (routing) whose tangents are float0 zeros: ignored, the outputs'
    tangents are zero. A float operand with a tangent is refused, naming the call and operand:
    the communicator stop-gradients every operand it passes (`after=` included), so it comes from
    code that calls a backend's halves or `comm_call` directly, or from forward-mode autodiff
    (jax.jvp / jacfwd), which the FFI halves do not support (their rules are reverse-mode)."""
    for i, (p, t) in enumerate(zip(primals, tangents)):
        if type(t) is not _ad_util.Zero and getattr(t, "dtype", None) != jax.dtypes.float0:
            raise NotImplementedError(
                f"jax_moe_a2a: {params['target_name']} got a tangent for its float operand {i} "
                f"({getattr(p, 'dtype', '?')}{list(getattr(p, 'shape', ()))}): the FFI halves have no derivative "
                "of their own. Through a Communicator, their gradients come from reverse-mode rules (jax.grad, "
                "jax.vjp); forward-mode (jax.jvp, jax.jacfwd) is not supported on this backend (the reference "
                "and ragged backends support it). Calling a backend or comm_call directly: pass the operand "
                "through jax.lax.stop_gradient")
    outs = comm_call_p.bind(*primals, **params)
    return outs, [_ad_util.Zero(jax.typeof(o).to_tangent_aval()) for o in outs]


comm_call_p.def_abstract_eval(_abstract_eval)
ad.primitive_jvps[comm_call_p] = _jvp
mlir.register_lowering(comm_call_p, _lowering)
_pe.dce_rules[comm_call_p] = _keep_dce
_pe.partial_eval_jaxpr_custom_rules[comm_call_p] = _never_recompute


def comm_call(target_name: str, result_shape_dtypes):
    """Like `jax.ffi.ffi_call(target_name, result_shape_dtypes, has_side_effect=True)` (a tuple
    of ShapeDtypeStructs, or one), without a JAX-level effect (module docstring).
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
