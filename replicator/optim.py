"""Optimizer wrappers: all-reduce of per-replica gradients.

Inside `jax.shard_map` JAX tracks which values vary across replicas. The
gradient of a mirrored (replica-invariant) parameter with respect to a
per-replica loss is *already* summed across the replicas by autodiff: the
transpose of the implicit broadcast is a ``psum``. Summing it again would
multiply it by the number of replicas (Adam's normalisation hides that mistake,
SGD does not). So the wrapper all-reduces exactly the gradient leaves that still
vary across the replica axes, and leaves the others alone. Under
`Replicator.compile` nothing varies and the wrapper is the identity.

`wrap_optimizer` composes two wrappers, each with exactly the inner state:
`sum_gradients` around `replicator.zero.shard_optimizer` (ZeRO's updates on
slices, where `Replicator.run` has sharded arguments) around the optimizer; or,
under DiLoCo, `replicator.diloco.wrap`.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import optax

from replicator import diloco, precision, zero
from replicator.context import sum_varying, warn_if_loss_not_averaged


def sum_across_replicas(tree, axis_names: Sequence[str]):
    """Sums every leaf that varies across ``axis_names``; invariant leaves pass through.

    Args:
      tree: a pytree of arrays, e.g. gradients.
      axis_names: the replica axes of the mesh.

    Returns:
      A pytree of replica-invariant arrays.
    """

    return jax.tree.map(lambda x: sum_varying(x, axis_names), tree)


def wrap_optimizer(
    tx: optax.GradientTransformation,
    axis_names: Sequence[str],
    sync: diloco.DiLoCo | None = None,
) -> optax.GradientTransformationExtraArgs:
    """Sums per-replica gradients across ``axis_names``, then applies ``tx``.

    Args:
      tx: any optax transformation.
      axis_names: the replica axes of the mesh.
      sync: None (every step, all replicas) or `rp.DiLoCo`: groups that sum
        gradients among their own replicas and meet every ``inner_steps``.

    Returns:
      A transformation with exactly ``tx``'s state (so checkpoints of wrapped and
      plain optimizers are interchangeable), correct on both `Replicator.run` and
      `Replicator.compile`; under DiLoCo, a `replicator.diloco.DiLoCoState`
      around it.
    """
    axis_names = tuple(axis_names)
    tx = optax.with_extra_args_support(tx)
    if sync is not None:
        if not isinstance(sync, diloco.DiLoCo):
            raise TypeError(f"sync must be None or rp.DiLoCo(...), got {sync!r}.")
        return diloco.wrap(tx, sync, axis_names)
    return sum_gradients(zero.shard_optimizer(tx, axis_names), axis_names)


def sum_gradients(
    tx: optax.GradientTransformationExtraArgs, axis_names: Sequence[str]
) -> optax.GradientTransformationExtraArgs:
    """``tx`` applied to the gradients `sum_across_replicas` gives; ``tx``'s state.

    Args:
      tx: an optax transformation with extra-args support.
      axis_names: the replica axes of the mesh.

    Returns:
      The transformation, which also notes for the step's checks that it trains.

    >>> import jax.numpy as jnp
    >>> tx = sum_gradients(optax.with_extra_args_support(optax.sgd(0.5)), ("data",))
    >>> tx.update({"w": jnp.ones(2)}, tx.init({"w": jnp.ones(2)}))[0]["w"]
    Array([-0.5, -0.5], dtype=float32)
    """
    axis_names = tuple(axis_names)

    def update_fn(updates, state, params=None, **extra_args):
        warn_if_loss_not_averaged()
        precision.note_training()
        return tx.update(sum_across_replicas(updates, axis_names), state, params, **extra_args)

    return optax.GradientTransformationExtraArgs(tx.init, update_fn)
