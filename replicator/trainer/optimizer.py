"""The config's optimizer as a chain of optax transformations.

What a researcher sets, each one optax piece, composed in one place
(`make_optimizer`), in this order:

1. the alias named by ``optimizer`` (``optax.adam``, ``optax.sgd``, ...) with
   ``optimizer_args``, its learning rate the schedule (`make_schedule`:
   ``lr_schedule``, ``warmup_steps``, ``lr_end_fraction``);
2. decoupled weight decay (``weight_decay``), the alias's own where it has one
   (``adamw``, ``lion``, ``lamb``), else `decayed_weights`, scaled by the schedule
   either way; by default not on parameters with fewer than 2 dimensions;
3. ``freeze``: ``optax.multi_transform`` with ``optax.set_to_zero`` for the
   matching parameters, which then hold no optimizer state;
4. ``ema_decay``: `replicator.ema.track`, last, so it averages the new parameters.

The Replicator's wrapper goes around all of it (`Replicator.wrap_optimizer`): the
gradients are summed (``grad_reduce_dtype``), their global norm kept and clipped
(``grad_clip_norm``) before the chain sees them. Parameter paths are the keys
joined by ``/`` (``Dense_0/kernel``; an NNX state's ``conv1/kernel``); a regex
matches a path where `re.search` finds it.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from replicator import ema
from replicator.errors import ConfigError

PyTree = Any


@dataclasses.dataclass(frozen=True)
class OptimizerSpec:
    """The config's optimizer keys (see `replicator.trainer.config.SCHEMA`)."""

    name: str = "adam"
    learning_rate: float = 1e-3
    args: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    lr_end_fraction: float = 0.0
    num_train_steps: int = 1
    weight_decay: float = 0.0
    weight_decay_mask: str | None = None
    grad_clip_norm: float | None = None
    grad_reduce_dtype: str | None = None
    ema_decay: float | None = None
    freeze: str | None = None

    @classmethod
    def from_config(cls, config) -> OptimizerSpec:
        return cls(
            name=config.optimizer,
            learning_rate=float(config.learning_rate),
            args=dict(config.optimizer_args or {}),
            lr_schedule=config.lr_schedule,
            warmup_steps=config.warmup_steps,
            lr_end_fraction=float(config.lr_end_fraction),
            num_train_steps=config.num_train_steps,
            weight_decay=float(config.weight_decay),
            weight_decay_mask=config.weight_decay_mask,
            grad_clip_norm=config.grad_clip_norm,
            grad_reduce_dtype=config.grad_reduce_dtype,
            ema_decay=config.ema_decay,
            freeze=config.freeze,
        )

    def schedule(self, peak: float | None = None) -> optax.Schedule:
        """The learning rate by update count, peaking at ``peak`` (default: the config's)."""
        return make_schedule(
            self.lr_schedule,
            self.learning_rate if peak is None else peak,
            self.warmup_steps,
            self.num_train_steps,
            self.lr_end_fraction,
        )


def make_schedule(
    kind: str, peak: float, warmup_steps: int, total_steps: int, end_fraction: float = 0.0
) -> optax.Schedule:
    """The learning rate at each update count: linear from 0 to ``peak`` over
    ``warmup_steps``, then ``kind``: ``constant``; ``cosine`` or ``linear`` decay to
    ``end_fraction * peak`` at ``total_steps``; ``rsqrt``, ``peak * sqrt(w / count)``
    (the inverse square root of the count, equal to ``peak`` at the warmup's end ``w``).

    >>> s = make_schedule("cosine", 1.0, 10, 110, 0.1)
    >>> [round(float(s(n)), 4) for n in (0, 5, 10, 60, 110)]
    [0.0, 0.5, 1.0, 0.55, 0.1]
    >>> [round(float(make_schedule("rsqrt", 1.0, 4, 100)(n)), 4) for n in (2, 4, 16)]
    [0.5, 1.0, 0.5]
    """
    end = end_fraction * peak
    decay_steps = max(total_steps - warmup_steps, 1)
    after = {
        "constant": lambda: optax.constant_schedule(peak),
        "cosine": lambda: optax.cosine_decay_schedule(peak, decay_steps, alpha=end_fraction),
        "linear": lambda: optax.linear_schedule(peak, end, decay_steps),
        "rsqrt": lambda: _rsqrt(peak, warmup_steps),
    }
    if kind not in after:
        raise ConfigError(f"config.lr_schedule={kind!r} is not one of {list(after)}")
    if warmup_steps <= 0:
        return after[kind]()
    warmup = optax.linear_schedule(0.0, peak, warmup_steps)
    if kind == "rsqrt":  # not restarted at the boundary: it counts from the first update
        rest = _rsqrt(peak, warmup_steps)
        return lambda count: jnp.where(count < warmup_steps, warmup(count), rest(count))
    return optax.join_schedules([warmup, after[kind]()], [warmup_steps])


def _rsqrt(peak: float, warmup_steps: int) -> optax.Schedule:
    start = max(warmup_steps, 1)
    return lambda count: peak * jnp.sqrt(start / jnp.maximum(count, start).astype(jnp.float32))


def path_name(path: tuple) -> str:
    """A parameter's key path as ``a/b/c`` (an NNX variable's ``.value`` left out).

    >>> path_name((jax.tree_util.DictKey("Dense_0"), jax.tree_util.DictKey("kernel")))
    'Dense_0/kernel'
    """
    if path and getattr(path[-1], "name", None) == "value":
        path = path[:-1]
    return "/".join(_key(k) for k in path)


