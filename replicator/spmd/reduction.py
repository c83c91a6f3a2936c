"""Combining per-replica values: `ReduceOp` and what `Replicator.reduce` does where.

Inside `run` a reduction is the cross-replica collective of each replica's own
value; inside a step under `compile` (one replica, the whole batch) it is the
value itself, or under DiLoCo the collective over the groups; outside both,
it sums (or averages) the leading, per-replica axis of what `run` returned.
"""

from __future__ import annotations

import enum
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from replicator.parallel.placement import PerReplica
from replicator.spmd.context import get_replica_context, group_axis, in_global_view, vary
from replicator.spmd.dispatch import StepsInFlight

PyTree = Any


class ReduceOp(enum.Enum):
    """How `Replicator.reduce` combines per-replica values."""

    SUM = "sum"
    MEAN = "mean"


def reduce(op: ReduceOp, value: PyTree, num_replicas: int, in_flight: StepsInFlight) -> PyTree:
    """`Replicator.reduce`."""
    op = ReduceOp(op)
    collective = jax.lax.psum if op is ReduceOp.SUM else jax.lax.pmean
    ctx = get_replica_context()
    if ctx is not None:
        axes = ctx.axis_name
        return jax.tree.map(lambda x: collective(vary(x, axes), axes), value)
    if in_global_view():
        group = group_axis()
        if group is None:
            return value
        # compile under DiLoCo: each group's global view; combine the groups.
        return jax.tree.map(lambda x: collective(vary(x, (group,)), group), value)

    def check(x):
        if np.ndim(x) < 1 or np.shape(x)[0] != num_replicas:
            raise ValueError(
                f"reduce expects per-replica values stacked on a leading axis of size "
                f"{num_replicas}, got shape {np.shape(x)}. `run` returns a value "
                "mirrored (unstacked) when it is the same on every replica, e.g. a "
                "constant such as len(batch); derive per-replica counts from the batch "
                "(jnp.sum(mask)) or reduce inside the step."
            )

    value = jax.tree.map(lambda x: x.values if isinstance(x, PerReplica) else x, value)
    jax.tree.map(check, value)
    # Summing a stacked value over the devices is a collective program too: it
    # counts among the steps in flight, or a loop of run + reduce queues without
    # bound and can time out XLA:CPU's rendezvous.
    return in_flight.dispatch(_reduce_stacked, value, mean=op is ReduceOp.MEAN)


@functools.partial(jax.jit, static_argnames="mean")
def _reduce_stacked(value: Any, mean: bool) -> Any:
    """Sums (or averages) each leaf of ``value`` over its leading, per-replica axis."""
    reduce = jnp.mean if mean else jnp.sum
    return jax.tree.map(lambda x: reduce(x, axis=0), value)
