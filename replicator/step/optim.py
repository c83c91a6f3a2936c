"""Optimizer wrappers: the cross-replica sum of the gradients, and what comes between it
and the optimizer.

Inside `jax.shard_map` JAX tracks which values vary across replicas. The
gradient of a mirrored (replica-invariant) parameter with respect to a
per-replica loss is *already* summed across the replicas by autodiff: the
transpose of the implicit broadcast is a ``psum``. Summing it again would
multiply it by the number of replicas (Adam's normalisation hides that mistake,
SGD does not). So the wrapper all-reduces exactly the gradient leaves that still
vary across the replica axes, and leaves the others alone. Under
`Replicator.compile` nothing varies and the wrapper is the identity.

`wrap_optimizer` composes wrappers, in the order the gradients meet them:
`sum_gradients` (the sum, or an aggregator that replaces it: `aggregate_gradients`),
`clip_gradients` (the global norm of the summed gradient: kept in a `GradNormState`,
and clipped to), `replicator.parallel.zero.shard_optimizer` (ZeRO's updates on slices, where
`Replicator.run` has sharded arguments), the optimizer; or, under DiLoCo,
`replicator.parallel.diloco.wrap` around the clip and the optimizer.

An aggregator (``aggregate=``) sees each replica's own gradients, not their sum:
`rp.TrainState` created with such an optimizer keeps them (``value_and_grad``
differentiates with the parameters typed per replica, `replicator.parallel.zero.summed`
remembering each replica's part of each sum). It calls the `CrossReplicaSum` it is
given, which ZeRO turns into a reduce-scatter; `narrow_sum` is one, in bfloat16.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from replicator.parallel import diloco as diloco
from replicator.parallel import zero as zero
from replicator.runtime import compat
from replicator.spmd.context import (
    get_replica_context,
    in_global_view,
    own_gradient,
    remember_own_gradient,
    step_memo,
    sum_varying,
    varying_axes,
    warn_if_loss_not_averaged,
)
from replicator.step import precision as precision

PyTree = Any
Aggregator = Callable[[PyTree, "CrossReplicaSum"], PyTree]
_WARNED: set[str] = set()


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
    *,
    aggregate: Aggregator | None = None,
    clip_norm: float | None = None,
    track_norm: bool = False,
) -> optax.GradientTransformationExtraArgs:
    """Sums per-replica gradients across ``axis_names``, then applies ``tx``.

    Args:
      tx: any optax transformation.
      axis_names: the replica axes of the mesh.
      sync: None (every step, all replicas) or `rp.DiLoCo`: groups that sum
        gradients among their own replicas and meet every ``inner_steps``.
      aggregate: None (the sum of the varying leaves) or an aggregator that
        replaces the sum: ``aggregate(grads, cross_replica_sum) -> summed``, given
        this replica's own gradients and a `CrossReplicaSum` to call on them
        (e.g. `narrow_sum`; per-replica clipping or noise before the sum).
      clip_norm: clip the summed gradients to this global norm (the norm of the
        global batch's gradient; under DiLoCo, of the island's), as
        ``optax.clip_by_global_norm`` would on one device. None: no clipping.
      track_norm: keep that norm, before clipping, in the state (`GradNormState`;
        read it with `grad_norm`). Implied by ``clip_norm``.

    Returns:
      A transformation, correct on both `Replicator.run` and `Replicator.compile`,
      with exactly ``tx``'s state (so checkpoints of wrapped and plain optimizers
      are interchangeable), or a `GradNormState` around it with ``track_norm`` or
      ``clip_norm``; under DiLoCo, a `replicator.parallel.diloco.DiLoCoState` around that.
    """
    axis_names = tuple(axis_names)
    tx = optax.with_extra_args_support(tx)
    if clip_norm is not None and not clip_norm > 0:
        raise ValueError(f"clip_norm={clip_norm!r}: use a positive number, or None.")
    if aggregate is not None and not callable(aggregate):
        raise TypeError(f"aggregate must be None or a function, got {aggregate!r}.")

    def tracked(inner):
        return clip_gradients(inner, clip_norm) if clip_norm is not None or track_norm else inner

    if sync is not None:
        if not isinstance(sync, diloco.DiLoCo):
            raise TypeError(f"sync must be None or rp.DiLoCo(...), got {sync!r}.")
        sum_within = lambda grads, axes: aggregate_gradients(grads, axes, aggregate)  # noqa: E731
        wrapped = diloco.wrap(tracked(tx), sync, axis_names, sum_within)
        axes = lambda: diloco.summing_axes(sync, axis_names)  # noqa: E731
    else:
        wrapped = sum_gradients(
            tracked(zero.shard_optimizer(tx, axis_names)), axis_names, aggregate
        )
        axes = lambda: axis_names  # noqa: E731
    if aggregate is None:
        return wrapped
    return wrapped._replace(update=_AggregatingUpdate(wrapped.update, aggregate, axes))


@dataclasses.dataclass(frozen=True)
class _AggregatingUpdate:
    """The update of an optimizer wrapped with an aggregator, which `sum_ahead` finds."""

    update: Callable
    aggregate: Aggregator
    axes: Callable[[], tuple[str, ...]]  # the replica axes the step being traced sums over

    def __call__(self, updates, state, params=None, **extra_args):
        return self.update(updates, state, params, **extra_args)


def needs_replica_gradients(tx: Any) -> bool:
    """Whether ``tx`` aggregates each replica's own gradients (``wrap_optimizer(aggregate=...)``):
    `rp.TrainState.create` then has ``value_and_grad`` keep them."""
    return isinstance(getattr(tx, "update", None), _AggregatingUpdate)


def sum_ahead(tx: Any, grads: PyTree) -> PyTree:
    """Under `Replicator.run`, the gradients ``tx`` sums, summed now, as its aggregator
    will (its update finds this sum again): `rp.TrainState.apply_gradients` checks
    them and, under ZeRO, reduce-scatters them ahead of its guarded update, so the
    sum stays outside the update's conditional, where XLA can overlap it with the
    backward pass. Elsewhere, and for an optimizer without an aggregator, ``grads``."""
    update = getattr(tx, "update", None)
    if not isinstance(update, _AggregatingUpdate) or get_replica_context() is None:
        return grads
    return aggregate_gradients(grads, update.axes(), update.aggregate)


def sum_gradients(
    tx: optax.GradientTransformationExtraArgs,
    axis_names: Sequence[str],
    aggregate: Aggregator | None = None,
) -> optax.GradientTransformationExtraArgs:
    """``tx`` applied to the gradients `aggregate_gradients` gives; ``tx``'s state.

    Args:
      tx: an optax transformation with extra-args support.
      axis_names: the replica axes of the mesh.
      aggregate: None (`sum_across_replicas`) or an aggregator (see `wrap_optimizer`).

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
        summed = aggregate_gradients(updates, axis_names, aggregate)
        return tx.update(summed, state, params, **extra_args)

    return optax.GradientTransformationExtraArgs(tx.init, update_fn)


