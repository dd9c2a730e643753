"""Small contract fixes of the review of 2026-12-04: Communicator(**options) treats None as "not
given", as init does (finding 16); Layout.of raises ValueError as documented (finding 20)."""

import jax.numpy as jnp
import pytest

import jax_moe_a2a as a2a
from jax_moe_a2a.comm import Communicator


@pytest.mark.skipif("host" not in a2a.available_backends(), reason="needs the host backend")
def test_none_options_are_not_given(mesh, monkeypatch):
    """Communicator(..., proxied=None) kept the None, which HostBackend read as proxied=False and
    so ignored $JAX_MOE_A2A_HOST_PROXIED=1 (init filtered it out, the class did not)."""
    monkeypatch.setenv("JAX_MOE_A2A_HOST_PROXIED", "1")
    spec = a2a.Spec(num_experts=2 * mesh.size, experts_per_token=2, hidden=16, max_tokens_per_rank=4,
                    dispatch_dtype=jnp.float32, combine_dtype=jnp.float32)
    comm = Communicator(spec, mesh, "ep", "host", proxied=None, provider=None)
    try:
        assert comm.options == {}
        assert comm.diagnostics()["proxied"] is True
    finally:
        comm.close()


def test_layout_of_unknown_name_raises_value_error():
    """Layout.of raised a bare KeyError; the codes' contract (Dtype.of) is ValueError."""
    from jax_moe_a2a.dtypes import Layout
    assert Layout.of("expert_major") == Layout.EXPERT_MAJOR
    with pytest.raises(ValueError, match="layout: expected one of"):
        Layout.of("dense")
