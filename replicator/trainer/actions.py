"""Periodic actions of the training loop: each a small object with one job.

After every step the loop hands each action the `StepEnd`; an action decides
for itself whether it is its turn (``every(step, n)``). The order of the list
is the order of work at a step boundary: log, watch for non-finite updates,
profile, evaluate, agree on a stop, save, stop. `close` runs at the end of the
loop, also after an error.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from replicator import storage
from replicator.trainer.preemption import Preempted

log = logging.getLogger("replicator")


def every(step: int, n: int) -> bool:
    """Whether ``step`` is a multiple of ``n``.

    >>> [s for s in range(1, 10) if every(s, 4)]
    [4, 8]
    """
    return step % n == 0


@dataclasses.dataclass
class StepEnd:
    """What the loop knows when a step has been dispatched.

    Attributes:
      step: the step just dispatched (1-based).
      last: whether it is the final step of the run.
      state: the train state after it (device values, possibly still computing).
      sums: the step's train sums, reduced across replicas (device values).
      status: mirrored counters: ``skipped`` updates and the ``loss_scale``.
      batch: the step's global batch.
      position: the input iterator's position before the batch (to replay it).
      eval_result: set by `Evaluate` at an eval step.
      stop: set by `AgreeOnStop` when the run stops after this step.
    """

    step: int
    last: bool
    state: Any
    sums: Any
    status: dict
    batch: Any
    position: Any
    eval_result: dict | None = None
    stop: bool = False


class LogTrain:
    """Writes a logged step's train metrics, fetched once the next step is dispatched,
    so the host never waits for the device just to log. A record holds that step's
    own metrics, so a resumed run logs exactly what an uninterrupted one does."""

    def __init__(self, writer, progress, summarize, *, every_steps, per_step, unit, start):
        self._writer, self._progress, self._summarize = writer, progress, summarize
        self._every, self._per_step, self._unit = every_steps, per_step, unit
        self._held = None
        self._last = (start, time.perf_counter())

    def __call__(self, end: StepEnd) -> None:
        self.close()
        self._progress.update(end.step)
        if every(end.step, self._every) or end.last:
            self._held = (end.step, end.sums)

    def close(self) -> None:
        if self._held is None:
            return
        (step, sums), self._held = self._held, None
        record = self._summarize(jax.device_get(sums))
        now = time.perf_counter()
        last_step, last_time = self._last
        self._last = (step, now)
        rate = (step - last_step) * self._per_step / max(now - last_time, 1e-9)
        record[f"{self._unit}_per_sec"] = rate
        self._writer.write(step, record)
        shown = {k: v for k, v in record.items() if isinstance(v, float)}
        self._progress.update(step, **dict(list(shown.items())[:2]), **{"per_sec": rate})


class WatchNonfinite:
    """Checks every step for a skipped (non-finite) update, one step late.

    With dynamic loss scaling, a skip whose train metrics are finite is an
    expected overflow (the scale halves) and is only counted. Any other skip is
    recorded in ``WORKDIR/nonfinite/step_<N>.process_<P>.json`` (the input
    iterator's position before the batch and, when the batch carries an
    ``index``, its example indices), so the batch can be replayed; policy
    ``"halt"`` then stops the run.
    """

    def __init__(self, workdir: str, policy: str, loss_scaling: bool, summarize: Callable):
        self._dir = storage.join(workdir, "nonfinite")
        self._policy, self._loss_scaling, self._summarize = policy, loss_scaling, summarize
        self._held: StepEnd | None = None

    def __call__(self, end: StepEnd) -> None:
        previous, self._held = self._held, None
        if previous is not None:
            self._check(previous)  # a halt raises here, and nothing stays held
        self._held = end

    def close(self) -> None:
        if self._held is not None:
            held, self._held = self._held, None
            self._check(held)

    def _check(self, end: StepEnd) -> None:
        if not int(jax.device_get(end.status["skipped"])):
            return
        metrics = self._summarize(jax.device_get(end.sums))
        finite = all(np.isfinite(v) for v in metrics.values() if isinstance(v, float))
        if self._loss_scaling and finite:
            log.info("step %d: gradients overflowed; update skipped, loss scale halved.", end.step)
            return
        record = {
            "step": end.step,
            "metrics": metrics,
            "iterator_state_before": end.position.decode(),
        }
        if "index" in end.batch:
            shards = end.batch["index"].addressable_shards
            record["example_indices"] = np.concatenate(
                [np.asarray(s.data) for s in shards]
            ).tolist()
        path = storage.join(self._dir, f"step_{end.step}.process_{jax.process_index()}.json")
        storage.write_text(path, json.dumps(record, default=str))
        if self._policy == "halt":
            raise FloatingPointError(
                f"Non-finite loss or gradients at step {end.step} ({metrics}); the update was "
                f"not applied. The batch is recorded in {path}. Set config.nonfinite='skip' to "
                "skip such steps instead."
            )
        log.warning("step %d: non-finite gradients; update skipped (batch in %s).", end.step, path)


class Profile:
    """Captures a JAX profiler trace of steps START..END (config ``profile_steps``),
    viewable in TensorBoard's profile plugin or Perfetto."""

    def __init__(self, directory: str, steps: str | None):
        self._dir = directory
        self._range = tuple(int(x) for x in steps.split(",")) if steps else None
        self._active = False

    def before(self, step: int) -> None:
        """Starts the trace before START is dispatched."""
        if self._range and step == self._range[0] and jax.process_index() == 0:
            jax.profiler.start_trace(self._dir)
            self._active = True

    def __call__(self, end: StepEnd) -> None:
        if self._active and end.step >= self._range[1]:
            jax.block_until_ready(end.sums)  # the traced steps, finished
            self.close()

    def close(self) -> None:
        if self._active:
            jax.profiler.stop_trace()
            self._active = False
            log.info("Profiler trace of steps %s-%s in %s", *self._range, self._dir)