# ------------------------------------------------------------------ aggregators


@dataclasses.dataclass(frozen=True)
class CrossReplicaSum:
    """The cross-replica sum an aggregator is given (its second argument).

    ``cross_replica_sum(grads, dtype=None)`` sums each leaf of ``grads`` over those
    of ``axis_name`` it varies over; with ``dtype``, floating leaves are sent and
    summed in it (cast back to their own dtype after). Under ZeRO the optimizer
    reduce-scatters instead, in the same dtype: each device receives its slice
    of the same sum.

    Attributes:
      axis_name: the replica axes summed over (within a DiLoCo island, its own);
        ``()`` under `Replicator.compile` and outside `run`, where one replica
        holds the whole batch (XLA has summed the gradients already) and the sum
        is the identity.
    """

    axis_name: tuple[str, ...]

    def __call__(self, grads: PyTree, dtype: Any = None) -> PyTree:
        if dtype is not None and in_global_view():
            _warn_once(
                "global_view",
                f"A cross-replica sum in {jnp.dtype(dtype).name} under repl.compile: there "
                "XLA sums the gradients in the backward pass, in their own dtype, and the "
                "optimizer receives them summed, so nothing is narrowed. The narrow sum "
                "takes effect under repl.run.",
            )
        return jax.tree.map(lambda g: self._sum(g, dtype), grads)

    def _sum(self, g: jax.Array, dtype: Any) -> jax.Array:
        axes = varying_axes(g, self.axis_name)
        if not axes:
            return g
        wire = g.astype(dtype) if dtype is not None and _floating(g) else g
        total = jax.lax.psum(wire, axes)
        total = total if total.dtype == g.dtype else total.astype(g.dtype)
        remember_own_gradient(total, wire)  # ZeRO reduce-scatters ``wire`` instead
        return total


