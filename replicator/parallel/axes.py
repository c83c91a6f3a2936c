"""Mesh facts: what a parallel layer asks about the mesh it is traced for.

Every library program that splits work over a named mesh axis (the pipeline over
``stage``, context attention over ``context``, experts over ``expert``, the
activation rules) asks the same few questions of the mesh being traced
(``jax.sharding.get_abstract_mesh()``, which `Replicator.compile`, `Replicator.run`
and ``jax.set_mesh`` make ambient): how large is an axis, is it manual already (a
``shard_map`` over it encloses the call), which axes are still the compiler's,
and which of them a batch of rows splits over. They are answered here, once.

>>> mesh = AbstractMesh((2, 4), ("data", "stage"), axis_types=(AxisType.Auto, AxisType.Manual))
>>> with jax.sharding.use_abstract_mesh(mesh):
...     size("stage"), is_manual("stage"), is_manual("data"), auto_axes()
(4, True, False, ('data',))
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
from jax.sharding import AbstractMesh, AxisType, Mesh


def size(axis: str) -> int:
    """The size of ``axis`` in the mesh being traced for.

    Args:
      axis: a mesh axis name.

    Returns:
      Its size; 1 outside any mesh or where the mesh has no such axis.

    >>> size("stage")  # no mesh: one stage
    1
    """
    mesh = jax.sharding.get_abstract_mesh()
    return mesh.shape[axis] if axis in mesh.axis_names else 1


def is_manual(axis: str) -> bool:
    """Whether ``axis`` is manual in the mesh being traced for: a ``jax.shard_map`` over
    it encloses the caller, which then holds one device's part along it.

    Args:
      axis: a mesh axis name.

    Returns:
      True only where the mesh has ``axis`` and its type is ``AxisType.Manual``.

    >>> is_manual("stage")  # no mesh: nothing is manual
    False
    """
    mesh = jax.sharding.get_abstract_mesh()
    return dict(zip(mesh.axis_names, mesh.axis_types)).get(axis) == AxisType.Manual


def manual_axes(mesh: Mesh | AbstractMesh | None = None) -> tuple[str, ...]:
    """The manual axes of ``mesh`` (None: the mesh being traced for), in mesh order.

    Args:
      mesh: a mesh, or None for ``jax.sharding.get_abstract_mesh()``.

    Returns:
      The names of its axes of type ``AxisType.Manual`` (none outside a ``shard_map``).

    >>> manual_axes()
    ()
    """
    return _axes_of_type(mesh, AxisType.Manual)


def auto_axes(mesh: Mesh | AbstractMesh | None = None) -> tuple[str, ...]:
    """The automatic axes of ``mesh`` (None: the mesh being traced for), in mesh order:
    those the compiler partitions and a library program may still go manual over.

    Args:
      mesh: a mesh, or None for ``jax.sharding.get_abstract_mesh()``.

    Returns:
      The names of its axes of type ``AxisType.Auto``.

    >>> auto_axes(AbstractMesh((2, 4), ("data", "tensor"), axis_types=(AxisType.Auto,) * 2))
    ('data', 'tensor')
    """
    return _axes_of_type(mesh, AxisType.Auto)


def split_over(
    mesh: Mesh | AbstractMesh, candidates: Sequence[str | None], rows: int
) -> tuple[str, ...]:
    """The axes a batch of ``rows`` rows splits over, of ``candidates``.

    Greedy, in the order given, each name once: a candidate is kept where it is an
    automatic axis of ``mesh`` of size above 1 and ``rows`` divides over it and the
    ones kept before it. Axes left out hold the rows whole (replicated), so any
    answer computes the same numbers; this one splits the rows as far as they go.

    Args:
      mesh: the mesh (usually the one being traced for).
      candidates: axis names in order of preference (e.g. the activation rules' batch
        axes); names not in ``mesh``, and None, are skipped.
      rows: the size of the dimension to split.

    Returns:
      The kept axes, in the order of ``candidates``.

    >>> mesh = AbstractMesh((2, 4, 2), ("data", "fsdp", "stage"), axis_types=(AxisType.Auto,) * 3)
    >>> split_over(mesh, ("data", "fsdp", "expert"), rows=8)
    ('data', 'fsdp')
    >>> split_over(mesh, ("data", "fsdp"), rows=6)  # 6 rows split over data's 2, not fsdp's 4 more
    ('data',)
    >>> split_over(mesh, ("fsdp", "data", "fsdp"), rows=4)
    ('fsdp',)
    """
    auto = set(auto_axes(mesh))
    kept: list[str] = []
    for name in dict.fromkeys(candidates):  # in order, once each
        if name in auto and mesh.shape[name] > 1:
            if rows % (math.prod(mesh.shape[a] for a in kept) * mesh.shape[name]) == 0:
                kept.append(name)
    return tuple(kept)


def _axes_of_type(mesh, kind: AxisType) -> tuple[str, ...]:
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    return tuple(n for n, t in zip(mesh.axis_names, mesh.axis_types) if t == kind)
