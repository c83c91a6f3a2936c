"""The replica context: what a step function can ask while `Replicator.run` traces it.

Like tf.distribute's ``get_replica_context()``: inside ``repl.run`` it says which
replica this is, how many take part and the mesh axes they span (the name to pass
to ``lax.psum`` or ``nn.BatchNorm(axis_name=...)``); outside ``run``, and under
``repl.compile`` (the global view, one replica holding the whole batch), it is
None. It is set only while tracing, so it costs nothing at run time.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import warnings
from collections.abc import Iterator, Sequence

import jax

from replicator.errors import AxisNameError as AxisNameError
from replicator.runtime import compat


@dataclasses.dataclass(frozen=True)
class ReplicaContext:
    """Where a per-replica function runs.

    Attributes:
      num_replicas: how many replicas run the function.
      axis_name: the mesh axes the replicas span, a tuple such as ``("data",)``
        or ``("data", "fsdp")``: pass it to ``jax.lax.psum``, ``pmean``,
        ``all_gather``, ``axis_index`` and ``nn.BatchNorm(axis_name=...)``.
    """

    num_replicas: int
    axis_name: tuple[str, ...]

    @property
    def replica_id(self) -> jax.Array:
        """This replica's index in ``[0, num_replicas)``, a traced int32 scalar."""
        return jax.lax.axis_index(self.axis_name)


_CURRENT: contextvars.ContextVar[ReplicaContext | None] = contextvars.ContextVar(
    "replica_context", default=None
)


def get_replica_context() -> ReplicaContext | None:
    """The replica context while `Replicator.run` traces a function, else None.

    None also under `Replicator.compile`: there the step sees the global batch.

    >>> get_replica_context() is None
    True
    """
    return _CURRENT.get()


@contextlib.contextmanager
def replica_context(ctx: ReplicaContext, step_name: str = "step") -> Iterator[ReplicaContext]:
    """While `Replicator.run` traces a function: `get_replica_context` returns ``ctx``."""
    with _binding(_CURRENT, ctx), _binding(_TRACE, _StepTrace(step_name)):
        yield ctx


@dataclasses.dataclass
class _StepTrace:
    """What one trace of a per-replica step has done so far."""

    name: str
    global_batch_loss: bool = False  # went through compute_average_loss or the like
    # id(a gradient summed across replicas) -> this replica's own part of the sum
    own: dict = dataclasses.field(default_factory=dict)
    keep: list = dataclasses.field(default_factory=list)  # keeps the ids above valid
    memo: dict = dataclasses.field(default_factory=dict)  # see `step_memo`


_TRACE: contextvars.ContextVar[_StepTrace | None] = contextvars.ContextVar(
    "step_trace", default=None
)
_WARNED: set[str] = set()


def note_global_batch_loss() -> None:
    """Records that the step scaled a loss by the global batch (`compute_average_loss`)."""
    trace = _TRACE.get()
    if trace is not None:
        trace.global_batch_loss = True


def warn_if_loss_not_averaged() -> None:
    """Warns (once per step) when gradients reach the wrapped optimizer under `run` but
    no loss went through `compute_average_loss`: a per-replica ``loss.mean()`` gives
    ``num_replicas`` times the gradient, since the replicas' gradients are summed."""
    trace = _TRACE.get()
    if trace is None or trace.global_batch_loss or trace.name in _WARNED:
        return
    _WARNED.add(trace.name)
    warnings.warn(
        f"repl.run traced {trace.name!r}, whose gradients reach the wrapped optimizer "
        "(summed across replicas), but no loss in it went through "
        "rp.compute_average_loss. If the loss is a per-replica mean (loss.mean()), the "
        "update is num_replicas times too large: use "
        "rp.compute_average_loss(per_example_loss) instead. (A loss already divided by "
        "the global batch is right; then ignore this.)",
        stacklevel=3,
    )


def remember_own_gradient(total: jax.Array, own: jax.Array) -> None:
    """Records, while `Replicator.run` traces a step, that ``total`` is the cross-replica
    sum of ``own`` (this replica's gradient, possibly in the narrower dtype the sum
    is carried in): the wrapped optimizer sums ``own`` its own way instead (ZeRO's
    reduce-scatter, an aggregator), and the sum ``total`` is dead code unless the
    step reads it."""
    trace = _TRACE.get()
    if trace is not None:
        trace.own[id(total)] = own
        trace.keep += [total, own]


