"""comm_call's JAX semantics (jax_moe_a2a/commcall.py): no JAX-level effect (so a jitted step keeps
JAX's C++ dispatch fast path), yet never dead-code eliminated and never recomputed under remat.
Lowered only (the target need not exist): nothing here runs a kernel."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_moe_a2a.commcall import comm_call

pytestmark = pytest.mark.skipif(jax.process_count() > 1, reason="one process")

TARGET = "jax_moe_a2a_test_target"


def _half(x):
    """A stand-in half: x [8] f32 -> y [8] f32 through the custom call."""
    return comm_call(TARGET, jax.ShapeDtypeStruct(x.shape, x.dtype))(x, call_id=np.int64(7))


def test_no_jax_effect():
    jaxpr = jax.make_jaxpr(_half)(jnp.ones(8))
    assert not jaxpr.effects  # an effect would take every call of the step off the fast path
    assert [e.primitive.name for e in jaxpr.eqns] == ["jax_moe_a2a_comm_call"]


def test_side_effecting_custom_call_in_hlo():
    text = jax.jit(_half).lower(jnp.ones(8)).as_text()
    assert TARGET in text and "has_side_effect = true" in text


def _kept_after_dce():
    """Whether DCE keeps a half whose result is unused (a function built afresh: JAX caches traces
    and DCE by jaxpr), in the jaxpr and in the lowered HLO."""
    def discard(x):
        _half(x)  # a collective: must run on every rank even when its result is unused
        return x + 1

    from jax._src.interpreters import partial_eval as pe
    dced, _ = pe.dce_jaxpr(jax.make_jaxpr(discard)(jnp.ones(8)).jaxpr, [True])
    return ("jax_moe_a2a_comm_call" in [e.primitive.name for e in dced.eqns],
            TARGET in jax.jit(discard).lower(jnp.ones(8)).as_text())


def test_never_dead_code_eliminated():
    from jax._src.interpreters import partial_eval as pe
    from jax_moe_a2a.commcall import comm_call_p
    assert _kept_after_dce() == (True, True)
    rule = pe.dce_rules.pop(comm_call_p)  # without the rule an effect-free half would be removed
    try:
        assert _kept_after_dce() == (False, False)
    finally:
        pe.dce_rules[comm_call_p] = rule


def _grad_comm_calls(policy):
    """Calls of the half in the jaxpr of grad(checkpoint(layer)). The layer is built afresh on
    every call: JAX caches traces and partial evaluations by function and jaxpr, so a second call
    with the same function would not consult the rule table again."""
    @jax.custom_vjp
    def half(x):  # the library's halves sit inside custom_vjp rules: no tangent reaches the primitive
        return _half(x)
    half.defvjp(lambda x: (_half(x), None), lambda _, g: (g,))

    def layer(x):
        return jnp.sum(jnp.sin(half(jnp.cos(x)) * x) ** 2)
    rem = jax.checkpoint(layer) if policy is None else jax.checkpoint(layer, policy=policy)
    text = str(jax.make_jaxpr(jax.grad(rem))(jnp.ones(8)))
    assert text.count("sin") >= 2, text  # the local work after the half: forward once, recomputed once
    return text.count("jax_moe_a2a_comm_call")


@pytest.mark.parametrize("policy", [None, "dots"])
def test_never_recomputed_under_remat(policy):
    """The half runs once (forward); its output is a residual for the backward pass, while the
    local work around it is recomputed. Without our partial-evaluation rule remat would run it
    twice (checked by taking the rule out)."""
    from jax._src.interpreters import partial_eval as pe
    from jax_moe_a2a.commcall import comm_call_p
    pol = jax.checkpoint_policies.checkpoint_dots if policy else None
    assert _grad_comm_calls(pol) == 1
    rule = pe.partial_eval_jaxpr_custom_rules.pop(comm_call_p)
    try:
        assert _grad_comm_calls(pol) == 2
    finally:
        pe.partial_eval_jaxpr_custom_rules[comm_call_p] = rule


def test_unknown_inputs_are_staged():
    """The rule itself: all inputs known -> forward side only, outputs not instantiated (residuals
    on demand); an unknown input -> staged once, its known un-instantiated inputs residuals."""
    from jax._src.interpreters import partial_eval as pe
    from jax_moe_a2a.commcall import comm_call_p
    eqn = jax.make_jaxpr(lambda a, b: comm_call(TARGET, jax.ShapeDtypeStruct((8,), jnp.float32))(
        a, b, call_id=np.int64(1)))(jnp.ones(8), jnp.ones(8)).jaxpr.eqns[0]
    rule = pe.partial_eval_jaxpr_custom_rules[comm_call_p]
    known, staged, unks, inst, res = rule(None, [False, False], [True, False], eqn)
    assert known is eqn and staged is None and unks == [False] and inst == [False] and res == []
    known, staged, unks, inst, res = rule(None, [True, False], [True, False], eqn)
    assert known is None and staged is eqn and unks == [True] and inst == [True] and res == [eqn.invars[1]]
