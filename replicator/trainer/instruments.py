"""Run instruments: progress bar, wall time per phase, and the run summary (FLOPs, MFU)."""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

import jax
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from replicator.compiled import hlo as hlo
from replicator.parallel import diloco as diloco
from replicator.parallel import sharding as sharding
from replicator.trainer.peaks import peak_flops_per_second

log = logging.getLogger("replicator")


class ProgressBar:
    """A progress bar with step, loss, examples/s and ETA.

    When stdout is not a terminal (a pipe, a file, a batch job's console), each
    `update` with metrics is a log line instead, ``step 50  train loss 0.41  ...``,
    as the evals are; ``enabled=False`` (``--quiet``) shows neither.
    """

    def __init__(self, total: int, initial: int = 0, *, enabled: bool | None = None):
        terminal = sys.stdout.isatty()
        self.enabled = terminal if enabled is None else enabled
        self._lines = enabled is None and not terminal
        self._progress = None
        if self.enabled:
            self._progress = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[info]}"),
                TimeRemainingColumn(),
            )
            self._task = self._progress.add_task("train", total=total, completed=initial, info="")
            self._progress.start()

    def update(self, step: int, **fields: float) -> None:
        info = "  ".join(f"{k} {_format(v)}" for k, v in fields.items())
        if self._progress is not None:
            self._progress.update(self._task, completed=step, **({"info": info} if fields else {}))
        elif self._lines and fields:
            log.info("step %d  train %s", step, info)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()


def _format(value: float) -> str:
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.4g}"


class Stopwatch:
    """Accumulates wall time per phase (compile, compute, input, eval, checkpoint)."""

    def __init__(self):
        self.totals: dict[str, float] = {}
        self._start = time.perf_counter()

    def time(self, phase: str) -> _Phase:
        """A context manager that adds the time spent inside it to ``phase``."""
        return _Phase(self, phase)

    def add(self, phase: str, seconds: float) -> None:
        self.totals[phase] = self.totals.get(phase, 0.0) + seconds

    def elapsed(self) -> float:
        return time.perf_counter() - self._start


class _Phase:
    def __init__(self, watch: Stopwatch, phase: str):
        self._watch, self._phase = watch, phase

    def __enter__(self):
        self._t0 = time.perf_counter()

    def __exit__(self, *exc):
        self._watch.add(self._phase, time.perf_counter() - self._t0)


def summarize_run(run, watch: Stopwatch, state, end, start: int, *, completed: bool) -> dict:
    """The run's final ``summary`` record, also logged.

    Wall time split into phases that sum to the total; throughput in the
    experiment's units; the goodput (share of wall time in training steps); the
    largest per-device share of the train state; and, after a completed run of
    more than one step, the train step's FLOPs and the MFU.
    """
    total = watch.elapsed()
    wall = {k: round(v, 3) for k, v in watch.totals.items()}
    wall |= {"other": round(total - sum(watch.totals.values()), 3), "total": round(total, 3)}
    steps = (end.step - start) if end is not None else 0
    record: dict[str, Any] = {"wall_time_s": wall, "steps": steps}
    if steps:
        per_step, unit = run.per_step_units()
        record["examples_per_sec"] = steps * run.config.batch_size / wall["total"]
        record[f"{unit}_per_sec"] = steps * per_step / wall["total"]
        record["goodput"] = watch.totals.get("compute", 0.0) / wall["total"]
    if state is not None:
        record["state_bytes_per_device"] = sharding.bytes_per_device(state)
    if completed and steps > 1 and end.batch is not None and jax.process_index() == 0:
        record |= _utilization(run, state, end.batch, steps, watch)
    log.info("wall time: %s", ", ".join(f"{k} {v:.1f} s" for k, v in wall.items()))
    if "mfu" in record:
        log.info(
            "%.3g FLOP per step, MFU %.1f%% (peak: %s)",
            record["flops_per_step"],
            100 * record["mfu"],
            record["peak_source"],
        )
    return record


def _utilization(run, state, batch, steps: int, watch: Stopwatch) -> dict:
    """The train step's FLOPs and model FLOPs utilization over ``steps``.

    FLOPs are the matrix products of the compiled step (`replicator.compiled.hlo.analyze`:
    every loop's body as many times as it runs, so scanned layers and gradient
    accumulation count in full, where XLA's ``cost_analysis()`` sees a loop's body
    once). MFU = FLOPs per step x steps / compute time / peak FLOP/s of the mesh's
    devices (`peak_flops_per_second`). Compute time is the device's: the loop
    counts as "compute" its dispatches and every wait for the device (the
    non-finite check of the previous step, logging, before eval and saves), and
    the first step's compilation apart, as "compile" (its execution is waited
    for, and counted, like any other step's). An MFU above 1 would say the peak
    is wrong, not the step: it is then left out, with a warning.
    """
    devices = list(run.repl.mesh.devices.flat)
    result: dict[str, Any] = {}
    try:
        # The compiled program is cached: this neither traces nor compiles again.
        program = run.train_step.lower(state, batch).compile().as_text()
        if run.config.diloco is not None:
            result |= _island_traffic(run, program, state)
        flops = hlo.analyze(program).flops * len(devices)  # one device's program, each
        result["flops_per_step"] = flops
        compute = watch.totals.get("compute", 0.0)
        peak = peak_flops_per_second(devices)
        if peak is not None and compute > 0 and flops > 0:
            mfu = flops * steps / compute / peak[0]
            if mfu > 1:
                log.warning(
                    "No MFU: the train step ran at %.3g FLOP/s, above the peak it would be "
                    "measured against (%.3g, %s)", flops * steps / compute, *peak
                )  # fmt: skip
            else:
                result |= {"mfu": mfu, "peak_flops_per_sec": peak[0], "peak_source": peak[1]}
    except Exception as e:  # noqa: BLE001  (an instrument must not fail the run)
        log.warning("No FLOP count or MFU for the train step: %s", e)
    return result


def _island_traffic(run, program: str, state) -> dict:
    """DiLoCo's bytes per step between islands, measured from the step's HLO
    (`replicator.compiled.hlo`), next to what data parallelism's gradient all-reduce over the
    same replicas would send."""
    settings = dict(run.config.diloco)
    axis, inner_steps = settings.get("axis", "data"), settings["inner_steps"]
    sent = hlo.traffic(program, run.repl.mesh, axis)
    per_step = sent["every_step"] + sent["in_branches"] / inner_steps
    n, params = run.repl.num_replicas, diloco.outer_bytes(state)
    log.info(
        "DiLoCo: %.3g bytes per step between islands per device (data parallelism's "
        "all-reduce: %.3g)",
        per_step,
        2 * params * (n - 1) / n,
    )
    return {
        "cross_island_bytes_per_step": per_step,
        "data_parallel_bytes_per_step": 2 * params * (n - 1) / n,
    }
