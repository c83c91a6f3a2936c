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
import shutil
import socket
import tempfile
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


def block(tree: Any) -> Any:
    """Waits until ``tree``'s arrays are computed; returns it. The actions wait for the
    device only through the ``wait`` they are given (default: this), so that the loop
    can count that time as the device's (`Stopwatch`'s "compute")."""
    return jax.block_until_ready(tree)


class LogTrain:
    """Writes a logged step's train metrics, fetched once the next step is dispatched,
    so the host never waits for the device just to log. A record holds that step's
    own metrics, so a resumed run logs exactly what an uninterrupted one does: the
    experiment's, the ``learning_rate`` the step's update used (``schedule`` at the
    count of updates before it) and the ``grad_norm`` of its summed gradient."""

    def __init__(self, writer, progress, summarize, *, every_steps, per_step, unit, start,
                 wait: Callable[[Any], Any] = block,
                 schedule: Callable[[int], Any] | None = None):  # fmt: skip
        self._wait, self._schedule = wait, schedule
        self._writer, self._progress, self._summarize = writer, progress, summarize
        self._every, self._per_step, self._unit = every_steps, per_step, unit
        self._held = None
        self._last = (start, time.perf_counter())

    def __call__(self, end: StepEnd) -> None:
        self.close()
        self._progress.update(end.step)
        if every(end.step, self._every) or end.last:
            self._held = (end.step, end.sums, end.status)

    def close(self) -> None:
        if self._held is None:
            return
        (step, sums, status), self._held = self._held, None
        sums, status = jax.device_get(self._wait((sums, status)))
        record = self._summarize(sums)
        shown = {k: v for k, v in record.items() if isinstance(v, float)}  # the experiment's
        if self._schedule is not None and "updates" in status:
            # (under DiLoCo and compile, a count per group of replicas: they step together)
            updates = int(np.max(status["updates"]))
            record["learning_rate"] = float(self._schedule(updates))
        if "grad_norm" in status:
            record["grad_norm"] = float(np.mean(status["grad_norm"]))  # (DiLoCo: the groups')
        now = time.perf_counter()
        last_step, last_time = self._last
        self._last = (step, now)
        rate = (step - last_step) * self._per_step / max(now - last_time, 1e-9)
        record[f"{self._unit}_per_sec"] = rate
        self._writer.write(step, record)
        # Every metric of the experiment's (an MoE's dropped_fraction beside the loss).
        self._progress.update(step, **shown, **{f"{self._unit}_per_sec": rate})


class WatchNonfinite:
    """Checks every step for a skipped (non-finite) update, one step late.

    With dynamic loss scaling, a skip whose train metrics are finite is an
    expected overflow (the scale halves) and is only counted. Any other skip is
    recorded in ``WORKDIR/nonfinite/step_<N>.process_<P>.json`` (the input
    iterator's position before the batch and, when the batch carries an
    ``index``, its example indices), so the batch can be replayed; policy
    ``"halt"`` then stops the run.
    """

    def __init__(self, workdir: str, policy: str, loss_scaling: bool, summarize: Callable,
                 wait: Callable[[Any], Any] = block):  # fmt: skip
        self._wait = wait
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
        if not int(jax.device_get(self._wait(end.status["skipped"]))):
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
    """Profiles the run, viewable in xprof (TensorBoard's profile plugin) or Perfetto.

    Two ways, both on every process of a multi-process run:

    * ``steps`` (config ``profile_steps``, ``"START,END"``): each process traces
      steps START..END into ``directory/process_<i>``, in the layout xprof reads
      (``plugins/profile/<time>/<host>.xplane.pb``). A trace for a bucket is
      written to a local temporary directory and uploaded through `storage` when
      it stops: jaxlib's own ``gs://`` writer talks to Google's endpoints only,
      past the storage layer's deadlines and retries.
    * ``port`` (config ``profile_port``): each process runs JAX's profiler server
      from construction to `close`, process ``i`` on port ``port + i`` of its own
      host (processes that share a host never collide), so that a trace of every
      worker at once can be captured on demand while the run goes on.
    """

    def __init__(self, directory: str, steps: str | None, port: int | None = None,
                 wait: Callable[[Any], Any] = block):  # fmt: skip
        self._wait = wait
        self._root = directory
        self._dir = storage.join(directory, f"process_{jax.process_index()}")
        self._range = tuple(int(x) for x in steps.split(",")) if steps else None
        self._tracing: str | None = None  # the local directory the trace goes to
        self._serving = port is not None and _start_profiler_server(port + jax.process_index())
        if port is not None and jax.process_index() == 0:
            log.info("%s", _servers_line(port, jax.process_count()))

    def before(self, step: int) -> None:
        """Starts the trace before START is dispatched."""
        if self._range and step == self._range[0]:
            remote = storage.is_remote(self._dir)
            self._tracing = tempfile.mkdtemp(prefix="replicator-profile-") if remote else self._dir
            jax.profiler.start_trace(self._tracing)

    def __call__(self, end: StepEnd) -> None:
        if self._tracing is not None and end.step >= self._range[1]:
            self._wait(end.sums)  # the traced steps, finished
            self._stop_trace()

    def close(self) -> None:
        """Ends a trace still running (a run that stopped inside the range) and the server."""
        self._stop_trace()
        if self._serving:
            jax.profiler.stop_server()
            self._serving = False

    def _stop_trace(self) -> None:
        if self._tracing is None:
            return
        tracing, self._tracing = self._tracing, None
        jax.profiler.stop_trace()
        if tracing != self._dir:
            try:
                storage.copy_tree(tracing, self._dir)
            except OSError as e:  # a StorageError too
                log.warning(
                    "Could not upload the profiler trace to %s (kept in %s): %s",
                    self._dir,
                    tracing,
                    e,
                )
                return
            shutil.rmtree(tracing, ignore_errors=True)
        if jax.process_index() == 0:
            where = self._dir if jax.process_count() == 1 else storage.join(self._root, "process_*")
            log.info("Profiler trace of steps %s-%s in %s", *self._range, where)


def _servers_line(port: int, processes: int) -> str:
    """Where the processes' profiler servers listen and how to capture from them.

    >>> _servers_line(9999, 1).split(":")[0]
    'Profiler server on port 9999'
    >>> _servers_line(9999, 4).split(":")[0]
    'Profiler servers on ports 9999-10002, process i on port 9999+i of its host'
    """
    if processes == 1:
        return (
            f"Profiler server on port {port}: capture a trace on demand with xprof "
            f"(Capture Profile, HOST:{port})"
        )
    return (
        f"Profiler servers on ports {port}-{port + processes - 1}, process i on port {port}+i "
        f"of its host: capture them all at once on demand with xprof (Capture Profile, "
        f"HOST_0:{port},HOST_1:{port + 1},...)"
    )


def _start_profiler_server(port: int) -> bool:
    """Starts JAX's profiler server on ``port``; warns and returns False where it cannot
    listen there (the server itself would only log its failure)."""
    try:
        family = socket.AF_INET6 if socket.has_dualstack_ipv6() else socket.AF_INET
        socket.create_server(
            ("", port), family=family, dualstack_ipv6=family == socket.AF_INET6
        ).close()
        jax.profiler.start_server(port)
    except (OSError, OverflowError, ValueError) as e:  # in use, > 65535, or already running
        log.warning("No profiler server on port %d: %s", port, e)
        return False
    return True


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
