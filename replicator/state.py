"""The train state: everything a step changes, as one pytree, and the two step verbs.

`TrainState.value_and_grad` differentiates a loss the way the run is configured
(microbatches, loss scale) and `TrainState.apply_gradients` applies the update
unless the gradients are not finite. Step functions written with them need no
change for gradient accumulation or fp16.

Non-trainable model state (BatchNorm's ``batch_stats``, counters) lives in
``model_state``: the loss function receives it and returns its new value, which
is averaged over microbatches and kept when an update is skipped.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import struct

from replicator import diloco, precision, zero
from replicator.context import (
    get_replica_context,
    island_axis,
    microbatching,
    vary,
    varying_axes,
)
from replicator.precision import LossScale, Policy, get_policy

PyTree = Any


@struct.dataclass
class TrainState:
    """Parameters, optimizer state, model state, counters and RNG key of a run.

    Attributes:
      step: how many steps have run (an int32 array), skipped ones included.
      params: the model parameters (stored in the policy's param dtype).
      opt_state: the optimizer's state.
      rng: a `jax.random.key`; fold in ``step`` for per-step randomness.
      model_state: non-trainable model state, e.g. Flax's ``{"batch_stats": ...}``,
        or None. Checkpointed with the rest.
      loss_scale: the dynamic loss scale (fp16), or None.
      skipped_steps: how many updates were skipped for non-finite gradients.
      grad_accum_steps: microbatches each replica's batch is split into.
    """

    step: jax.Array
    params: PyTree
    opt_state: PyTree
    rng: jax.Array
    model_state: PyTree = None
    loss_scale: LossScale | None = None
    skipped_steps: jax.Array = struct.field(default_factory=lambda: jnp.int32(0))
    grad_accum_steps: int = struct.field(pytree_node=False, default=1)

    @classmethod
    def create(
        cls,
        params: PyTree,
        tx: optax.GradientTransformation,
        rng: jax.Array,
        *,
        model_state: PyTree = None,
        policy: Policy | str | None = None,
        loss_scale: LossScale | None = None,
        grad_accum_steps: int = 1,
    ) -> TrainState:
        """A fresh state at step 0.

        Args:
          params: the initial parameters.
          tx: the (wrapped) optimizer; its state is initialised here.
          rng: a PRNG key for the run.
          model_state: non-trainable model state, e.g. ``{"batch_stats": ...}``.
          policy: a precision policy (e.g. ``repl.precision``): parameters are
            stored in its ``param_dtype``, and a policy that needs loss scaling
            (fp16) gets a dynamic `LossScale` unless ``loss_scale`` is given.
          loss_scale: an explicit loss scale.
          grad_accum_steps: microbatches per replica batch (see `value_and_grad`).
        """
        if policy is not None:
            policy = get_policy(policy)
            params = policy.cast_to_param(params)
            if policy.loss_scaling and loss_scale is None:
                loss_scale = LossScale.create()
        return cls(
            step=jnp.int32(0),
            params=params,
            opt_state=tx.init(params),
            rng=rng,
            model_state=model_state,
            loss_scale=loss_scale,
            grad_accum_steps=grad_accum_steps,
        )

    def value_and_grad(
        self,
        loss_fn: Callable[..., Any],
        batch: PyTree,
        *,
        has_aux: bool = False,
    ) -> tuple[Any, PyTree]:
        """``jax.value_and_grad(loss_fn)(self.params, batch)``, accumulated and scaled.

        With ``grad_accum_steps = k`` each replica's batch is split into k
        microbatches on its leading axis, differentiated one at a time in a
        compiled loop (peak activation memory: one microbatch), and the losses,
        gradients and ``aux`` are summed. `compute_average_loss` divides every
        microbatch by the full global batch, so the sum is exactly the big-batch
        loss and gradient (not a mean of microbatch means). Inside `Replicator.run`
        the gradients are summed across replicas once, after the loop.

        With a ``model_state``, ``loss_fn(params, model_state, batch)`` returns
        ``(loss, new_model_state)`` (or ``(loss, (new_model_state, aux))`` with
        ``has_aux``); every microbatch starts from the same ``model_state`` and
        the new states' floating leaves (statistics) are averaged over the
        microbatches, never summed; other leaves (counters, keys) keep the last
        microbatch's. Pass the result to `apply_gradients`.

        With a loss scale, the loss is scaled before differentiation and the
        gradients unscaled after; the loss returned is unscaled.

        Args:
          loss_fn: ``loss_fn(params, batch) -> loss`` or ``(loss, aux)`` with
            ``has_aux``; with a model state, as above. ``aux`` leaves must be
            sums (they are added up).
          batch: this replica's batch.
          has_aux: whether ``loss_fn`` returns ``aux``.

        Returns:
          ``(value, grads)``, where ``value`` has the structure of ``loss_fn``'s
          result: ``loss``, ``(loss, aux)``, ``(loss, new_model_state)`` or
          ``(loss, (new_model_state, aux))``.
        """
        scale = self.loss_scale
        with_state = self.model_state is not None

        if scale is not None:
            precision.note_applied()

        def scaled_loss(params, microbatch):
            if with_state:
                loss, rest = loss_fn(params, self.model_state, microbatch)
                new_state, aux = rest if has_aux else (rest, None)
            else:
                out = loss_fn(params, microbatch)
                (loss, aux), new_state = (out if has_aux else (out, None)), None
            return (scale.scale_loss(loss) if scale else loss), (loss, new_state, aux)

        grad_fn = jax.grad(scaled_loss, has_aux=True)
        k = self.grad_accum_steps
        # Sharded parameters under run (ZeRO): their gradients stay per replica, to be
        # reduce-scattered by the wrapped optimizer rather than all-reduced whole.
        params, unsummed = zero.unsummed(self.params)
        if k == 1:
            grads, out = grad_fn(params, batch)
        else:
            grads, out = _accumulate(grad_fn, params, batch, k)
        if unsummed or (k > 1 and get_replica_context()):
            # Varying parameters make a value computed from them alone vary too.
            first = jax.tree.map(lambda x: x[: x.shape[0] // k], batch)
            with microbatching(k):
                reference = jax.eval_shape(scaled_loss, self.params, first)[1]
            out = _as_invariant_as(out, reference)
        loss, new_state, aux = out
        if scale:
            grads = scale.unscale(grads)
        grads = zero.summed(grads, unsummed)
        if with_state:
            value = (loss, (new_state, aux) if has_aux else new_state)
        else:
            value = (loss, aux) if has_aux else loss
        return value, grads

    def apply_gradients(
        self,
        grads: PyTree,
        tx: optax.GradientTransformation,
        *,
        model_state: PyTree = None,
        skip_nonfinite: bool = True,
    ) -> TrainState:
        """One optimizer update, skipped when any gradient is not finite.

        A skipped step leaves parameters, optimizer state and model state exactly
        as they were, counts in ``skipped_steps`` and halves the loss scale; the
        decision is the same on every replica because the gradients are
        summed across replicas first (and the decision agreed where each
        replica holds a slice of them: sharded parameters under `run`).

        Args:
          grads: the gradients, from `value_and_grad`.
          tx: the (wrapped) optimizer.
          model_state: the new model state from `value_and_grad`, if any.
          skip_nonfinite: False applies every update, finite or not: the
            compiled step has no conditional over the state (and no check of
            the gradients), and a non-finite gradient reaches the parameters.
            Not with a loss scale (fp16), which needs the skip.
        """

        def update(params, opt_state):
            updates, opt_state = tx.update(grads, opt_state, self.params)
            params = zero.apply_updates(params, updates, self.params)
            # Under DiLoCo, islands just synced hold the outer parameters bitwise.
            return diloco.settle(params, opt_state), opt_state

        if not skip_nonfinite and self.loss_scale is not None:
            raise ValueError(
                "apply_gradients(skip_nonfinite=False) with a loss scale: fp16 loss scaling "
                "finds its scale by skipping the steps that overflow. Keep the default."
            )
        # Sharded parameters under run (ZeRO) are updated as this device's slices, with
        # its slices of the gradients (see `replicator.zero`); else all of this is whole.
        with zero.scattered(grads, self.params) as pieces:
            operands = zero.param_slices(self.params), self.opt_state
            if skip_nonfinite:
                finite = _agreed(all_finite(pieces))
                # One branch for the whole update: a per-leaf select would copy every
                # parameter and optimizer leaf each step (measured: 13% slower at 8 devices).
                params, opt_state = jax.lax.cond(finite, update, lambda p, o: (p, o), *operands)
            else:
                finite, (params, opt_state) = jnp.bool_(True), update(*operands)
        params = zero.param_wholes(params, self.params)
        if model_state is None:
            model_state = self.model_state
        elif self.model_state is not None and skip_nonfinite:
            # Statistics are small: a select costs less than widening the branch.
            model_state = jax.tree.map(
                lambda new, old: jnp.where(finite, new, old), model_state, self.model_state
            )
        return self.replace(
            step=self.step + 1,
            params=params,
            opt_state=opt_state,
            model_state=model_state,
            loss_scale=self.loss_scale.update(finite) if self.loss_scale else None,
            skipped_steps=self.skipped_steps + (~finite).astype(jnp.int32),
        )


def _agreed(finite: jax.Array) -> jax.Array:
    """``finite`` the same on every replica. Gradients of mirrored parameters are
    already all-reduced, so it is; per-replica parameters (DiLoCo's islands) give
    each replica its own gradients, and one replica's overflow must skip the
    update everywhere, or the replicas would drift apart and miss a sync."""
    ctx, island = get_replica_context(), island_axis()
    axes = varying_axes(finite, ctx.axis_name if ctx else (island,) if island else ())
    if not axes:
        return finite
    return jax.lax.psum((~finite).astype(jnp.int32), axes) == 0


def _as_invariant_as(tree: PyTree, reference: PyTree) -> PyTree:
    """``tree`` with each leaf that varies over replica axes its ``reference`` (the
    abstract value it would have had) does not vary over made invariant again: it
    is the same on those replicas (computed from parameters alone), so their
    ``pmax`` is the value itself, exactly."""
    axes = get_replica_context().axis_name

    def fix(x, ref):
        extra = tuple(a for a in varying_axes(x, axes) if a not in ref.manual_axis_type.varying)
        if not extra or not hasattr(x, "dtype"):
            return x
        if x.dtype == jnp.bool_:
            return jax.lax.pmax(x.astype(jnp.int8), extra).astype(jnp.bool_)
        if jnp.issubdtype(x.dtype, jnp.number):
            return jax.lax.pmax(x, extra)
        return x  # (a PRNG key computed from parameters alone: left varying)

    return jax.tree.map(fix, tree, reference)


def all_finite(tree: PyTree) -> jax.Array:
    """True when every element of every leaf is finite."""
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.bool_(True)


def _accumulate(grad_fn, params, batch, k):
    sizes = {x.shape[0] for x in jax.tree.leaves(batch)}
    (size,) = sizes
    if size % k:
        raise ValueError(
            f"grad_accum_steps={k} does not divide the per-replica batch of {size}; use a "
            f"batch size that is a multiple of {k} x the number of replicas."
        )
    micro = jax.tree.map(lambda x: x.reshape(k, size // k, *x.shape[1:]), batch)
    ctx = get_replica_context()
    if ctx is not None:
        # Per-replica gradients: sum locally over the microbatches and all-reduce once,
        # instead of once per microbatch; over the axes autodiff would have summed
        # over (those the parameter is the same along: all of them, but along
        # DiLoCo's islands).
        leaves, treedef = jax.tree.flatten(params)
        summed = [
            tuple(a for a in ctx.axis_name if a not in varying_axes(p, ctx.axis_name))
            for p in leaves
        ]
        params = jax.tree.unflatten(treedef, [vary(p, ctx.axis_name) for p in leaves])
    with microbatching(k):
        first = grad_fn(params, jax.tree.map(lambda x: x[0], micro))

        def add(total, microbatch):
            grads, (loss, state, aux) = grad_fn(params, microbatch)
            total_grads, (total_loss, total_state, total_aux) = total
            # Every microbatch starts from the same model state: floating statistics
            # are summed here and averaged below; counters and keys keep the last.
            state = jax.tree.map(
                lambda t, x: t + x if jnp.issubdtype(x.dtype, jnp.floating) else x,
                total_state,
                state,
            )
            add = lambda a, b: jax.tree.map(jnp.add, a, b)
            return (add(total_grads, grads), (total_loss + loss, state, add(total_aux, aux))), None

        total, _ = jax.lax.scan(add, first, jax.tree.map(lambda x: x[1:], micro))
    grads, (loss, new_state, aux) = total
    new_state = jax.tree.map(
        lambda x: (x / k).astype(x.dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x,
        new_state,
    )
    if ctx is not None:
        grads = jax.tree.unflatten(
            treedef,
            [jax.lax.psum(g, axes) if axes else g
             for g, axes in zip(treedef.flatten_up_to(grads), summed)],
        )  # fmt: skip
    return grads, (loss, new_state, aux)