@dataclasses.dataclass(frozen=True)
class _NarrowSum:
    dtype: Any

    def __call__(self, grads: PyTree, cross_replica_sum: CrossReplicaSum) -> PyTree:
        return cross_replica_sum(grads, dtype=self.dtype)


def narrow_sum(dtype: Any = jnp.bfloat16) -> Aggregator:
    """An aggregator for `Replicator.wrap_optimizer` (``aggregate=``): the cross-replica
    sum of the gradients sent and summed in ``dtype``, then cast back (bfloat16:
    half the bytes of a float32 all-reduce, or of ZeRO's reduce-scatter, on the
    wire; the sum rounded to bfloat16). Under `Replicator.compile` it changes
    nothing, with a warning (XLA sums the gradients there).

    Args:
      dtype: the dtype on the wire.

    Returns:
      ``aggregate(grads, cross_replica_sum) -> summed``.

    >>> tx = rp.Replicator().wrap_optimizer(optax.sgd(0.1), aggregate=narrow_sum())
    >>> narrow_sum("float16")
    _NarrowSum(dtype=dtype('float16'))
    """
    return _NarrowSum(jnp.dtype(dtype))


def aggregate_gradients(
    grads: PyTree, axis_names: Sequence[str], aggregate: Aggregator | None = None
) -> PyTree:
    """``grads`` summed across ``axis_names``: `sum_across_replicas`, or ``aggregate`` of
    each replica's own gradients (`own_gradients`) with a `CrossReplicaSum` over them
    (over none outside `Replicator.run`, where the gradients are global already)."""
    if aggregate is None:
        return sum_across_replicas(grads, axis_names)
    axes = tuple(axis_names) if get_replica_context() is not None else ()
    leaves, memo = jax.tree.leaves(grads), step_memo()
    key = (aggregate, axes, tuple(map(id, leaves)))
    if memo is not None and key in memo:  # summed ahead (`sum_ahead`)
        return memo[key][1]
    summed = aggregate(own_gradients(grads, axes), CrossReplicaSum(axes))
    if jax.tree.structure(summed) != jax.tree.structure(grads) or any(
        varying_axes(x, axes) for x in jax.tree.leaves(summed)
    ):
        raise ValueError(
            f"The aggregator {aggregate!r} must return the gradients summed across the "
            "replicas, as a tree like its first argument: call its second argument, the "
            "cross-replica sum, on them (aggregate=lambda grads, sum: sum(f(grads)))."
        )
    if memo is not None:
        memo[key] = (leaves, summed)  # (the leaves: keeps their ids from being reused)
    return summed


def own_gradients(grads: PyTree, axis_names: Sequence[str] = ()) -> PyTree:
    """Each replica's own part of each summed gradient in ``grads`` (as
    `replicator.parallel.zero.summed`
    recorded it), other leaves as they are.

    Raises:
      ValueError: a floating leaf is the same on every replica of ``axis_names``
        and no part of it is known: autodiff summed it already, which cannot be undone.
    """

    def own(g):
        part = own_gradient(g)
        if part is not None:
            return part
        if _floating(g) and axis_names and not varying_axes(g, axis_names):
            raise ValueError(
                "wrap_optimizer(aggregate=...) needs each replica's own gradients, but "
                "autodiff has summed these across replicas already (the gradient of a "
                "mirrored parameter). Differentiate with state.value_and_grad of an "
                "rp.TrainState created with this optimizer, which keeps them."
            )
        return g

    return jax.tree.map(own, grads)


# ------------------------------------------------------- global norm: track, clip


