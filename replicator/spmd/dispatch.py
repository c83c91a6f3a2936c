"""The bound on steps in flight: how far the host may run ahead of the devices.

JAX dispatches a step and returns at once; the host can queue steps without
end. On GPUs and TPUs that is what keeps the devices busy, but on a mesh of
several CPU devices an unbounded queue of sharded steps has deadlocked
XLA:CPU's all-reduce rendezvous, so there `Replicator` waits whenever more than
``max_steps_in_flight`` of its steps are unfinished. `run`, `compile` and
`reduce` all dispatch through one `StepsInFlight`.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import jax

from replicator.spmd import cpu as cpu


class StepsInFlight:
    """Bounds how many dispatched steps may be unfinished (``bound``; 0: no bound).

    Keeps one output of each recent step (all outputs of one executable become
    ready together) and waits for the oldest when over the bound. Without a
    bound it only remembers the last step's outputs, for `drain`.
    """

    def __init__(self, bound: int | None, devices: Sequence[jax.Device] = ()):
        if bound is None:  # only XLA:CPU's collectives need a bound
            bound = 2 if cpu.needs_bounded_dispatch(list(devices)) else 0
        self.bound = bound
        self._pending: collections.deque[list[jax.Array]] = collections.deque()
        self._last: Any = None

    def dispatch(self, fn: Callable, *args, **kwargs) -> Any:
        out = fn(*args, **kwargs)
        if not self.bound:
            self._last = out
            return out
        arrays = [x for x in jax.tree.leaves(out) if isinstance(x, jax.Array)]
        if arrays:
            self._pending.append([min(arrays, key=lambda x: x.size)])
        while len(self._pending) > self.bound:
            self._wait(self._pending.popleft())
        return out

    def _wait(self, arrays: list[jax.Array]) -> None:
        # An output may since have been donated into a later step; then that later
        # step's outputs stand for it (it cannot finish before this one).
        for candidates in itertools.chain((arrays,), self._pending):
            for x in candidates:
                if _block(x):
                    return

    def drain(self) -> None:
        """Blocks until every dispatched step has finished."""
        while self._pending:
            self._wait(self._pending.popleft())
        last, self._last = self._last, None
        for x in jax.tree.leaves(last):
            if isinstance(x, jax.Array):
                _block(x)


def checked_bound(max_steps_in_flight: int | None) -> int | None:
    """``max_steps_in_flight`` as `Replicator` takes it: None (the default) or >= 1."""
    if max_steps_in_flight is not None and max_steps_in_flight < 1:
        raise ValueError(f"max_steps_in_flight must be >= 1, got {max_steps_in_flight}.")
    return max_steps_in_flight


def _block(x: jax.Array) -> bool:
    """Waits for ``x``; False if it was deleted or donated meanwhile."""
    if x.is_deleted():
        return False
    try:
        x.block_until_ready()
    except jax.errors.JaxRuntimeError as e:
        if "donated" in str(e) or "deleted" in str(e):
            return False
        raise
    return True
