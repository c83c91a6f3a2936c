"""Per-replica values: one row per replica, stacked on a leading axis.

`Replicator.run` returns an output that differs between replicas stacked,
``[num_replicas, ...]`` (pmap's convention, tf.distribute's ``PerReplica``).
Passed back into ``run``, each replica receives its own row with the shape it
had inside the step, so per-device state (BatchNorm statistics without an
``axis_name``, EMAs, counters, per-device keys) round-trips unchanged.

A stacked value and a batch look alike: both are split over the replicas on
axis 0. ``run`` tells them apart by where a value came from: it remembers the
arrays it returned as per-replica (and the batches `shard_batch` made), and
everything else must say what it is. `PerReplica` marks a value built
elsewhere (on the host, restored, or computed from a run output outside
``run``); a value that cannot be told apart is an error that says so.
"""

from __future__ import annotations

import enum
import weakref
from typing import Any

import jax

PyTree = Any


class Kind(enum.IntEnum):
    """How `Replicator.run` hands an argument leaf to the replicas."""

    MIRRORED = 0  # every replica sees the whole value
    BATCH = 1  # split on axis 0: each replica sees its slice
    PER_REPLICA = 2  # one row per replica: each replica sees its row, without the axis
    SHARDED = 3  # a parameter split over the replicas: each replica sees it whole
    PER_ISLAND = 4  # one row per DiLoCo island: each replica sees its island's row


class PerReplica:
    """Marks a pytree as per-replica values: every leaf has one row per replica.

    Pass it to `Replicator.run` where a stacked value did not come straight out
    of ``run`` (values built on the host, restored from a checkpoint, or
    computed from ``run``'s outputs outside it). Each replica receives its own
    row, without the leading axis; ``run``'s own per-replica outputs need no
    marking.

    Args:
      values: a pytree whose leaves have leading size ``num_replicas`` (numpy
        or JAX arrays).

    Example::

      counts = rp.PerReplica(np.zeros((repl.num_replicas,), np.int32))
      counts = repl.run(lambda c, b: c + 1, counts, batch)  # each replica: shape ()
    """

    # Deliberately not a pytree node: to `jax.tree` functions it is one leaf, so
    # `run` spots it in the flat argument list it builds anyway, at no extra cost.

    def __init__(self, values: PyTree):
        self.values = values

    def __repr__(self) -> str:
        return f"PerReplica({self.values!r})"


# id(array) -> (weak reference, kind) for arrays whose role this process knows:
# per-replica outputs of `run`, and batches of exactly num_replicas rows made by
# `shard_batch` (the only batches that look like per-replica values).
_KNOWN: dict[int, tuple[weakref.ref, Kind]] = {}


def remember(x: jax.Array, kind: Kind) -> None:
    """Records that ``x`` is a batch or a per-replica value, for as long as it lives."""
    key = id(x)

    def forget(ref, key=key):
        entry = _KNOWN.get(key)
        if entry is not None and entry[0] is ref:
            del _KNOWN[key]

    _KNOWN[key] = (weakref.ref(x, forget), kind)


def known_kind(x: Any) -> Kind | None:
    """The recorded role of ``x``, or None."""
    entry = _KNOWN.get(id(x))
    if entry is None or entry[0]() is not x:
        return None
    return entry[1]


def is_per_replica(x: Any) -> bool:
    """Whether ``x`` is an array `Replicator.run` returned (or placed) as a per-replica value."""
    return known_kind(x) is Kind.PER_REPLICA


def mark_like(tree: PyTree, like: PyTree) -> PyTree:
    """Records the leaves of ``tree`` as per-replica (or as parameters split like a
    batch) where ``like``'s leaves are.

    For values rebuilt from others, e.g. a checkpoint restored onto a state whose
    BatchNorm statistics were per-replica.
    """

    def mark(x, reference):
        kind = known_kind(reference)
        if kind in (Kind.PER_REPLICA, Kind.SHARDED) and isinstance(x, jax.Array):
            remember(x, kind)
        return x

    return jax.tree.map(mark, tree, like)
