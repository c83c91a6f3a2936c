"""The train state: everything a step changes, as one pytree, and the two step verbs.

`TrainState.value_and_grad` differentiates a loss the way the run is configured
(microbatches, loss scale) and `TrainState.apply_gradients` applies the update
unless the gradients are not finite. Step functions written with them need no
change for gradient accumulation or fp16. Each method composes one-concern
pieces (`replicator.step.transforms`, and `replicator.parallel.zero` for sharded parameters);
what they keep between steps lives in this state's own fields.

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

from replicator.parallel import diloco as diloco
from replicator.parallel import zero as zero
from replicator.spmd.context import get_replica_context, remember_own_gradient
from replicator.step import offload as offload
from replicator.step import optim as optim
from replicator.step import transforms as transforms
from replicator.step.precision import LossScale, Policy, get_policy
from replicator.step.transforms import all_finite as all_finite  # where the benchmarks import it

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
      per_replica_grads: whether ``tx`` aggregates each replica's own gradients
        (``wrap_optimizer(aggregate=...)``; `create` sets it from ``tx``): then
        `apply_gradients` makes its sum ahead of the non-finite guard. (Under
        `Replicator.run`, `value_and_grad` keeps each replica's own gradients
        beside their sums either way: each parameter's is summed once.)
      frozen: per leaf of ``params`` (``jax.tree.leaves`` order), whether it is
        frozen, or None: `value_and_grad` differentiates the others only, so a
        frozen leaf costs no backward pass and its gradient is zero (in the
        gradient's norm and clipping it counts for nothing). ``tx`` must leave
        it too (``optax.set_to_zero`` on it): a zero gradient still meets weight
        decay and momentum.
    """

    step: jax.Array
    params: PyTree
    opt_state: PyTree
    rng: jax.Array
    model_state: PyTree = None
    loss_scale: LossScale | None = None
    skipped_steps: jax.Array = struct.field(default_factory=lambda: jnp.int32(0))
    grad_accum_steps: int = struct.field(pytree_node=False, default=1)
    per_replica_grads: bool = struct.field(pytree_node=False, default=False)
    frozen: tuple[bool, ...] | None = struct.field(pytree_node=False, default=None)

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
        frozen: PyTree = None,
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
          frozen: a tree of bools like ``params``: the parameters not to differentiate
            (the ``frozen`` attribute), or None.
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
            per_replica_grads=optim.needs_replica_gradients(tx),
            frozen=None if frozen is None else tuple(bool(f) for f in jax.tree.leaves(frozen)),
        )

    def value_and_grad(
        self,
        loss_fn: Callable[..., Any],
        batch: PyTree,
        *,
        has_aux: bool = False,
    ) -> tuple[Any, PyTree]:
        """``jax.value_and_grad(loss_fn)(self.params, batch)``, accumulated and scaled.

        The pieces (`replicator.step.transforms`, `replicator.parallel.zero`): the loss scaled
        and the gradients unscaled by ``loss_scale``; ``grad_accum_steps``
        microbatches, their losses, gradients and ``aux`` summed, their new model
        states averaged; under `Replicator.run`, each replica's own gradient kept
        beside the sum (made once per parameter, however often the loss uses it):
        sharded parameters' for the optimizer to reduce-scatter, every one for an
        aggregator (``per_replica_grads``). Pass them to `apply_gradients`.

        Args:
          loss_fn: ``loss_fn(params, batch) -> loss``, or ``(loss, aux)`` with
            ``has_aux`` (``aux`` leaves are sums); with a ``model_state``,
            ``loss_fn(params, model_state, batch) -> (loss, new_model_state)`` or
            ``(loss, (new_model_state, aux))``.
          batch: this replica's batch.
          has_aux: whether ``loss_fn`` returns ``aux``.

        Returns:
          ``(value, grads)``, ``value`` shaped as ``loss_fn``'s result (unscaled).
        """
        # Under `Replicator.run` every gradient is summed once, from this replica's own
        # (`zero.defer_gradient_sum`): a parameter used twice (a tied embedding) would
        # otherwise be all-reduced once per use by autodiff.
        k, scale, every = self.grad_accum_steps, self.loss_scale, True
        loss = transforms.scale_loss(_split_loss(loss_fn, self.model_state, has_aux), scale)
        trained, loss, with_frozen = _trained_only(self.params, self.frozen, loss)
        grad_fn = transforms.accumulate_gradients(jax.grad(loss, has_aux=True), k)
        if zero.defers_gradient_sum(trained, every) or (k > 1 and get_replica_context()):
            grad_fn = transforms.restore_invariance(grad_fn, loss, k, trained)
        grad_fn = zero.defer_gradient_sum(transforms.unscale_gradients(grad_fn, scale), every)
        grads, (value, new_state, aux) = grad_fn(trained, batch)
        grads = with_frozen(grads)
        if self.model_state is not None:
            return (value, (new_state, aux) if has_aux else new_state), grads
        return ((value, aux) if has_aux else value), grads

    def apply_gradients(
        self,
        grads: PyTree,
        tx: optax.GradientTransformation,
        *,
        model_state: PyTree = None,
        skip_nonfinite: bool = True,
    ) -> TrainState:
        """One optimizer update, skipped when any gradient is not finite.

        A skipped step (`transforms.apply_if_finite`, alike on every replica) keeps
        parameters, optimizer state and model state, counts in ``skipped_steps`` and
        halves the loss scale. Under `Replicator.run`, sharded parameters are
        updated as this device's slices (`zero.update_slices`). With an optimizer
        that aggregates each replica's own gradients (``per_replica_grads``), its
        sum is made first (`optim.sum_ahead`) and checked, as the sum is without one.

        Args:
          grads: the gradients, from `value_and_grad`.
          tx: the (wrapped) optimizer.
          model_state: the new model state from `value_and_grad`, if any.
          skip_nonfinite: False applies every update, finite or not: no check and
            no conditional in the compiled step. Not with a loss scale (fp16).
        """
        if not skip_nonfinite and self.loss_scale is not None:
            raise ValueError(
                "apply_gradients(skip_nonfinite=False) with a loss scale: fp16 loss scaling "
                "finds its scale by skipping the steps that overflow. Keep the default."
            )
        # Moments kept in host memory between steps come into HBM for the update only.
        self = self.replace(opt_state=offload.in_device_memory(self.opt_state))
        update = _optimizer_update(tx, grads, self.params)
        update = (transforms.apply_if_finite if skip_nonfinite else transforms.apply_always)(update)
        # An aggregator's sum, made outside the guard's conditional: checked, and sliced.
        summed = optim.sum_ahead(tx, grads) if self.per_replica_grads else grads
        (params, opt_state), finite = zero.update_slices(
            update, summed, self.params, self.opt_state
        )
        model_state = _kept_model_state(model_state, self.model_state, finite, skip_nonfinite)
        return self.replace(
            step=self.step + 1,
            params=params,
            opt_state=opt_state,
            model_state=model_state,
            loss_scale=self.loss_scale.update(finite) if self.loss_scale else None,
            skipped_steps=self.skipped_steps + (~finite).astype(jnp.int32),
        )


