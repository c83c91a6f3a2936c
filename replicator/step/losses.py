"""Loss reductions with global-batch semantics.

The per-replica loss is the replica's share of the global mean:
``sum(per_example_loss * sample_weight) / global_batch_size``. Summing these over
the replicas (as `Replicator.wrap_optimizer` does with their gradients) gives the
mean over the global batch, so N replicas train exactly like one device. This is
the contract of ``tf.nn.compute_average_loss``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from replicator.spmd.context import (
    get_replica_context,
    group_axis,
    note_global_batch_loss,
    num_microbatches,
    vary,
)


def compute_average_loss(
    per_example_loss: jax.typing.ArrayLike,
    global_batch_size: int | jax.typing.ArrayLike | None = None,
    sample_weight: jax.typing.ArrayLike | None = None,
) -> jax.Array:
    """Scales a per-example loss by the global batch size.

    Args:
      per_example_loss: losses with the batch on the leading axis, rank >= 1. All
        axes are summed, so a ``[batch, time]`` loss sums its time steps too.
      global_batch_size: the denominator. By default the local batch size times
        the number of replicas inside `Replicator.run`, and the batch size itself
        outside it (the global view of `Replicator.compile`); under gradient
        accumulation, times the number of microbatches, so that the microbatches'
        losses add up to the full batch's. For a weighted mean pass the total
        weight of the global batch, e.g. ``rp.global_sum(mask)``.
      sample_weight: weights that broadcast (numpy rules) to ``per_example_loss``,
        e.g. a 0/1 mask that drops padded examples from the numerator.

    Returns:
      A float32 (or wider) scalar: ``sum(per_example_loss * sample_weight) /
      global_batch_size``.

    >>> float(compute_average_loss(jnp.array([2.0, 3.0]), global_batch_size=4))
    1.25
    """
    loss = jnp.asarray(per_example_loss)
    if loss.ndim < 1:
        raise ValueError(
            "compute_average_loss expects a per-example loss with the batch on axis 0 "
            f"(rank >= 1), got a scalar of shape {loss.shape}. Pass the unreduced losses."
        )
    loss = loss.astype(jnp.promote_types(loss.dtype, jnp.float32))
    if sample_weight is not None:
        weight = jnp.asarray(sample_weight)
        try:
            shape = jnp.broadcast_shapes(weight.shape, loss.shape)
        except ValueError:
            shape = None
        if shape != loss.shape:
            raise ValueError(
                f"sample_weight of shape {weight.shape} does not broadcast to the "
                f"per-example loss of shape {loss.shape}; for a [batch] weight and a "
                "[batch, time] loss pass sample_weight[:, None]."
            )
        loss = loss * weight.astype(loss.dtype)
    note_global_batch_loss()
    if global_batch_size is None:
        global_batch_size = loss.shape[0] * _replicas() * num_microbatches()
    return jnp.sum(loss) / jnp.asarray(global_batch_size, loss.dtype)


def scale_regularization_loss(regularization_loss: jax.typing.ArrayLike) -> jax.Array:
    """Divides a regularization loss by the number of replicas.

    Every replica adds the same regularization term; after the gradients are
    summed across replicas it must count once, not ``num_replicas`` times.

    Args:
      regularization_loss: a scalar or an array of terms, which are summed.

    Returns:
      ``sum(regularization_loss) / num_replicas`` inside `Replicator.run`, the plain
      sum outside it.

    >>> float(scale_regularization_loss(jnp.array([1.0, 2.0])))
    3.0
    """
    note_global_batch_loss()
    total = jnp.sum(jnp.asarray(regularization_loss))
    total = total.astype(jnp.promote_types(total.dtype, jnp.float32))
    return total / _replicas()


def _replicas() -> int:
    """How many views of the batch the step being traced is one of: the replicas under
    `Replicator.run`, the groups under `compile` with DiLoCo (each sees one group's
    batch), else 1."""
    ctx, group = get_replica_context(), group_axis()
    return ctx.num_replicas if ctx else jax.lax.axis_size(group) if group else 1


def global_sum(x: jax.typing.ArrayLike) -> jax.Array:
    """Sums ``x`` over the whole global batch, e.g. the total weight of a mask.

    Inside `Replicator.run` this sums across the replicas too (a ``psum``); under
    `Replicator.compile` ``x`` already is the global batch. Call it on the full
    batch, outside any microbatch loop, and pass the result as
    ``compute_average_loss(..., global_batch_size=total)`` for an exact weighted
    mean whatever the replica and microbatch counts.

    >>> float(global_sum(jnp.array([1.0, 0.0, 1.0])))
    2.0
    """
    total = jnp.sum(jnp.asarray(x))
    ctx, group = get_replica_context(), group_axis()
    if ctx is None and group is not None:  # compile under DiLoCo: add up the groups
        return jax.lax.psum(vary(total, (group,)), group)
    if ctx is None:
        return total
    # A replica-invariant value is counted once per replica.
    return jax.lax.psum(vary(total, ctx.axis_name), ctx.axis_name)
