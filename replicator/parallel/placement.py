"""Placement: the role of each argument leaf, and the one table of where each role lives.

Every array a step takes or returns plays one of five roles (`Kind`): mirrored
on every replica, a batch split on axis 0, a per-replica value (one row per
replica), a parameter sharded over the replicas, or one row per index of one
replica axis (DiLoCo's replica groups, `replicator.parallel.groups`). The role decides how the
leaf enters a ``shard_map`` and how it leaves it; `role_specs` is that table,
written once, and `sharding_for` reads it for values placed on the mesh outside
a step (checkpoint restore, DiLoCo's rows). `run`, `compile` and `Checkpoints`
all ask here.

A batch and a per-replica value look alike: both are split over the replicas
on axis 0. So the roles this process has seen are remembered, by array
identity, in one registry kept here (`remember`, `known_kind`): `run`'s
per-replica outputs, batches of exactly ``num_replicas`` rows, parameters
sharded like a batch, DiLoCo's rows. It is process-global because an
array's role outlives the call that made it (a state returned by one step goes
into the next, a restored checkpoint into the first), and keyed by ``id`` with
a weak reference so that it never keeps an array alive. `PerReplica` marks a
value whose role nothing recorded; `Roles` classifies each call's leaves.
"""

from __future__ import annotations

import enum
import math
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from replicator.parallel import zero as zero
from replicator.parallel.mesh import DATA_AXES
from replicator.runtime import compat

PyTree = Any


class Kind(enum.IntEnum):
    """How `Replicator.run` hands an argument leaf to the replicas."""

    MIRRORED = 0  # every replica sees the whole value
    BATCH = 1  # split on axis 0: each replica sees its slice
    PER_REPLICA = 2  # one row per replica: each replica sees its row, without the axis
    SHARDED = 3  # a parameter split over the replicas: each replica sees it whole
    PER_GROUP = 4  # one row per index of DiLoCo's axis: each replica sees its own


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


# The registry: id(array) -> (weak reference, kind) for arrays whose role this
# process knows (see the module docstring for why it is global and weak).
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


Role = Kind | NamedSharding  # a sharded parameter's role carries its sharding


def role_specs(role: Role, axes: tuple[str, ...], row_axis: str | None = None) -> tuple[P, P]:
    """The table: how a leaf of ``role`` enters a ``shard_map`` manual over ``axes``
    (its in spec) and leaves it (its out spec). ``row_axis``: the axis DiLoCo's
    groups span (`Kind.PER_GROUP`)."""
    if role is _MIRRORED:
        return P(), P()
    if role is _PER_GROUP:
        return P(row_axis), P(row_axis)
    if isinstance(role, NamedSharding):  # a parameter: split as its sharding says
        spec = zero.manual_spec(role, axes)
        return spec, spec
    return P(axes), P(DATA_AXES)  # a batch; a per-replica value, stacked like one


def sharding_for(role: Kind, mesh: jax.sharding.Mesh, row_axis: str | None = None) -> NamedSharding:
    """Where a value of ``role`` lives on ``mesh`` outside a step (its out spec)."""
    return NamedSharding(mesh, role_specs(role, DATA_AXES, row_axis)[1])


def output_roles(shard_map: Callable, call: Callable, flat: Sequence[Any]) -> Any:
    """What ``call`` returns traced abstractly on each replica's arguments under
    ``shard_map(body, out_specs)`` (``jax.eval_shape``, nothing runs): a step's output
    tree and the roles its leaves leave with, which its out specs need first."""
    found = []

    def probe(*local):
        found.append(call(*local))
        return ()

    jax.eval_shape(shard_map(probe, ()), *flat)
    return found[0]


_MIRRORED, _BATCH, _PER_REPLICA, _PER_GROUP = (
    Kind.MIRRORED,
    Kind.BATCH,
    Kind.PER_REPLICA,
    Kind.PER_GROUP,
)  # fmt: skip  (module-level names: enum attribute lookups cost in the per-call loop)
ROWS = (Kind.PER_REPLICA, Kind.PER_GROUP)  # roles of which each replica gets a row
UNSEEN, SPLIT, SHARDED = object(), object(), object()  # `Roles.layout`s


