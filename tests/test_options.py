"""`init`'s options: each backend declares the ones it reads (Backend.OPTIONS); any other is a
ValueError naming the valid ones, not silently ignored."""

import inspect
import re

import jax.numpy as jnp
import pytest

import jax_moe_a2a as a2a
from jax_moe_a2a.backends.cuda import CudaBackend
from jax_moe_a2a.backends.host import HostBackend
from jax_moe_a2a.backends.nvshmem import NvshmemBackend
from jax_moe_a2a.backends.ragged import RaggedBackend
from jax_moe_a2a.backends.reference import ReferenceBackend
from jax_moe_a2a.comm import check_options

SPEC = a2a.Spec(num_experts=16, experts_per_token=2, hidden=32, max_tokens_per_rank=4)


@pytest.mark.parametrize("typo, needle", [("colect_stats", "colect_stats"), ("node_sise", "node_sise")])
def test_typos_raise_with_valid_names(mesh, typo, needle):
    with pytest.raises(ValueError, match=rf"reference backend: unknown option\(s\) {needle}; its options: none"):
        a2a.init(SPEC, mesh, "ep", backend="reference", **{typo: 2})


def test_option_of_another_backend_raises(mesh):
    with pytest.raises(ValueError, match="reference backend: unknown option.*node_size"):
        a2a.init(SPEC, mesh, "ep", backend="reference", node_size=2)
    a2a.init(SPEC, mesh, "ep", backend="reference", node_size=None)  # None: not given


@pytest.mark.skipif("host" not in a2a.available_backends(), reason="host backend not built")
def test_host_lists_its_options(mesh):
    with pytest.raises(ValueError) as info:
        a2a.init(SPEC, mesh, "ep", backend="host", node_sise=2)
    msg = str(info.value)
    for name in ("engine", "max_private_tokens", "node_size", "provider", "proxied"):
        assert name in msg, msg
    a2a.init(SPEC, mesh, "ep", backend="host", max_private_tokens=2).close()


def test_declared_options_match_what_backends_read():
    """Every `opts.get(...)` name in a backend's source is declared, and nothing more."""
    for cls in (HostBackend, CudaBackend):
        src = inspect.getsource(cls)
        read = set(re.findall(r"opts\.get\(\"(\w+)\"", src))
        assert read == set(cls.OPTIONS), (cls.name, read, set(cls.OPTIONS))
    for cls in (ReferenceBackend, RaggedBackend, NvshmemBackend):
        assert cls.OPTIONS == {} and "opts.get" not in inspect.getsource(cls)


def test_init_signature_lists_every_backend_option():
    params = inspect.signature(a2a.init).parameters
    for cls in (HostBackend, CudaBackend):
        for name in cls.OPTIONS:
            assert name in params and params[name].default is None, name
    for name in ("debug", "timeout_s", "collect_stats"):
        assert name in params


def test_check_options_unit():
    assert check_options(HostBackend(), {"proxied": True}) == {"proxied": True}
    with pytest.raises(ValueError, match="nvshmem backend: unknown option.*node_size; its options: none"):
        check_options(NvshmemBackend(), {"node_size": 2})
