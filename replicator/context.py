"""The replica context: what a step function can ask while `Replicator.run` traces it.

Like tf.distribute's ``get_replica_context()``: inside ``repl.run`` it says how many
replicas take part and over which mesh axes they are laid out; outside it is None.
It is set only while tracing, so it costs nothing at run time.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator


@dataclasses.dataclass(frozen=True)
class ReplicaContext:
    """Where a per-replica function runs.

    Attributes:
      num_replicas: how many replicas run the function (the product of the sizes
        of ``axis_names``).
      axis_names: the mesh axes the replicas span, for collectives such as
        ``jax.lax.psum(x, ctx.axis_names)``.
    """

    num_replicas: int
    axis_names: tuple[str, ...]


_CURRENT: contextvars.ContextVar[ReplicaContext | None] = contextvars.ContextVar(
    "replica_context", default=None
)


def get_replica_context() -> ReplicaContext | None:
    """Returns the replica context while `Replicator.run` traces a function, else None."""
    return _CURRENT.get()


def replica_context(ctx: ReplicaContext) -> contextlib.AbstractContextManager:
    """While `Replicator.run` traces a function: `get_replica_context` returns ``ctx``."""
    return _binding(_CURRENT, ctx)


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
