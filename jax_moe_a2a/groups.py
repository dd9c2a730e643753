"""The EP groups of a mesh axis: which devices are the ranks of which group, and which of them this
process holds. Shared by the communicator and the backends (a backend is opened from the mesh and
the axis and derives its groups here, never from the communicator)."""

from __future__ import annotations

import jax
import numpy as np


def ep_groups(mesh, axis):
    """The EP groups of `axis` (a mesh axis name, or a tuple of them) on `mesh`.

    Returns (group_axes, devices): group_axes, the mesh's other axes in mesh order; devices, an
    object array [G, N] whose row g lists group g's devices in rank order. Rank r of a group is
    jax.lax.axis_index(axis) (row-major over a tuple of axes, in the tuple's order) and its group
    g is jax.lax.axis_index(group_axes) (row-major over the other axes, in mesh order; 0 when the
    mesh has no other axes)."""
    axes = axis if isinstance(axis, tuple) else (axis,)
    names = tuple(mesh.axis_names)
    if not axes:
        raise ValueError("axis: expected a mesh axis name or a non-empty tuple of them, got ()")
    for a in axes:
        if a not in names:
            raise ValueError(f"axis: {a!r} is not an axis of the mesh (axes: {names})")
    if len(set(axes)) != len(axes):
        raise ValueError(f"axis: {axis!r} names an axis twice")
    others = tuple(a for a in names if a not in axes)
    devs = np.asarray(mesh.devices).transpose([names.index(a) for a in others + axes])
    n = int(np.prod([mesh.shape[a] for a in axes]))
    return others, devs.reshape(-1, n)


def local_members(groups) -> dict:
    """{group: [ranks within the group]} of this process's devices in `groups` (the [G, N] array
    of `ep_groups`; groups without local devices left out), both ascending."""
    me = jax.process_index()
    out = {}
    for g, row in enumerate(groups):
        ranks = [r for r, d in enumerate(row) if d.process_index == me]
        if ranks:
            out[g] = ranks
    return out
