"""Property test: random specs, rank counts and routings against the oracle (single process)."""

import jax.numpy as jnp
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import jax_moe_a2a as a2a
from jax_moe_a2a import testing as T

from conftest import BACKENDS


@st.composite
def cases(draw):
    n = draw(st.sampled_from([1, 2, 4, 8]))
    tp = draw(st.sampled_from([t for t in (1, 2) if n % t == 0]))
    l_count = draw(st.integers(1, 4))
    e = n * l_count
    k = draw(st.integers(1, min(e, 5)))
    fp8 = draw(st.booleans())
    block = draw(st.sampled_from([16, 32]))
    h = block * draw(st.integers(1, 3))
    t = draw(st.integers(1, 9))
    layout = draw(st.sampled_from(["ragged", "expert_major"]))
    cap = draw(st.one_of(st.none(), st.integers(1, 40)))
    spec = a2a.Spec(num_experts=e, experts_per_token=k, hidden=h, max_tokens_per_rank=t,
                    dispatch_dtype=jnp.float8_e4m3fn if fp8 else jnp.bfloat16, scale_block=block,
                    layout=layout, recv_capacity=cap, tp_size=tp)
    kw = dict(routing=draw(st.sampled_from(["random", "one_hot", "empty", "skewed"])),
              invalid_frac=draw(st.sampled_from([0.0, 0.1])), minus_one_frac=draw(st.sampled_from([0.0, 0.2])))
    return n, spec, kw, draw(st.integers(0, 2**31 - 1))


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=cases())
def test_random_against_oracle(backend, case):
    n, spec, kw, seed = case
    comm = a2a.init(spec, T.make_mesh(n), "ep", backend=backend, collect_stats=False)
    inputs = T.make_inputs(spec, n, seed, **kw)
    T.check_all(comm, inputs, T.run_ops(comm, inputs))