class GradNormState(NamedTuple):
    """The wrapped optimizer's state with ``track_norm`` or ``clip_norm``.

    Attributes:
      grad_norm: the global norm of the summed gradients at the last update,
        before clipping (float32; 0 before the first update).
      inner: the optimizer's own state.
    """

    grad_norm: jax.Array
    inner: optax.OptState


def clip_gradients(
    tx: optax.GradientTransformationExtraArgs, clip_norm: float | None
) -> optax.GradientTransformationExtraArgs:
    """``tx`` applied to the summed gradients clipped to ``clip_norm`` by their global
    norm (None: not clipped), which the state keeps (`GradNormState`).

    The gradients it receives are summed across replicas. Under ZeRO the norm comes
    from this device's slices (the reduce-scatter the update needs anyway, and a
    scalar ``psum``), and the update still sees slices.

    >>> tx = clip_gradients(optax.with_extra_args_support(optax.sgd(1.0)), 1.0)
    >>> updates, state = tx.update({"w": jnp.array([3.0, 4.0])}, tx.init({"w": jnp.zeros(2)}))
    >>> updates["w"].tolist(), float(state.grad_norm)
    ([-0.6000000238418579, -0.800000011920929], 5.0)
    """

    def init_fn(params):
        return GradNormState(jnp.zeros((), jnp.float32), tx.init(params))

    def update_fn(grads, state, params=None, **extra_args):
        with zero.scattered(grads, params) as pieces:
            norm = _global_norm(grads, pieces)
            if clip_norm is not None:
                factor = jnp.where(norm < clip_norm, 1.0, clip_norm / norm)
                grads = zero.scale_summed(grads, factor)
            updates, inner = tx.update(grads, state.inner, params, **extra_args)
        return updates, GradNormState(norm, inner)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _global_norm(grads: PyTree, pieces: PyTree) -> jax.Array:
    """The global norm of ``grads`` (float32), from ``pieces``: each leaf whole, or this
    device's slice of it, whose squares are summed over the axes it is split over
    (one scalar ``psum`` for all the leaves split alike)."""
    squares: dict[tuple[str, ...], jax.Array] = {}
    for g, x in zip(jax.tree.leaves(grads), jax.tree.leaves(pieces), strict=True):
        if _floating(x):
            split = compat.varying_manual_axes(x) - compat.varying_manual_axes(g)
            key = tuple(sorted(split))
            squares[key] = squares.get(key, 0.0) + jnp.sum(jnp.square(x.astype(jnp.float32)))
    total = sum(
        (jax.lax.psum(s, split) if split else s for split, s in squares.items()),
        jnp.zeros((), jnp.float32),
    )
    return jnp.sqrt(total)


def grad_norm(tree: PyTree) -> jax.Array | None:
    """The global norm of the summed gradients at the last update, before clipping, as a
    wrapped optimizer with ``track_norm`` or ``clip_norm`` keeps it (`GradNormState`).

    Args:
      tree: an optimizer state, an `rp.TrainState`, or any pytree holding them.

    Returns:
      The norm (float32; under DiLoCo one per island), None if nothing tracks it;
      for several tracking states (a GAN's two optimizers), the norm of all their
      gradients together.

    >>> tx = rp.Replicator().wrap_optimizer(optax.sgd(0.1), track_norm=True)
    >>> state = rp.TrainState.create({"w": jnp.zeros(2)}, tx, jax.random.key(0))
    >>> float(grad_norm(state)), grad_norm(optax.sgd(0.1).init({"w": jnp.zeros(2)}))
    (0.0, None)
    """
    is_state = lambda x: isinstance(x, GradNormState)  # noqa: E731
    norms = [
        jnp.asarray(_value(x.grad_norm))
        for x in jax.tree.leaves(tree, is_leaf=is_state)
        if is_state(x)
    ]
    if len(norms) <= 1:
        return norms[0] if norms else None
    return jnp.sqrt(sum(jnp.square(n) for n in norms))


def _value(x: Any) -> Any:
    """``x``, or the value of an NNX variable (``nnx.Optimizer`` keeps its state in them)."""
    get_value = getattr(x, "get_value", None)
    return get_value() if callable(get_value) else x


def _floating(x: Any) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)


def _warn_once(key: str, message: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(message, stacklevel=4)
