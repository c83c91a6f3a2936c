"""The pieces of a train step, each one concern, composed by `rp.TrainState`.

Two kinds, each a function that wraps another, as optax's ``apply_if_finite`` and
``MultiSteps`` wrap an optimizer:

- a gradient function, ``grad_fn(params, batch) -> (grads, out)`` (``jax.grad``
  with ``has_aux`` of a loss that `scale_loss` may scale), is wrapped by
  `accumulate_gradients` (microbatches in one step), `unscale_gradients` (the
  loss scale undone), `restore_invariance` (values computed from the parameters
  alone, mirrored again) and `replicator.parallel.zero.defer_gradient_sum` (ZeRO, and
  an aggregating optimizer's per-replica gradients);
- an update, ``update(params, opt_state) -> (params, opt_state)``, is wrapped by
  `apply_if_finite` (the non-finite guard; `apply_always` without it), which
  `replicator.parallel.zero.update_slices` runs on this device's slices of sharded
  parameters; `keep_if_not_finite` guards small state beside it.

What these pieces keep from step to step lives in `rp.TrainState`'s own fields,
so a checkpoint holds the same tree whichever pieces a run uses: the loss scale
(`rp.LossScale`: ``create``, ``update(finite)``) and ``skipped_steps``. The
accumulation happens within one step (one compiled loop), so it keeps nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from replicator.runtime import compat
from replicator.spmd.context import (
    get_replica_context,
    group_axis,
    microbatching,
    vary,
    varying_axes,
)
from replicator.step import precision as precision
from replicator.step.precision import LossScale

PyTree = Any
GradFn = Callable[[PyTree, PyTree], tuple[PyTree, Any]]
Update = Callable[[PyTree, PyTree], tuple[PyTree, PyTree]]
GuardedUpdate = Callable[[PyTree, PyTree, PyTree], tuple[tuple[PyTree, PyTree], jax.Array]]

# ---------------------------------------------------------------- gradients


def scale_loss(loss_fn: Callable, loss_scale: LossScale | None) -> Callable:
    """``loss_fn(params, batch) -> (loss, out)`` with ``loss`` multiplied by the scale
    (None: ``loss_fn``), for the gradients `unscale_gradients` divides again.

    >>> scaled = scale_loss(lambda p, b: (p * b, None), LossScale.create(4.0))
    >>> float(scaled(jnp.float32(2.0), 3.0)[0])
    24.0
    """
    if loss_scale is None:
        return loss_fn
    precision.note_applied()  # a loss scale is the fp16 policy at work

    def scaled(params, batch):
        loss, out = loss_fn(params, batch)
        return loss_scale.scale_loss(loss), out

    return scaled


def unscale_gradients(grad_fn: GradFn, loss_scale: LossScale | None) -> GradFn:
    """``grad_fn`` with its gradients divided by the loss scale (None: ``grad_fn``).

    >>> grad_fn = unscale_gradients(lambda p, b: (p * 8, None), LossScale.create(4.0))
    >>> float(grad_fn(jnp.float32(1.0), None)[0])
    2.0
    """
    if loss_scale is None:
        return grad_fn

    def unscaled(params, batch):
        grads, out = grad_fn(params, batch)
        return loss_scale.unscale(grads), out

    return unscaled


def accumulate_gradients(grad_fn: GradFn, steps: int) -> GradFn:
    """``grad_fn`` over ``steps`` microbatches of the batch, summed (``steps=1``: itself).

    The batch is split into ``steps`` microbatches on its leading axis, and
    each is differentiated in turn in a `jax.lax.scan` of ``steps`` trips from a
    zero total (peak activation memory: one microbatch). Gradients and ``out``'s
    loss and aux are summed: `rp.compute_average_loss` divides every microbatch
    by the whole global batch (see `replicator.spmd.context.microbatching`), so
    the sum is the big batch's loss and gradient. ``out``'s model state (``(loss, state, aux)``)
    is averaged over the microbatches where it is floating (statistics) and
    the last one's elsewhere (counters, keys). Inside `Replicator.run` the
    gradients are summed across replicas once, after the loop, instead of once
    per microbatch.

    Args:
      grad_fn: ``grad_fn(params, batch) -> (grads, (loss, state, aux))``.
      steps: the number of microbatches; it must divide the batch.

    Returns:
      A gradient function of the same signature, over the whole batch.

    >>> grad_fn = jax.grad(lambda p, b: (jnp.sum(p * b), (jnp.sum(b), None, None)), has_aux=True)
    >>> grads, (loss, _, _) = accumulate_gradients(grad_fn, 2)(1.0, jnp.arange(4.0))
    >>> float(grads), float(loss)
    (6.0, 6.0)
    """
    if steps == 1:
        return grad_fn

    def accumulated(params, batch):
        micro = _split(batch, steps)
        ctx = get_replica_context()
        if ctx is not None:  # each replica's own gradients, summed after the loop
            summed_over = _autodiff_sum_axes(params, ctx.axis_name)
            params = jax.tree.map(lambda p: vary(p, ctx.axis_name), params)
        with microbatching(steps):
            # Every microbatch inside the loop, none before it: a first one ahead of a
            # loop of steps - 1 trips leaves, at 2 steps, a 1-trip loop that XLA
            # unrolls, and it then runs both forward passes before either backward
            # pass, both microbatches' activations alive at once (on a TPU, more
            # temporaries than one big batch; tests/test_precision.py).
            shapes = jax.eval_shape(grad_fn, params, jax.tree.map(lambda x: x[0], micro))
            (grads, loss, sums, aux), kept = jax.lax.scan(
                _accumulate(grad_fn, params), _zeros(_summed(shapes)), micro
            )
        new_state = _state(shapes, [(x / steps).astype(x.dtype) for x in sums], kept)
        if ctx is not None:
            grads = jax.tree.map(
                lambda g, axes: jax.lax.psum(g, axes) if axes else g,
                grads,
                summed_over,
                is_leaf=lambda x: x is None,
            )
        return grads, (loss, new_state, aux)

    return accumulated


def _split(batch: PyTree, steps: int) -> PyTree:
    (size,) = {x.shape[0] for x in jax.tree.leaves(batch)}
    if size % steps:
        raise ValueError(
            f"grad_accum_steps={steps} does not divide the per-replica batch of {size}; use "
            f"a batch size that is a multiple of {steps} x the number of replicas."
        )
    return jax.tree.map(lambda x: x.reshape(steps, size // steps, *x.shape[1:]), batch)


def _autodiff_sum_axes(params: PyTree, axes: tuple[str, ...]) -> PyTree:
    """Per parameter, the replica axes autodiff would have summed its gradient over:
    those the parameter is the same along (all of them, but along DiLoCo's replica groups)."""
    return jax.tree.map(lambda p: tuple(a for a in axes if a not in varying_axes(p, axes)), params)


def _accumulate(grad_fn: GradFn, params: PyTree) -> Callable:
    """The loop's body: one microbatch's sums (`_summed`) added to the running total;
    its other model state (counters, keys) comes out per trip, the last one kept."""

    def body(total, microbatch):
        new = grad_fn(params, microbatch)
        return jax.tree.map(jnp.add, total, _summed(new)), _kept(new)

    return body


def _summed(out: tuple) -> tuple:
    """Of ``(grads, (loss, state, aux))``, what microbatches add up: ``(grads, loss,
    floating state leaves, aux)``. Every microbatch starts from the same model state:
    its floating statistics are summed (and averaged after the loop)."""
    grads, (loss, state, aux) = out
    return grads, loss, [x for x in jax.tree.leaves(state) if _floating(x)], aux


def _kept(out: tuple) -> list:
    """Of ``(grads, (loss, state, aux))``, the model state's other leaves (counters, keys)."""
    return [x for x in jax.tree.leaves(out[1][1]) if not _floating(x)]


def _zeros(shapes: PyTree) -> PyTree:
    """Zeros of ``shapes`` (`jax.eval_shape`'s), each varying over the replica axes its
    shape does: the loop's total has the type of what its body adds to it."""
    zero = lambda s: vary(jnp.zeros(s.shape, s.dtype), tuple(compat.varying_manual_axes(s)))
    return jax.tree.map(zero, shapes)


def _state(shapes: tuple, sums: list, kept: list) -> PyTree:
    """The model state of ``shapes`` (``(grads, (loss, state, aux))``) from its averaged
    floating leaves ``sums`` and its other leaves ``kept`` per microbatch (the last)."""
    leaves, treedef = jax.tree.flatten(shapes[1][1])
    sums, kept = iter(sums), iter(kept)
    return treedef.unflatten([next(sums) if _floating(x) else next(kept)[-1] for x in leaves])


def _floating(x: jax.Array) -> bool:
    return jnp.issubdtype(x.dtype, jnp.floating)


def restore_invariance(grad_fn: GradFn, loss_fn: Callable, steps: int, params: PyTree) -> GradFn:
    """``grad_fn``, which types the parameters varying (per-replica gradients), with
    each leaf of its ``out`` that varies only for that made invariant again.

    A value computed from the parameters alone (a weight norm in ``aux``) is the
    same on every replica; typed varying, `Replicator.run` would return it
    stacked. Each leaf that varies over replica axes its reference does not vary
    over is replaced by its ``pmax`` over them: the value itself, exactly. The
    reference is the abstract value ``loss_fn`` gives for ``params`` (as
    mirrored, before anything typed them varying) and the first of ``steps``
    microbatches.
    """

    def invariant(varied_params, batch):
        grads, out = grad_fn(varied_params, batch)
        first = jax.tree.map(lambda x: x[: x.shape[0] // steps], batch)
        with microbatching(steps):
            reference = jax.eval_shape(loss_fn, params, first)[1]
        return grads, jax.tree.map(_invariant_as, out, reference)

    return invariant


def _invariant_as(x: Any, reference: jax.ShapeDtypeStruct) -> Any:
    axes = get_replica_context().axis_name
    typed = compat.varying_manual_axes(reference)
    extra = tuple(a for a in varying_axes(x, axes) if a not in typed)
    if not extra or not hasattr(x, "dtype"):
        return x
    if x.dtype == jnp.bool_:
        return jax.lax.pmax(x.astype(jnp.int8), extra).astype(jnp.bool_)
    if jnp.issubdtype(x.dtype, jnp.number):
        return jax.lax.pmax(x, extra)
    return x  # (a PRNG key computed from parameters alone: left varying)


# ---------------------------------------------------------------- the update


def all_finite(tree: PyTree) -> jax.Array:
    """True when every element of every leaf is finite.

    >>> bool(all_finite({"a": jnp.ones(2), "b": jnp.array([1.0, jnp.inf])}))
    False
    """
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.bool_(True)


def agree_across_replicas(finite: jax.Array) -> jax.Array:
    """``finite`` the same on every replica: false on all if false on any.

    Gradients of mirrored parameters are all-reduced already, so it is; where a
    replica holds its own gradients (a slice of a sharded parameter's, DiLoCo's
    groups) one replica's overflow must skip the update everywhere, or the
    replicas would drift apart (and miss a sync).
    """
    ctx, group = get_replica_context(), group_axis()
    axes = varying_axes(finite, ctx.axis_name if ctx else (group,) if group else ())
    if not axes:
        return finite
    return jax.lax.psum((~finite).astype(jnp.int32), axes) == 0


def apply_if_finite(update: Update) -> GuardedUpdate:
    """``update`` run only when the gradients are finite (optax's ``apply_if_finite``
    for a whole update): else parameters and optimizer state stay as they were.

    Args:
      update: ``update(params, opt_state) -> (params, opt_state)``.

    Returns:
      ``guarded(grads, params, opt_state) -> ((params, opt_state), finite)``, with
      ``finite`` agreed across replicas (`agree_across_replicas`); ``grads`` are
      only checked, the ones ``update`` applies are its own.

    >>> guarded = apply_if_finite(lambda p, o: (p - 1.0, o + 1))
    >>> (params, opt_state), finite = guarded(jnp.float32(jnp.nan), jnp.float32(3.0), 0)
    >>> float(params), int(opt_state), bool(finite)
    (3.0, 0, False)
    """

    def guarded(grads, params, opt_state):
        finite = agree_across_replicas(all_finite(grads))
        if select_instead_of_branch():
            new = update(params, opt_state)
            return keep_if_not_finite(finite, new, (params, opt_state)), finite
        # One branch for the whole update: a per-leaf select would copy every
        # parameter and optimizer leaf each step (XLA:CPU, measured: 13% slower at 8
        # devices; docs/benchmarks.md, "LM step").
        return jax.lax.cond(finite, update, lambda p, o: (p, o), params, opt_state), finite

    return guarded


def select_instead_of_branch() -> bool:
    """Whether `apply_if_finite` selects per leaf rather than branching: on GPUs. XLA:GPU
    runs a conditional by reading its predicate back to the host, which waits for the
    step's gradients before it can launch the update, every step; the select stays
    on the device (measured on an H100, docs/benchmarks.md, "LM step on a GPU")."""
    return jax.default_backend() == "gpu"


def apply_always(update: Update) -> GuardedUpdate:
    """``update`` as `apply_if_finite` calls it, with no check: no conditional in the
    compiled step, and ``finite`` always true."""

    def unguarded(grads, params, opt_state):
        finite = jnp.bool_(True)
        return update(params, opt_state), finite

    return unguarded


def keep_if_not_finite(finite: jax.Array, new: PyTree, old: PyTree) -> PyTree:
    """``new`` where ``finite``, else ``old``, leaf by leaf: for small state (model
    statistics), where a select costs less than widening `apply_if_finite`'s branch."""
    return jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