class Roles:
    """The replicas of one mesh, and the role of each argument leaf a call passes them.

    Attributes:
      axis_name: the mesh axes the replicas span (those of size > 1; ``("data",)``
        on one device).
      num_replicas: the size of the data axes.
      one_replica_axes: what `compile` binds to its one replica: the replica axes,
        and the data axes of size 1 too (a collective over them is the identity).
      batch_sharding: a batch split over the replicas; mirrored_sharding: a value on
        every device.
    """

    def __init__(self, mesh: jax.sharding.Mesh):
        self.mesh = mesh
        # Only axes of size > 1: a value split over them varies exactly there.
        self.axis_name: tuple[str, ...] = (
            tuple(a for a in DATA_AXES if mesh.shape[a] > 1) or DATA_AXES[:1]
        )
        self.num_replicas: int = math.prod(mesh.shape[a] for a in DATA_AXES)
        self.one_replica_axes = self.axis_name + tuple(
            a for a in DATA_AXES if a not in self.axis_name
        )
        # Spelled ("data", "fsdp") even where one has size 1: a parameter sharded
        # over "fsdp" alone is then never mistaken for a batch.
        self.batch_sharding = sharding_for(Kind.BATCH, mesh)
        self.mirrored_sharding = sharding_for(Kind.MIRRORED, mesh)
        self._layouts: dict[Any, Any] = {}  # sharding -> layout(sharding)

    def kinds(self, flat: list, args: tuple) -> tuple[Role, ...] | None:
        """How each argument leaf reaches the replicas (a `NamedSharding`: a parameter
        sharded over them, gathered for the step), or None if a leaf is an unplaced
        `PerReplica`; per call, so kept cheap: what a sharding means is worked out
        once per sharding."""
        kinds, layouts, known = [], self._layouts, known_kind
        sharding_of = compat.leading_sharding
        for i, x in enumerate(flat):
            sharding = sharding_of(x)
            layout = layouts.get(sharding, UNSEEN) if sharding is not None else None
            if layout is UNSEEN:
                layout = layouts[sharding] = self.layout(sharding)
            if layout is None:
                if sharding is None and type(x) is PerReplica:
                    return None
                kinds.append(_MIRRORED)
            elif layout is SPLIT:
                kind = known(x)
                # The common case, a batch of more rows than replicas, decided here.
                if kind is None and x.shape[0] != self.num_replicas:
                    kinds.append(_BATCH)
                else:
                    kinds.append(self._split_kind(x, args, i))
            else:
                kind = known(x)
                kinds.append(kind if kind is _PER_REPLICA or kind is _PER_GROUP else x.sharding)
        return tuple(kinds)

    def layout(self, sharding: Any) -> Any:
        """None: not split over the replicas (mirrored, or split over ``tensor`` only);
        SPLIT: split on axis 0 like a batch; SHARDED: a parameter split over them."""
        if not isinstance(sharding, NamedSharding) or (
            sharding.mesh.axis_names != self.mesh.axis_names
        ):
            return None
        entries = [_as_tuple(e) or () for e in sharding.spec]
        if not any(a in self.axis_name for e in entries for a in e):
            return None
        batch_like = entries[0] in (DATA_AXES, ("data",) if self.axis_name == ("data",) else ())
        if batch_like and not any(a in DATA_AXES for e in entries[1:] for a in e):
            return SPLIT
        return SHARDED

    def _split_kind(self, x: Any, args: tuple, index: int) -> Role:
        kind = known_kind(x)
        if kind is Kind.SHARDED:  # a parameter that only looks like a batch
            return x.sharding
        if kind is Kind.PER_GROUP:
            return kind
        rows = x.shape[0]
        if kind is Kind.PER_REPLICA and rows != self.num_replicas:
            raise ValueError(
                f"run: argument {leaf_path(args, index)} is a per-replica value with {rows} "
                f"rows, but this Replicator has {_replicas(self.num_replicas)} (one row per "
                f"replica). It was made for {_replicas(rows)}: reduce it there, or rebuild it "
                f"with {self.num_replicas} rows and pass rp.PerReplica(value)."
            )
        if kind is None and rows == self.num_replicas:
            raise ValueError(
                f"run: argument {leaf_path(args, index)} (shape {x.shape}) is split over "
                f"{_replicas(self.num_replicas)} with one row each: it could be a batch of "
                f"{rows} examples or a per-replica value, and run cannot tell which. Pass "
                "rp.PerReplica(value) for a per-replica value (each replica gets its row), "
                "or make the batch with repl.shard_batch (each replica gets a slice)."
            )
        return kind or Kind.BATCH

    def place_marked(self, args: tuple) -> tuple:
        """Replaces each `PerReplica` by its leaves, split one row per replica."""

        def place(x):
            rows = np.shape(x)[0] if np.ndim(x) else None
            if rows != self.num_replicas:
                raise ValueError(
                    f"rp.PerReplica needs one row per replica: a leading axis of size "
                    f"{self.num_replicas}, got shape {np.shape(x)}."
                )
            if getattr(x, "sharding", None) != self.batch_sharding:
                if isinstance(x, jax.Array) and x.is_fully_addressable:
                    x = jax.device_put(x, self.batch_sharding)
                else:
                    host = np.asarray(x)
                    x = jax.make_array_from_callback(
                        host.shape, self.batch_sharding, lambda index: host[index]
                    )
            remember(x, Kind.PER_REPLICA)
            return x

        def unwrap(x):
            return jax.tree.map(place, x.values) if isinstance(x, PerReplica) else x

        return jax.tree.map(unwrap, args)

    def check_growth(self, grows: list[int], flat: list, args: tuple) -> None:
        """Raises for a mirrored argument, not placed on the mesh, that came back with one
        more axis (a host copy of a per-replica value, passed back unmarked: it would
        grow every step). One placed with `replicate` is mirrored by choice."""
        for index in grows:
            if not isinstance(getattr(flat[index], "sharding", None), NamedSharding):
                shape = np.shape(flat[index])
                raise ValueError(
                    f"run: argument {leaf_path(args, index)} (shape {shape}) came in "
                    f"mirrored and left per replica with shape {(self.num_replicas, *shape)}: "
                    "a per-replica value copied to the host and passed back unmarked grows "
                    "an axis every step. Pass rp.PerReplica(value) for a per-replica value "
                    "(each replica gets its row), or repl.replicate(value) for a mirrored "
                    "one (each replica gets all of it)."
                )

    def remember_sharded(self, tree: PyTree) -> None:
        """Records the parameters in ``tree`` split like a batch (a rule's choice) as such."""
        for x in jax.tree.leaves(tree):
            if self.layout(getattr(x, "sharding", None)) is SPLIT:
                remember(x, Kind.SHARDED)


def leaf_path(args: tuple, index: int) -> str:
    """Names leaf ``index`` of ``run``'s arguments, e.g. ``args[1]['ema']``."""
    path, _ = jax.tree_util.tree_flatten_with_path(args)[0][index]
    return "args" + jax.tree_util.keystr(path)


def leaf_positions(args: tuple, argnums: tuple[int, ...]) -> tuple[int, ...]:
    """Maps positions in ``args`` to positions in ``jax.tree.leaves(args)``."""
    positions, start = [], 0
    for i, arg in enumerate(args):
        count = len(jax.tree.leaves(arg))
        if i in argnums:
            positions.extend(range(start, start + count))
        start += count
    return tuple(positions)


def _as_tuple(entry) -> tuple[str, ...] | None:
    if entry is None:
        return None
    return tuple(entry) if isinstance(entry, tuple | list) else (entry,)


def _replicas(n: int) -> str:
    """``"1 replica"``, ``"8 replicas"``."""
    return f"{n} replica{'' if n == 1 else 's'}"
