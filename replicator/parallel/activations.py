"""Activations placed by the rules table, as MaxText places them.

A model names its activations' dimensions with logical axes (MaxText's names:
``activation_batch``, ``activation_length``, ``activation_embed``,
``activation_heads``, ``activation_kv``, ``activation_mlp``) through `constrain`.
Under `Replicator.compile`, which makes its rules the ones read here while it
traces a step (`activation_rules`), that is a sharding constraint by those rules,
written as parameter rules are (`replicator.parallel.sharding`); anywhere else (under
`run`, where each replica holds its own part, or in plain JAX) it is nothing.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from replicator.parallel import axes as mesh_axes
from replicator.parallel.sharding_rules import DEFAULT_RULES, Rule, as_axes, is_logical_rule

ACTIVATION_RULES: tuple[Rule, ...] = (
    ("activation_batch", ("data", "fsdp", "expert")),
    ("activation_heads", "tensor"),
    ("activation_mlp", "tensor"),
    ("activation_length", "context"),
)
"""MaxText's placement of activations named with `constrain`: the batch over ``data``,
``fsdp`` and ``expert`` (outside its mixture-of-experts layers an expert device is a
data-parallel one: without it, a mesh ``{'expert': 4, 'data': 2}`` computed the
attention 4 times over, 3x the FLOPs of ``{'data': 8}``), attention heads and the
MLP's hidden width over ``tensor``, the sequence over ``context``
(`replicator.attention.context`). They apply whenever the parameters are sharded,
unless the rules name the same activation axis (``("activation_batch", None)``
leaves the batch to the compiler)."""


_ACTIVATION_RULES: contextvars.ContextVar[tuple[Rule, ...] | None] = contextvars.ContextVar(
    "activation_rules", default=None
)


@contextlib.contextmanager
def activation_rules(rules: Sequence[Rule] | None):
    """Makes ``rules`` (None: `DEFAULT_RULES`), with `ACTIVATION_RULES` for the
    activation axes they do not name, the ones `constrain` reads; `compile` sets its
    Replicator's while it traces a step."""
    rules = tuple(DEFAULT_RULES if rules is None else rules)
    named = {rule[0] for rule in rules}
    rules += tuple(rule for rule in ACTIVATION_RULES if rule[0] not in named)
    token = _ACTIVATION_RULES.set(rules)
    try:
        yield
    finally:
        _ACTIVATION_RULES.reset(token)


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """``x`` placed on the mesh as its dimensions' logical ``names`` say, by the rules
    of the `Replicator` compiling the step (MaxText's logical activation axes: e.g.
    ``("activation_batch", "activation_length", "activation_embed")``).

    Under `Replicator.compile` this is a sharding constraint: a name's rule gives
    its mesh axes (one or several; axes of size 1, axes an earlier dimension took,
    and splits that do not divide are left out). Anywhere else (under `run`, where
    each replica holds its own part already, or in plain JAX) it returns ``x``.

    >>> constrain(jnp.ones((4, 8)), ("activation_batch", "activation_embed")).shape
    (4, 8)
    """
    rules = _ACTIVATION_RULES.get()
    mesh = jax.sharding.get_abstract_mesh()
    if rules is None or mesh.empty:
        return x
    if len(names) != np.ndim(x):
        raise ValueError(
            f"constrain: {len(names)} names {tuple(names)} for a {np.ndim(x)}-d value."
        )
    # Axes a shard_map made manual (a pipeline's, `replicator.parallel.pipelining`) split x already.
    taken = set(mesh.axis_names) - set(mesh_axes.auto_axes(mesh))
    parts = []
    for size, name in zip(np.shape(x), names):
        axes = _rule_axes(name, rules)
        axes = tuple(a for a in axes if a in mesh.axis_names and mesh.shape[a] > 1)
        axes = tuple(a for a in axes if a not in taken)
        if not axes or size % math.prod(mesh.shape[a] for a in axes):
            parts.append(None)
            continue
        taken.update(axes)
        parts.append(axes[0] if len(axes) == 1 else axes)
    if not any(parts):  # no rule for these names: the compiler places it, as without
        return x
    return jax.lax.with_sharding_constraint(x, P(*parts))


def current_axes(name: str) -> tuple[str, ...]:
    """The mesh axes the rules being traced with give activation axis ``name``
    (`ACTIVATION_RULES` outside any): e.g. ``("data", "fsdp")`` for the batch.

    >>> current_axes("activation_batch")
    ('data', 'fsdp', 'expert')
    """
    rules = _ACTIVATION_RULES.get()
    return _rule_axes(name, ACTIVATION_RULES if rules is None else rules)


def batch_axes(mesh, rows: int, exclude: str | None = None) -> tuple[str, ...]:
    """The axes a library program (`replicator.parallel.pipelining`,
    `replicator.attention.context`) goes manual over beside its own, so that each
    device works on its own of ``rows`` rows: of the axes the rules split the batch
    over (`current_axes` of ``activation_batch``: ``data``, ``fsdp``, ``expert``) but
    ``exclude``, those `replicator.parallel.axes.split_over` keeps (automatic, above 1,
    as many as ``rows`` divides over, in order).

    Args:
      mesh: the mesh being traced for.
      rows: the size of the batch dimension to split.
      exclude: the program's own axis, never a batch axis here.

    Returns:
      The batch axes, in the rules' order.

    >>> auto = (jax.sharding.AxisType.Auto,) * 2  # (JAX 0.12's default is Explicit)
    >>> mesh = jax.sharding.AbstractMesh((2, 4), ("data", "fsdp"), axis_types=auto)
    >>> batch_axes(mesh, 8), batch_axes(mesh, 6), batch_axes(mesh, 8, exclude="data")
    (('data', 'fsdp'), ('data',), ('fsdp',))
    """
    names = (a for a in current_axes("activation_batch") if a != exclude)
    return mesh_axes.split_over(mesh, tuple(names), rows)


def _rule_axes(name: str | None, rules: Sequence[Rule]) -> tuple[str, ...]:
    for key, target in rules:
        if key == name and is_logical_rule(key, target):
            return as_axes(target)
    return ()
