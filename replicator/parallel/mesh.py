"""Mesh building: the ``("data", "fsdp", "tensor")`` mesh over the devices.

Every Replicator owns one `jax.sharding.Mesh` with the named axes
``("data", "fsdp", "tensor")``, always all three, so that shardings are written
the same way whatever the parallelism: an axis that is not used has size 1.
The data-parallel replicas span ``data`` x ``fsdp``.

The axes of the other parallelisms (`OPTIONAL_AXES`: ``stage`` for pipelines,
``context`` for sequences, ``expert`` for mixtures of experts) are in the mesh
only when asked for with a size above 1, in the order of `AXES`; a sharding
rule that names one the mesh does not have is left out, as for an axis of size
1, so one model's rules serve every mesh.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from replicator.runtime import processes

MESH_AXES = ("data", "fsdp", "tensor")
# Axes in the mesh only with a size above 1, and the order of all of them (outermost
# first: the slow links carry the leftmost, as in MaxText's ``mesh_axes``).
OPTIONAL_AXES = ("stage", "context", "expert")
AXES = ("data", "stage", "fsdp", "context", "expert", "tensor")
# The axes a batch is split over; their product is the number of replicas.
DATA_AXES = ("data", "fsdp")


def resolve_axis_sizes(axes: Mapping[str, int] | None, num_devices: int) -> dict[str, int]:
    """Returns the size of every mesh axis, with the one ``-1`` filled in.

    Args:
      axes: axis name -> size, for names in ``MESH_AXES``; missing axes get size 1
        and at most one axis may be ``-1`` ("all the devices left"). ``None`` means
        ``{"data": -1}``: pure data parallelism.
      num_devices: how many devices the mesh must cover.

    Returns:
      A dict with a size for each name in ``MESH_AXES``, in that order.

    >>> resolve_axis_sizes({"data": -1, "tensor": 2}, 8)
    {'data': 4, 'fsdp': 1, 'tensor': 2}
    """
    axes = _checked_axes(axes)
    free = [name for name, size in axes.items() if size == -1]
    fixed = math.prod(size for size in axes.values() if size != -1)
    if free:
        if num_devices % fixed:
            raise ValueError(
                f"Mesh {axes}: the fixed axes multiply to {fixed}, which does not divide "
                f"the {num_devices} devices, so {free[0]!r} cannot be filled. Choose sizes "
                f"whose product divides {num_devices}."
            )
        axes[free[0]] = num_devices // fixed
    elif fixed != num_devices:
        raise ValueError(
            f"Mesh {axes} has {fixed} devices but {num_devices} are available; make the "
            f"sizes multiply to {num_devices}, or set one axis to -1."
        )
    return _in_order(axes)


def _in_order(sizes: Mapping[str, int]) -> dict[str, int]:
    """Every axis of `MESH_AXES`, and those of `OPTIONAL_AXES` above 1, in `AXES` order."""
    return {
        name: sizes.get(name, 1) for name in AXES if name in MESH_AXES or sizes.get(name, 1) > 1
    }


def refit_axis_sizes(axes: Mapping[str, int] | None, num_devices: int) -> dict[str, int]:
    """The mesh ``axes`` asked for, fitted to ``num_devices`` devices however many they are.

    For work whose result does not depend on the mesh, such as evaluating a
    checkpoint: sizes that fit the devices (`resolve_axis_sizes`) are kept.
    Otherwise one axis absorbs the difference: the axis given as ``-1``, or
    ``data`` when none is. Each other axis shrinks only as far as it must, to the
    largest size that divides both its own and the devices left for it (fitted
    in the order ``fsdp``, ``tensor``, ``data``): a parameter dimension that
    split evenly over it before still does.

    Args:
      axes: axis sizes as for `resolve_axis_sizes` (e.g. a training run's mesh).
      num_devices: how many devices there are now.

    Returns:
      A dict with a size for each name in ``MESH_AXES``, in that order, whose
      product is ``num_devices``.

    >>> refit_axis_sizes({"data": 8}, 3)
    {'data': 3, 'fsdp': 1, 'tensor': 1}
    >>> refit_axis_sizes({"data": 4, "fsdp": 2}, 6)  # fsdp fits: kept
    {'data': 3, 'fsdp': 2, 'tensor': 1}
    >>> refit_axis_sizes({"data": 1, "fsdp": -1, "tensor": 2}, 3)  # -1 absorbs
    {'data': 1, 'fsdp': 3, 'tensor': 1}
    >>> refit_axis_sizes({"data": -1, "tensor": 2}, 8)  # fits as it is
    {'data': 4, 'fsdp': 1, 'tensor': 2}
    """
    axes = _checked_axes(axes)
    if not isinstance(num_devices, int) or num_devices < 1:
        raise ValueError(f"num_devices={num_devices!r}; a mesh needs at least one device.")
    free = [name for name, size in axes.items() if size == -1]
    fixed = math.prod(size for size in axes.values() if size != -1)
    if (num_devices % fixed == 0) if free else (fixed == num_devices):
        return resolve_axis_sizes(axes, num_devices)
    absorber = free[0] if free else "data"
    sizes, left = {}, num_devices
    for name in ("fsdp", "tensor", "expert", "context", "stage", "data"):
        if name != absorber:
            sizes[name] = math.gcd(axes.get(name, 1), left)
            left //= sizes[name]
    sizes[absorber] = left
    return _in_order(sizes)


def _checked_axes(axes: Mapping[str, int] | None) -> dict[str, int]:
    """``axes`` as a dict (``None``: ``{"data": -1}``); raises for unknown names, sizes
    that are neither positive nor -1, and more than one -1."""
    axes = dict({"data": -1} if axes is None else axes)
    unknown = sorted(set(axes) - set(AXES))
    if unknown:
        raise ValueError(f"Unknown mesh axes {unknown}; the mesh axes are {list(AXES)}.")
    for name, size in axes.items():
        if not isinstance(size, int) or isinstance(size, bool) or (size < 1 and size != -1):
            raise ValueError(f"Mesh axis {name!r} has size {size!r}; use a positive int or -1.")
    free = [name for name, size in axes.items() if size == -1]
    if len(free) > 1:
        raise ValueError(f"Only one mesh axis may be -1, got {free} in {axes}.")
    return axes


def build_mesh(
    devices: Sequence[jax.Device] | None = None,
    axes: Mapping[str, int] | None = None,
    dcn_axes: Mapping[str, int] | None = None,
) -> Mesh:
    """Builds the ``("data", "fsdp", "tensor")`` mesh over ``devices``.

    Args:
      devices: the devices to use; ``None`` means every device of every process. The
        devices of a Cloud TPU slice to compile for (`replicator.compiled.topology.devices`)
        work too: the mesh is laid out as on that slice, for lowering and compiling.
      axes: axis sizes as in `resolve_axis_sizes`; with ``dcn_axes``, the sizes
        within one TPU slice (or one host).
      dcn_axes: axis sizes across TPU slices (or hosts, on GPUs), e.g.
        ``{"data": 2}``: a hybrid mesh (`hybrid_mesh_devices`).

    Returns:
      A mesh whose axes are `Auto` (the compiler propagates shardings), laid out
      for the hardware's topology (`jax.experimental.mesh_utils`) when it spans all
      devices or a whole topology's; a subset of this job's devices in their order.
    """
    if dcn_axes is not None:
        array, names = hybrid_mesh_devices(axes, dcn_axes, devices, with_names=True)
        return Mesh(array, names, axis_types=(AxisType.Auto,) * len(names))
    if devices is not None:
        devices = list(devices)
        if not devices:
            raise ValueError(
                "devices=[] is empty; pass at least one device, or devices=None for all "
                f"{jax.device_count()} devices."
            )
    processes.check_joined()
    whole = devices is None or len(devices) == jax.device_count() or _compile_only(devices)
    devices = jax.devices() if devices is None else devices
    sizes = resolve_axis_sizes(axes, len(devices))
    shape = tuple(sizes.values())
    if whole:
        # Topology-aware order on TPU/GPU (rings along the fastest axes): for all of this
        # job's devices, or a whole slice's devices to compile for (`replicator.compiled.topology`).
        device_array = _create_device_mesh(shape, devices)
    else:
        device_array = np.asarray(devices, dtype=object).reshape(shape)
    return Mesh(device_array, tuple(sizes), axis_types=(AxisType.Auto,) * len(sizes))


def _compile_only(devices: Sequence[jax.Device]) -> bool:
    """Whether ``devices`` are none of this job's: a topology's, to compile for."""
    own = {(d.platform, d.id) for d in jax.devices()}
    return not any((d.platform, d.id) in own for d in devices)


def _create_device_mesh(shape: tuple[int, ...], devices: list[jax.Device]) -> np.ndarray:
    from jax.experimental import mesh_utils

    for split in (False, True):  # a physical axis split over mesh axes only when it must be
        try:
            return mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=split)
        except (ValueError, NotImplementedError, AssertionError):
            pass
    # Topologies mesh_utils does not know (e.g. fake CPU devices split oddly).
    return np.asarray(devices, dtype=object).reshape(shape)


# --------------------------------------------------------------- multi-slice


def hybrid_mesh_devices(
    ici_axes: Mapping[str, int] | None,
    dcn_axes: Mapping[str, int] | None,
    devices: Sequence[Any] | None = None,
    *,
    with_names: bool = False,
) -> np.ndarray | tuple[np.ndarray, tuple[str, ...]]:
    """Devices laid out for a mesh that spans several TPU slices (or GPU hosts).

    The slow links between slices (DCN) carry only the ``dcn_axes``; inside a
    slice the fast interconnect (ICI) carries the ``ici_axes``. Each mesh axis
    has size ``ici * dcn``. Put ``data`` across slices (one gradient all-reduce
    per step) and keep ``fsdp`` and ``tensor`` inside them (collectives in every
    layer), as MaxText, t5x and Levanter do. Devices without a ``slice_index``
    (GPUs, CPUs) are grouped by process instead: one host is one "slice".

    Args:
      ici_axes: axis sizes within one slice, as for `resolve_axis_sizes` (one
        may be -1: the slice's remaining devices).
      dcn_axes: axis sizes across slices; None means ``{"data": -1}``.
      devices: the devices; default all.

    Returns:
      An object array of devices with shape ``(data, fsdp, tensor)`` for
      ``jax.sharding.Mesh(array, MESH_AXES)`` (with an optional axis above 1,
      in `AXES` order); ``with_names``: ``(array, axis names)``.

    Raises:
      ValueError: the slices differ in size, or the axis sizes do not match them.
    """
    from jax.experimental import mesh_utils

    devices = list(jax.devices() if devices is None else devices)
    by_slice = bool(devices) and all(hasattr(d, "slice_index") for d in devices)
    slices = collections.Counter(d.slice_index if by_slice else d.process_index for d in devices)
    sizes = set(slices.values())
    if len(sizes) != 1:
        raise ValueError(f"Slices hold different numbers of devices: {dict(slices)}.")
    dcn = resolve_axis_sizes(dcn_axes, len(slices))
    ici = resolve_axis_sizes(ici_axes, sizes.pop())
    names = tuple(a for a in AXES if a in ici or a in dcn)
    shapes = ([ici.get(a, 1) for a in names], [dcn.get(a, 1) for a in names])
    try:
        array = mesh_utils.create_hybrid_device_mesh(
            *shapes, devices, process_is_granule=not by_slice
        )
    except (ValueError, NotImplementedError, AssertionError):
        # A slice's physical axis split over mesh axes (e.g. 4x4 chips as fsdp=8, tensor=2).
        array = mesh_utils.create_hybrid_device_mesh(
            *shapes, devices, process_is_granule=not by_slice, allow_split_physical_axes=True
        )
    array = np.asarray(array, dtype=object)
    return (array, names) if with_names else array
