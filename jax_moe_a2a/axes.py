"""The varying-axes types of `jax.shard_map` (vma): which mesh axes an array varies over, and
casts that give FFI results and cotangents the types JAX expects. No other module of ours."""

from __future__ import annotations

import jax


def vma(a) -> frozenset:
    """The mesh axes `a` varies over inside shard_map (its type's vma; empty outside shard_map or
    on JAX versions without it)."""
    typeof = getattr(jax, "typeof", None)
    try:
        aval = typeof(a) if typeof is not None else None
    except TypeError:
        return frozenset()
    mat = getattr(aval, "manual_axis_type", None)  # jax 0.11
    if mat is not None:
        return frozenset(getattr(mat, "varying", ()))
    return frozenset(getattr(aval, "vma", ()) or ())  # jax 0.6 - 0.10


def varying(tree, axis):
    """Marks FFI outputs as varying over the EP axis inside shard_map (they differ per rank);
    without it JAX types them as replicated and autodiff/check_vma reject them. Casts only over
    the axes an array does not vary over yet. No-op on JAX versions without `jax.lax.pcast`."""
    pcast = getattr(jax.lax, "pcast", None)
    if pcast is None:
        return tree
    axes = axis if isinstance(axis, tuple) else (axis,)

    def cast(a):
        if a is None or getattr(a, "dtype", None) == jax.dtypes.float0:
            return a
        have = vma(a)
        missing = tuple(x for x in axes if x not in have)
        if not missing:
            return a
        try:
            return pcast(a, missing, to="varying")
        except (ValueError, TypeError, NameError):  # already varying, or outside shard_map
            return a

    return jax.tree.map(cast, tree)


def like_primal(ct, axes):
    """A cotangent typed like its primal, which varies over `axes` (a custom_vjp rule must return
    exactly the primal's type): varying over the axes it lacks; summed over the axes the primal
    is invariant over (on a multi-axis mesh the FFI results vary over the EP groups' axes too, as
    the groups' inputs do; the transpose of that broadcast is the sum)."""
    if ct is None or getattr(ct, "dtype", None) == jax.dtypes.float0:
        return ct
    axes = tuple(axes)
    extra = tuple(sorted(vma(ct) - set(axes)))
    if extra and vma(ct):
        ct = jax.lax.psum(ct, extra)
    return varying(ct, axes) if axes else ct