def _split_loss(loss_fn: Callable, model_state: PyTree, has_aux: bool) -> Callable:
    """``loss_fn`` as ``(params, batch) -> (loss, (loss, new_model_state, aux))``."""

    def split(params, batch):
        if model_state is not None:
            loss, rest = loss_fn(params, model_state, batch)
            new_state, aux = rest if has_aux else (rest, None)
        else:
            out = loss_fn(params, batch)
            (loss, aux), new_state = (out if has_aux else (out, None)), None
        return loss, (loss, new_state, aux)

    return split


def _trained_only(params: PyTree, frozen: tuple[bool, ...] | None, loss: Callable):
    """The trained leaves of ``params``, ``loss`` as a function of them (the frozen ones
    closed over: never differentiated, so XLA computes no backward pass for them),
    and ``with_frozen(grads)``: their gradients with zeros for the frozen ones."""
    if not frozen or not any(frozen):
        return params, loss, lambda grads: grads
    leaves, treedef = jax.tree.flatten(params)
    if len(leaves) != len(frozen):
        raise ValueError(f"TrainState.frozen has {len(frozen)} entries for {len(leaves)} leaves.")

    def merged(trained: list, fill: Callable) -> PyTree:
        rest = iter(trained)
        return treedef.unflatten([fill(x) if f else next(rest) for x, f in zip(leaves, frozen)])

    def trained_loss(trained, batch):
        return loss(merged(trained, lambda x: x), batch)

    trained = [x for x, f in zip(leaves, frozen) if not f]
    return trained, trained_loss, lambda grads: merged(grads, _zero_gradient)


def _zero_gradient(x: jax.Array) -> jax.Array:
    """A frozen parameter's gradient: zeros, this replica's own part of the sum too, so
    that an aggregating optimizer (`optim.own_gradients`) sends nothing for it."""
    zeros = jnp.zeros_like(x)
    remember_own_gradient(zeros, zeros)
    return zeros


def _kept_model_state(new: PyTree, old: PyTree, finite: jax.Array, checked: bool) -> PyTree:
    """The model state after an update: ``old`` if no ``new`` came, or the step was skipped."""
    if new is None:
        return old
    if old is None or not checked:
        return new
    return transforms.keep_if_not_finite(finite, new, old)


def _optimizer_update(tx: optax.GradientTransformation, grads: PyTree, params: PyTree):
    """``update(slices, opt_state) -> (slices, opt_state)``: ``tx``'s update of
    ``params`` (their slices under ZeRO) by ``grads``."""

    def update(slices, opt_state):
        updates, opt_state = tx.update(grads, opt_state, params)
        slices = zero.apply_updates(slices, updates, params)
        # Under DiLoCo, groups just synced hold the outer parameters bitwise.
        return diloco.settle(slices, opt_state), opt_state

    return update
