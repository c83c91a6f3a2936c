"""Mixed precision: policies, a policy applied to any Flax model, dynamic loss scaling.

A policy names three dtypes: parameters (and optimizer state) are *stored* in
``param_dtype``, the model *computes* in ``compute_dtype``, and its outputs
(logits, hence losses) come out in ``output_dtype``. `apply_policy` enforces it
on an unchanged Flax model by casting: parameters and floating inputs go into
the model in the compute dtype, outputs leave in the output dtype, and the
gradients flow back through the casts to the float32 parameters. A Linen model
gets a `PolicyModel` (its own ``init``/``apply``); an NNX module gets a
`PolicyModule`, itself an ``nnx.Module``, so it works with ``nnx.Optimizer``,
``nnx.split`` and `Replicator.run` like the module it wraps. Non-parameter
state (BatchNorm statistics, RNG counters) is never cast: statistics are
accumulated in float32 whatever the compute dtype.

fp16's narrow exponent range needs a loss scale: `LossScale` multiplies the
loss before differentiation, and the train state (through
`replicator.step.transforms`) unscales the gradients, skips the update when they are
not finite (one decision for all replicas, since the gradients are all-reduced
first), halves the scale then, and doubles it after ``growth_interval`` good
steps, up to ``max_scale``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx, struct

PyTree = Any


@dataclasses.dataclass(frozen=True)
class Policy:
    """A mixed-precision policy.

    Attributes:
      name: the preset's name (``"fp32"``, ``"bf16"``, ``"fp16"``).
      param_dtype: storage dtype of parameters and optimizer state.
      compute_dtype: dtype of activations and matmuls inside the model.
      output_dtype: dtype of logits and losses.
      loss_scaling: whether training needs a dynamic loss scale (fp16).
    """

    name: str
    param_dtype: jnp.dtype
    compute_dtype: jnp.dtype
    output_dtype: jnp.dtype
    loss_scaling: bool = False

    def cast_to_compute(self, tree: PyTree) -> PyTree:
        """Casts the floating leaves of ``tree`` to the compute dtype."""
        return _cast_floating(tree, self.compute_dtype)

    def cast_to_param(self, tree: PyTree) -> PyTree:
        """Casts the floating leaves of ``tree`` to the parameter dtype."""
        return _cast_floating(tree, self.param_dtype)

    def cast_to_output(self, tree: PyTree) -> PyTree:
        """Casts the floating leaves of ``tree`` to the output dtype."""
        return _cast_floating(tree, self.output_dtype)


_F32 = jnp.dtype("float32")
PRESETS = {
    "fp32": Policy("fp32", _F32, _F32, _F32),
    "bf16": Policy("bf16", _F32, jnp.dtype("bfloat16"), _F32),
    "fp16": Policy("fp16", _F32, jnp.dtype("float16"), _F32, loss_scaling=True),
}


def get_policy(precision: str | Policy | None) -> Policy:
    """Returns the policy for a preset name (``None`` means ``"fp32"``) or a `Policy`.

    >>> get_policy("bf16").compute_dtype
    dtype(bfloat16)
    """
    if isinstance(precision, Policy):
        return precision
    name = "fp32" if precision is None else precision
    if name not in PRESETS:
        raise ValueError(f"Unknown precision {precision!r}; choose one of {[None, *PRESETS]}.")
    return PRESETS[name]


def _cast_floating(tree: PyTree, dtype: jnp.dtype) -> PyTree:
    def cast(x):
        if isinstance(x, nnx.Pytree):  # an NNX object (Rngs, a module) passes through as is
            return x
        if isinstance(x, jax.Array | jax.ShapeDtypeStruct) or hasattr(x, "dtype"):
            if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != dtype:
                return jnp.asarray(x, dtype)
        return x

    # NNX objects are pytrees too: mapped over, they would come back as copies, and
    # what the model does to them (an Rngs counter) would be lost to the caller.
    return jax.tree.map(cast, tree, is_leaf=lambda x: isinstance(x, nnx.Pytree))


_watched: list[list[bool]] = []  # per step being traced: [policy applied, optimizer updated]
_warned: weakref.WeakSet = weakref.WeakSet()  # the steps already told
_warned_ids: set[int] = set()  # ... those that take no weak reference


def note_applied() -> None:
    """Records that a policy took effect in the steps being traced."""
    for frame in _watched:
        frame[0] = True


def note_training() -> None:
    """Records that the steps being traced update parameters (the wrapped optimizer)."""
    for frame in _watched:
        frame[1] = True


@contextlib.contextmanager
def expect_policy(policy: Policy, step: Callable) -> Iterator[None]:
    """Around the trace of ``step``: warns once if the step trains (its gradients
    reach a wrapped optimizer) under a Replicator's low-precision ``policy`` that
    never took effect in it (no `apply_policy` model ran, no loss scale was used):
    ``Replicator(precision=...)`` would change nothing. Steps that do not train
    (initialisation, evaluation, reductions) are not told."""
    frame = [False, False]
    _watched.append(frame)
    try:
        yield
    finally:
        _watched.remove(frame)
    applied, trains = frame
    step = inspect.unwrap(step)  # the user's function, under replicator's wrappers
    if policy.compute_dtype == jnp.float32 or applied or not trains or _told(step):
        return
    name = getattr(step, "__name__", "step")
    warnings.warn(
        f"The Replicator's precision is {policy.name!r}, but the step {name!r} trains "
        "without it: apply it to the model (repl.apply_policy(model)) and, for fp16's "
        "loss scale, create the state with rp.TrainState.create(..., "
        "policy=repl.precision). A step that sets its own dtypes needs no precision= "
        "on the Replicator.",
        stacklevel=3,
    )


def _told(step: Callable) -> bool:
    """Whether ``step`` was told already; records that it is now."""
    try:
        told = step in _warned
        _warned.add(step)
    except TypeError:  # e.g. a slotted callable object
        told = id(step) in _warned_ids
        _warned_ids.add(id(step))
    return told


class PolicyModel:
    """A Flax model under a precision policy, with the model's own ``init``/``apply``.

    ``init`` returns variables in the parameter dtype. ``apply`` runs the model
    on parameters and floating inputs cast to the compute dtype (Flax layers
    compute in the dtype of their inputs and parameters) and returns floating
    outputs in the output dtype. Other attributes are the wrapped model's.
    """

    def __init__(self, module: Any, policy: Policy):
        self.module = module
        self.policy = policy

    def init(self, rngs, *args, **kwargs) -> PyTree:
        return self.policy.cast_to_param(self.module.init(rngs, *args, **kwargs))

    def apply(self, variables: PyTree, *args, **kwargs) -> Any:
        policy = self.policy
        note_applied()
        out = self.module.apply(
            policy.cast_to_compute(variables), *policy.cast_to_compute(args), **kwargs
        )
        return policy.cast_to_output(out)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.module, name)


class PolicyModule(nnx.Module):
    """An NNX module under a precision policy: call it as you would the module.

    A call runs the wrapped module on a copy whose `nnx.Param` values are cast
    to the compute dtype, with floating inputs cast too, and casts floating
    outputs to the output dtype. Layers whose ``dtype`` is left at None (Flax's
    default) compute in the compute dtype; without that, ``nnx.BatchNorm``
    would promote its activations to the float32 of its statistics. Everything
    else in the module (BatchNorm statistics, RNG state) keeps its dtype, and
    what the call changes in it is written back into the wrapped module, as an
    NNX call does. Gradients with respect to the wrapped module's parameters
    flow back through the casts, in the parameters' dtype.

    Attributes:
      module: the wrapped module (its parameters stay in the parameter dtype).
      policy: the `Policy`.
    """

    def __init__(self, module: nnx.Module, policy: Policy):
        self.module = module
        self.policy = policy

    def __call__(self, *args, **kwargs) -> Any:
        policy = self.policy
        note_applied()
        graphdef, params, rest = nnx.split(self.module, nnx.Param, ...)
        compute = nnx.merge(graphdef, policy.cast_to_compute(params), rest, copy=True)
        for _, layer in nnx.iter_modules(compute):
            if hasattr(layer, "param_dtype") and getattr(layer, "dtype", False) is None:
                layer.dtype = policy.compute_dtype
        out = compute(*policy.cast_to_compute(args), **policy.cast_to_compute(kwargs))
        nnx.update(self.module, nnx.state(compute, nnx.Not(nnx.Param)))
        return policy.cast_to_output(out)


def apply_policy(module: Any, policy: Policy | str | None) -> Any:
    """Runs a Flax model under ``policy`` without changing its code.

    Args:
      module: a Flax linen module (anything with ``init`` and ``apply``) or an
        ``nnx.Module``.
      policy: a `Policy` or preset name.

    Returns:
      ``module`` itself for fp32, else a `PolicyModel` (linen) or `PolicyModule`
      (NNX) wrapping it.

    Example (an NNX layer with float32 parameters, computing in bfloat16):

    >>> from flax import nnx
    >>> layer = apply_policy(nnx.Linear(3, 2, rngs=nnx.Rngs(0)), "bf16")
    >>> layer.module.kernel.dtype, layer(jnp.ones((1, 3))).dtype
    (dtype('float32'), dtype('float32'))
    """
    policy = get_policy(policy)
    if policy.compute_dtype == policy.param_dtype == policy.output_dtype == _F32:
        return module
    if isinstance(module, nnx.Module):
        return PolicyModule(module, policy)
    return PolicyModel(module, policy)


@struct.dataclass
class LossScale:
    """Dynamic loss-scale state (part of the train state, so it is checkpointed).

    Attributes:
      scale: the current scale (float32).
      good_steps: finite steps since the scale last changed.
      growth_interval: finite steps after which the scale doubles.
      max_scale: the cap; the scale never grows beyond it.
      min_scale: the floor; halving stops there.
    """

    scale: jax.Array
    good_steps: jax.Array
    growth_interval: int = struct.field(pytree_node=False, default=2000)
    max_scale: float = struct.field(pytree_node=False, default=2.0**24)
    min_scale: float = struct.field(pytree_node=False, default=1.0)

    @classmethod
    def create(cls, initial: float = 2.0**15, **kwargs) -> LossScale:
        """A fresh loss scale starting at ``initial``."""
        return cls(scale=jnp.float32(initial), good_steps=jnp.int32(0), **kwargs)

    def scale_loss(self, loss: jax.Array) -> jax.Array:
        return loss * self.scale.astype(loss.dtype)

    def unscale(self, grads: PyTree) -> PyTree:
        return jax.tree.map(lambda g: (g / self.scale).astype(g.dtype), grads)

    def update(self, finite: jax.Array) -> LossScale:
        """Halves the scale after a non-finite step; doubles it after enough finite ones.

        >>> s = LossScale.create(8.0, growth_interval=2, max_scale=16.0)
        >>> [float((s := s.update(jnp.bool_(ok))).scale) for ok in (True, True, True, True, False)]
        [8.0, 16.0, 16.0, 16.0, 8.0]
        """
        grow = finite & (self.good_steps + 1 >= self.growth_interval)
        scale = jnp.where(
            finite,
            jnp.where(grow, jnp.minimum(self.scale * 2, self.max_scale), self.scale),
            jnp.maximum(self.scale / 2, self.min_scale),
        )
        good_steps = jnp.where(finite & ~grow, self.good_steps + 1, 0)
        return self.replace(scale=scale.astype(jnp.float32), good_steps=good_steps)