class Evaluate:
    """Evaluates every ``every_steps`` steps and at the last step, and records it."""

    def __init__(self, evaluate: Callable[[Any, int], dict], every_steps: int):
        self._evaluate, self._every = evaluate, every_steps

    def __call__(self, end: StepEnd) -> None:
        if every(end.step, self._every) or end.last:
            end.eval_result = self._evaluate(end.state, end.step)

    def close(self) -> None:
        """Nothing to finish."""


class AgreeOnStop:
    """Turns a SIGTERM/SIGINT into one agreed stopping step for every process."""

    def __init__(self, preemption):
        self._preemption = preemption

    def __call__(self, end: StepEnd) -> None:
        end.stop = self._preemption.stop_step(end.step) == end.step

    def close(self) -> None:
        """Nothing to finish."""


class Save:
    """Saves a checkpoint every ``every_steps`` steps, at the last step, and before a stop."""

    def __init__(self, save: Callable[[StepEnd], None], every_steps: int):
        self._save, self._every = save, every_steps

    def __call__(self, end: StepEnd) -> None:
        if every(end.step, self._every) or end.last or end.stop:
            self._save(end)

    def close(self) -> None:
        """Nothing to finish."""


class Stop:
    """Ends the run after the checkpoint of an agreed stop (`Preempted`)."""

    def __init__(self, checkpoints, preemption, flush: Callable[[], None]):
        self._checkpoints, self._preemption, self._flush = checkpoints, preemption, flush

    def __call__(self, end: StepEnd) -> None:
        if end.stop and not end.last:
            self._flush()
            self._checkpoints.wait()
            log.warning("%s received; stopped at step %d.", self._preemption.signal_name, end.step)
            raise Preempted(end.step, self._checkpoints.directory)

    def close(self) -> None:
        """Nothing to finish."""
