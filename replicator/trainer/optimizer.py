"""The config's optimizer as a chain of optax transformations.

What a researcher sets, each one optax piece, composed in one place
(`make_optimizer`), in this order:

1. the alias named by ``optimizer`` (``optax.adam``, ``optax.sgd``, ...) with
   ``optimizer_args``, its learning rate the schedule (`make_schedule`:
   ``lr_schedule``, ``warmup_steps``, ``lr_end_fraction``) peaking at
   ``learning_rate``, scaled by the batch size where ``lr_batch_scaling`` says
   (`OptimizerSpec.batch_factor`);
2. decoupled weight decay (``weight_decay``), the alias's own where it has one
   (``adamw``, ``lion``, ``lamb``), else `decayed_weights`, scaled by the schedule
   either way; by default on weights with 2 or more dimensions per layer, never
   on a bias (`decays_by_default`: a scanned block's stacked ``layers`` axis is not
   counted; a bias split by heads, ``qkv_bias``, is no weight);
3. ``lr_mults``: `multiply_updates`, each parameter's update (decay included)
   times the factor of the first ``(regex, factor)`` pair that finds its path,
   which is its learning rate times that factor at every step of the schedule;
4. ``freeze``: ``optax.multi_transform`` with ``optax.set_to_zero`` for the
   matching parameters, which then hold no optimizer state;
5. ``ema_decay``: `replicator.step.ema.track`, last, so it averages the new parameters.

The Replicator's wrapper goes around all of it (`Replicator.wrap_optimizer`): the
gradients are summed (``grad_reduce_dtype``), their global norm kept and clipped
(``grad_clip_norm``) before the chain sees them. Frozen parameters take no part
in that norm: `mark_frozen` tells each `rp.TrainState` of the run which they are,
and its ``value_and_grad`` differentiates the others only (no backward pass for
the frozen ones, whose gradient is zero), as big_vision's
``optax.masked(clip_by_global_norm(c), not_frozen)`` clips. Parameter paths are
the keys joined by ``/`` (``Dense_0/kernel``; an NNX state's ``conv1/kernel``); a
regex matches a path where `re.search` finds it.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from replicator.errors import ConfigError
from replicator.parallel.sharding_rules import is_box, layer_shape
from replicator.step import ema as ema
from replicator.step.state import TrainState

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
    lr_mults: tuple[tuple[str, float], ...] = ()
    batch_size: int | None = None
    lr_base_batch_size: int | None = None
    lr_batch_scaling: str | None = None
    frozen_by: str | None = None  # what ``freeze`` is, for people (None: config.freeze)

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
            lr_mults=tuple((str(r), float(f)) for r, f in config.lr_mults or ()),
            batch_size=config.batch_size,
            lr_base_batch_size=config.lr_base_batch_size,
            lr_batch_scaling=config.lr_batch_scaling,
        )

    def also_freezing(self, regex: str, reason: str) -> OptimizerSpec:
        """This spec freezing the parameters ``regex`` finds too (an experiment's own, the
        LM's base weights under LoRA), ``reason`` naming them in the trainer's lines.

        >>> spec = OptimizerSpec(freeze="embed").also_freezing("^(?!.*lora)", "LoRA's base")
        >>> spec.freeze, spec.frozen_by
        ('(?:embed)|(?:^(?!.*lora))', "config.freeze='embed' and LoRA's base")
        """
        if self.freeze is None:
            return dataclasses.replace(self, freeze=regex, frozen_by=reason)
        return dataclasses.replace(
            self, freeze=f"(?:{self.freeze})|(?:{regex})", frozen_by=f"{self.freezing} and {reason}"
        )

    @property
    def freezing(self) -> str | None:
        """What ``freeze`` freezes, for people: ``config.freeze='...'`` or the experiment's
        reason (None: nothing)."""
        if self.freeze is None:
            return None
        return self.frozen_by or f"config.freeze={self.freeze!r}"

    @property
    def batch_factor(self) -> float:
        """What the learning rate is multiplied by for ``batch_size``: ``batch_size /
        lr_base_batch_size`` (``linear``), its square root (``sqrt``), or 1.

        >>> spec = OptimizerSpec(batch_size=1024, lr_base_batch_size=256, lr_batch_scaling="sqrt")
        >>> spec.batch_factor
        2.0
        """
        if self.lr_batch_scaling is None:
            return 1.0
        if self.lr_batch_scaling not in ("linear", "sqrt") or not (
            self.lr_base_batch_size and self.batch_size
        ):
            raise ConfigError(
                f"config.lr_batch_scaling={self.lr_batch_scaling!r} needs 'linear' or 'sqrt', "
                f"a batch_size and a lr_base_batch_size (got {self.batch_size!r} and "
                f"{self.lr_base_batch_size!r})"
            )
        ratio = self.batch_size / self.lr_base_batch_size
        return ratio if self.lr_batch_scaling == "linear" else math.sqrt(ratio)

    def schedule(self, peak: float | None = None) -> optax.Schedule:
        """The learning rate by update count, peaking at ``peak`` (default: the config's)
        times `batch_factor`."""
        return make_schedule(
            self.lr_schedule,
            (self.learning_rate if peak is None else peak) * self.batch_factor,
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


def matching(
    regex: str | None, params: PyTree, default: Callable[[str, Any], bool] = lambda *_: False
) -> PyTree:
    """A tree of bools over ``params``: where ``regex`` finds the path (``re.search``), or
    ``default(path, leaf)`` where ``regex`` is None. A Flax box (``nn.LogicallyPartitioned``)
    is one leaf for ``default``, which sees its axis names, and keeps its place in the
    tree, holding the bool."""
    pattern = None if regex is None else re.compile(regex)

    def pick(path, x):
        name = path_name(path)
        chosen = default(name, x) if pattern is None else bool(pattern.search(name))
        return x.replace_boxed(chosen) if is_box(x) else chosen

    return jax.tree_util.tree_map_with_path(pick, params, is_leaf=is_box)


def is_matrix(x: Any) -> bool:
    """The default ``weight_decay_mask``: 2 or more dimensions per layer (`layer_shape`: a
    scanned block's stacked ``layers`` axis not counted, so its LayerNorm scales and
    biases are vectors, as they are unscanned).

    >>> import flax.linen as nn
    >>> is_matrix(jnp.zeros((20, 8))), is_matrix(nn.LogicallyPartitioned(jnp.zeros((20, 8)),
    ...                                                                ("layers", "embed")))
    (True, False)
    """
    return len(layer_shape(x)) >= 2


def decays_by_default(path: str, x: Any) -> bool:
    """The default ``weight_decay_mask``: weights of 2 or more dimensions per layer
    (`is_matrix`), not biases (a parameter whose own name has ``bias``: a bias split by
    heads has 2 or 3 dimensions), as Hugging Face's Trainer and nanoGPT decay.

    >>> decays_by_default("attention/qkv_kernel", jnp.zeros((8, 3, 2, 4)))
    True
    >>> decays_by_default("attention/qkv_bias", jnp.zeros((3, 2, 4)))
    False
    """
    return is_matrix(x) and "bias" not in path.rsplit("/", 1)[-1]


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


def first_match(pairs: Sequence[tuple[str, Any]], name: str) -> int | None:
    """The index of the first ``(regex, value)`` pair whose regex finds ``name``, or None.

    >>> first_match([("head", 10.0), ("/kernel$", 0.1)], "head/kernel")
    0
    """
    return next((i for i, (regex, _) in enumerate(pairs) if re.search(regex, name)), None)


def multiply_updates(lr_mults: Sequence[tuple[str, float]]) -> optax.GradientTransformation:
    """Each parameter's update times the factor of the first ``(regex, factor)`` pair
    whose regex finds its path (`first_match`; 1 where none does): after the alias
    and the decay, this is the parameter's learning rate times the factor.

    >>> tx = multiply_updates([("backbone", 0.5)])
    >>> tx.update({"backbone": jnp.ones(2), "head": jnp.ones(2)}, tx.init(None))[0]["backbone"]
    Array([0.5, 0.5], dtype=float32)
    """
    pairs = tuple(lr_mults)

    def factor(path, _) -> float:
        found = first_match(pairs, path_name(path))
        return 1.0 if found is None else pairs[found][1]

    def update_fn(updates, state, params=None):
        del params
        factors = jax.tree_util.tree_map_with_path(factor, updates)
        scaled = jax.tree.map(
            lambda u, f: u if f == 1.0 else u * jnp.asarray(f, u.dtype), updates, factors
        )
        return scaled, state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)


def mark_frozen(state: PyTree, regex: str | None) -> PyTree:
    """``state`` with each `rp.TrainState` in it told which of its parameters ``regex``
    freezes (`TrainState.frozen`): its ``value_and_grad`` then differentiates the
    others only, so the frozen ones cost no backward pass and add nothing to the
    gradient's norm or its clipping."""
    if regex is None:
        return state
    is_state = lambda x: isinstance(x, TrainState)

    def mark(x):
        if not is_state(x):
            return x
        frozen = jax.tree.leaves(matching(regex, x.params))
        return x.replace(frozen=tuple(frozen) if any(frozen) else None)

    return jax.tree.map(mark, state, is_leaf=is_state)


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
    mask = lambda params: matching(spec.weight_decay_mask, params, decays_by_default)
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
    if spec.lr_mults:
        tx = optax.chain(tx, multiply_updates(spec.lr_mults))
    if spec.freeze is not None:
        labels = lambda params: jax.tree.map(
            lambda frozen: "frozen" if frozen else "trained",
            matching(spec.freeze, params),
        )
        tx = optax.multi_transform({"trained": tx, "frozen": optax.set_to_zero()}, labels)
    if spec.ema_decay is not None:
        tx = optax.chain(tx, ema.track(spec.ema_decay))
    return tx


def describe(spec: OptimizerSpec, params: PyTree) -> str:
    """One line for the log: the optimizer, schedule (its effective peak rate) and what
    is frozen and decayed; with ``lr_mults``, a second line: what each pair takes.

    >>> import jax.numpy as jnp
    >>> params = {"dense": {"kernel": jnp.zeros((3, 4)), "bias": jnp.zeros(4)}}
    >>> describe(OptimizerSpec(freeze="bias"), params)
    'parameters 16 (2 arrays): 12 trained, 4 frozen; adam, constant learning rate 0.001'
    """
    sizes = [int(np.prod(np.shape(x))) for x in jax.tree.leaves(params)]
    frozen = jax.tree.leaves(matching(spec.freeze, params))
    decayed = jax.tree.leaves(matching(spec.weight_decay_mask, params, decays_by_default))
    n_frozen = sum(s for s, f in zip(sizes, frozen) if f)
    n_decayed = sum(s for s, d, f in zip(sizes, decayed, frozen) if d and not f)
    line = f"parameters {sum(sizes):,} ({len(sizes)} arrays): {sum(sizes) - n_frozen:,} trained"
    if spec.freeze is not None:
        line += f", {n_frozen:,} frozen" + (f" ({spec.frozen_by})" if spec.frozen_by else "")
    if spec.weight_decay:
        line += f", {n_decayed:,} decayed"
    line += f"; {spec.name}"
    if spec.args:
        line += "(" + ", ".join(f"{k}={v!r}" for k, v in spec.args.items()) + ")"
    line += f", {spec.lr_schedule} learning rate {spec.learning_rate * spec.batch_factor:g}"
    if spec.lr_batch_scaling is not None:
        line += (
            f" ({spec.learning_rate:g} x {spec.batch_factor:.4g}, {spec.lr_batch_scaling} in "
            f"batch_size {spec.batch_size} / lr_base_batch_size {spec.lr_base_batch_size})"
        )
    if spec.warmup_steps:
        line += f" after {spec.warmup_steps} warmup steps"
    if spec.lr_schedule in ("cosine", "linear"):  # decays to lr_end_fraction of its peak
        end = spec.lr_end_fraction
        line += " decaying to 0" if not end else f" decaying to {end:g} of it"
    extras = [
        f"{name} {value:g}"
        for name, value in (
            ("weight decay", spec.weight_decay or None),
            ("clip norm", spec.grad_clip_norm),
            ("EMA decay", spec.ema_decay),
        )
        if value is not None
    ]
    line += "; " + ", ".join(extras) if extras else ""
    return line + ("\n" + describe_lr_mults(spec.lr_mults, params) if spec.lr_mults else "")


def describe_lr_mults(lr_mults: Sequence[tuple[str, float]], params: PyTree) -> str:
    """What each ``lr_mults`` pair takes (first match wins), for the log.

    >>> params = {"backbone": {"kernel": jnp.zeros((3, 4))}, "head": {"kernel": jnp.zeros(4)}}
    >>> describe_lr_mults([("backbone/", 0.1)], params)
    "lr_mults: 'backbone/' x0.1 on 12 parameters (1 arrays); the other 4 (1 arrays) x1"
    """
    pairs = tuple(lr_mults)
    counts = [[0, 0] for _ in range(len(pairs) + 1)]  # [parameters, arrays]; last: the rest
    for name, x in zip(path_names(params), jax.tree.leaves(params)):
        found = first_match(pairs, name)
        count = counts[len(pairs) if found is None else found]
        count[0] += int(np.prod(np.shape(x)))
        count[1] += 1
    taken = [
        f"{regex!r} x{factor:g} on {n:,} parameters ({k} arrays)"
        for (regex, factor), (n, k) in zip(pairs, counts)
    ]
    (n, k) = counts[-1]
    return f"lr_mults: {', '.join(taken)}; the other {n:,} ({k} arrays) x1"