def own_gradient(total: jax.Array) -> jax.Array | None:
    """This replica's own part of the summed gradient ``total``, if `remember_own_gradient`
    recorded one in the step being traced, else None."""
    trace = _TRACE.get()
    return None if trace is None else trace.own.get(id(total))


def step_memo() -> dict | None:
    """A dict that lasts while `Replicator.run` traces one step (None elsewhere), for a
    value a later part of the step finds again: `replicator.step.optim`'s aggregated
    gradients, made once ahead of the update that reads them."""
    trace = _TRACE.get()
    return None if trace is None else trace.memo


_GLOBAL_VIEW: contextvars.ContextVar[bool] = contextvars.ContextVar("global_view", default=False)


def in_global_view() -> bool:
    """True while `Replicator.compile` traces a step (one replica holds the whole batch)."""
    return _GLOBAL_VIEW.get()


def global_view() -> contextlib.AbstractContextManager:
    """While `Replicator.compile` traces a step."""
    return _binding(_GLOBAL_VIEW, True)


_GROUP_AXIS: contextvars.ContextVar[str | None] = contextvars.ContextVar("group_axis", default=None)


def group_axis() -> str | None:
    """While `Replicator.compile` traces a step for DiLoCo's replica groups
    (`replicator.parallel.groups`):
    the mesh axis they span (the step sees the batch of one index along it, the global
    view inside that); else None."""
    return _GROUP_AXIS.get()


def group_view(axis: str) -> contextlib.AbstractContextManager:
    """While `Replicator.compile` traces a step once per index of DiLoCo's ``axis``."""
    return _binding(_GROUP_AXIS, axis)


def replica_key(key: jax.Array) -> jax.Array:
    """A PRNG key of this replica's own, for dropout or noise that must differ per replica.

    Inside `Replicator.run` it is ``jax.random.fold_in(key, replica_id)``:
    distinct for every replica, the same on every run. Outside ``run`` and under
    `Replicator.compile` (one replica, the global batch) it is ``key`` itself.
    Typed (``jax.random.key``) and raw (``jax.random.PRNGKey``) keys both work.

    >>> replica_key(jax.random.PRNGKey(7)).tolist()  # outside run: unchanged
    [0, 7]
    """
    ctx = get_replica_context()
    if ctx is None:
        return key
    return jax.random.fold_in(key, ctx.replica_id)


def varying_axes(x: jax.Array, axes: Sequence[str]) -> tuple[str, ...]:
    """Which of ``axes`` ``x`` varies over, as JAX types it inside ``shard_map``."""
    varying = compat.varying_manual_axes(x)
    return tuple(a for a in axes if a in varying)


def sum_varying(x: jax.Array, axes: Sequence[str]) -> jax.Array:
    """``x`` summed over those of ``axes`` it varies over (unchanged where it varies over none)."""
    varying = varying_axes(x, axes)
    return jax.lax.psum(x, varying) if varying else x


def vary(x: jax.Array, axes: Sequence[str]) -> jax.Array:
    """``x`` typed as varying over every one of ``axes`` (a no-op where it already is)."""
    varying = compat.varying_manual_axes(x)
    missing = tuple(a for a in axes if a not in varying)
    return jax.lax.pcast(x, missing, to="varying") if missing else x


_MICROBATCHES: contextvars.ContextVar[int] = contextvars.ContextVar("microbatches", default=1)


def num_microbatches() -> int:
    """How many microbatches the step being traced splits each batch into (usually 1)."""
    return _MICROBATCHES.get()


def microbatching(count: int) -> contextlib.AbstractContextManager:
    """While tracing one microbatch of ``count``: losses scale by the full batch."""
    return _binding(_MICROBATCHES, count)


@contextlib.contextmanager
def _binding(var: contextvars.ContextVar, value) -> Iterator:
    token = var.set(value)
    try:
        yield value
    finally:
        var.reset(token)