def _key(k: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def path_names(params: PyTree) -> list[str]:
    """Every parameter's `path_name`, in leaf order."""
    return [path_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]


def matching(regex: str | None, params: PyTree, default: Callable[[Any], bool]) -> PyTree:
    """A tree of bools over ``params``: where ``regex`` finds the path (``re.search``), or
    ``default(leaf)`` where ``regex`` is None."""
    pattern = None if regex is None else re.compile(regex)

    def pick(path, x):
        return default(x) if pattern is None else bool(pattern.search(path_name(path)))

    return jax.tree_util.tree_map_with_path(pick, params)


def _matrices(x: Any) -> bool:
    return np.ndim(x) >= 2


def decayed_weights(
    weight_decay: float, schedule: optax.Schedule, mask: Callable[[PyTree], PyTree]
) -> optax.GradientTransformation:
    """Decoupled weight decay for an alias without its own: ``updates -
    schedule(count) * weight_decay * params`` on the ``mask``ed parameters (after the
    alias, whose updates already carry the learning rate and sign)."""

    def init_fn(params):
        del params
        return optax.ScaleByScheduleState(count=jnp.zeros([], jnp.int32))

    def update_fn(updates, state, params=None):
        rate = schedule(state.count) * weight_decay
        chosen = mask(params)
        updates = jax.tree.map(
            lambda u, p, m: u - (rate * p).astype(u.dtype) if m else u, updates, params, chosen
        )
        return updates, optax.ScaleByScheduleState(count=optax.safe_int32_increment(state.count))

    return optax.GradientTransformation(init_fn, update_fn)


def make_optimizer(spec: OptimizerSpec, peak: float | None = None) -> optax.GradientTransformation:
    """The chain the config describes (the module docstring's order), unwrapped.

    Args:
      spec: the config's optimizer keys.
      peak: the peak learning rate (default: the config's), e.g. a GAN's second one.
    """
    schedule = spec.schedule(peak)
    alias = getattr(optax, spec.name, None)
    if not callable(alias):
        raise ConfigError(f"config.optimizer={spec.name!r} is not an optax optimizer (e.g. 'adam')")
    mask = lambda params: matching(spec.weight_decay_mask, params, _matrices)
    args = dict(spec.args)
    own_decay = {"weight_decay", "mask"} <= set(inspect.signature(alias).parameters)
    if own_decay:
        args.update(weight_decay=spec.weight_decay, mask=mask)
    try:
        tx = alias(learning_rate=schedule, **args)
    except TypeError as e:  # an optax function that is no alias, or a wrong value type
        raise ConfigError(
            f"optax.{spec.name}(learning_rate=..., **config.optimizer_args) cannot be built "
            f"({e}); config.optimizer names an optax alias, e.g. 'adamw'"
        ) from None
    if spec.weight_decay and not own_decay:
        tx = optax.chain(tx, decayed_weights(spec.weight_decay, schedule, mask))
    if spec.freeze is not None:
        labels = lambda params: jax.tree.map(
            lambda frozen: "frozen" if frozen else "trained",
            matching(spec.freeze, params, lambda _: False),
        )
        tx = optax.multi_transform({"trained": tx, "frozen": optax.set_to_zero()}, labels)
    if spec.ema_decay is not None:
        tx = optax.chain(tx, ema.track(spec.ema_decay))
    return tx


def describe(spec: OptimizerSpec, params: PyTree) -> str:
    """One line for the log: the optimizer, schedule and what is frozen and decayed.

    >>> import jax.numpy as jnp
    >>> params = {"dense": {"kernel": jnp.zeros((3, 4)), "bias": jnp.zeros(4)}}
    >>> describe(OptimizerSpec(freeze="bias"), params)
    'parameters 16 (2 arrays): 12 trained, 4 frozen; adam, constant learning rate 0.001'
    """
    sizes = [int(np.prod(np.shape(x))) for x in jax.tree.leaves(params)]
    frozen = jax.tree.leaves(matching(spec.freeze, params, lambda _: False))
    decayed = jax.tree.leaves(matching(spec.weight_decay_mask, params, _matrices))
    n_frozen = sum(s for s, f in zip(sizes, frozen) if f)
    n_decayed = sum(s for s, d, f in zip(sizes, decayed, frozen) if d and not f)
    line = f"parameters {sum(sizes):,} ({len(sizes)} arrays): {sum(sizes) - n_frozen:,} trained"
    if spec.freeze is not None:
        line += f", {n_frozen:,} frozen"
    if spec.weight_decay:
        line += f", {n_decayed:,} decayed"
    line += f"; {spec.name}"
    if spec.args:
        line += "(" + ", ".join(f"{k}={v!r}" for k, v in spec.args.items()) + ")"
    line += f", {spec.lr_schedule} learning rate {spec.learning_rate:g}"
    if spec.warmup_steps:
        line += f" after {spec.warmup_steps} warmup steps"
    if spec.lr_schedule in ("cosine", "linear"):
        line += f" to {spec.lr_end_fraction:g}x"
    extras = [
        f"{name} {value:g}"
        for name, value in (
            ("weight decay", spec.weight_decay or None),
            ("clip norm", spec.grad_clip_norm),
            ("EMA decay", spec.ema_decay),
        )
        if value is not None
    ]
    return line + ("; " + ", ".join(extras) if extras else "")
