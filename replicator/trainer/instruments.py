"""Run instruments: progress bar, wall time per phase, FLOPs, MFU and the run summary."""

from __future__ import annotations

import logging
import math
import sys
import time
from typing import Any

import jax
import numpy as np
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from replicator import diloco, sharding

log = logging.getLogger("replicator")


class ProgressBar:
    """A progress bar with step, loss, examples/s and ETA.

    Quiet when stdout is not a terminal or when ``enabled`` is False; then
    `update` does nothing and the caller's log lines tell the story.
    """

    def __init__(self, total: int, initial: int = 0, *, enabled: bool | None = None):
        self.enabled = sys.stdout.isatty() if enabled is None else enabled
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
        if self._progress is not None:
            info = "  ".join(f"{k} {_format(v)}" for k, v in fields.items())
            self._progress.update(self._task, completed=step, **({"info": info} if fields else {}))

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()


def _format(value: float) -> str:
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.4f}"


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


# Dense bf16 matmul peaks per chip, from the vendors' data sheets, by the start
# of jax.Device.device_kind. MFU on an accelerator is measured against these.
_PEAK_FLOPS = {
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,
    "TPU v5e": 197e12,
    "TPU v5p": 459e12,
    "TPU v5": 459e12,
    "TPU v6 lite": 918e12,
    "TPU v6e": 918e12,
    "TPU7x": 2307e12,
    "NVIDIA H200": 989e12,
    "NVIDIA H100": 989e12,  # SXM; the PCIe card peaks at 756e12
    "NVIDIA A100": 312e12,
    "NVIDIA L4": 121e12,
}


def peak_flops_per_second(devices: list[jax.Device]) -> tuple[float, str] | None:
    """The matmul peak of ``devices`` together, and where the number comes from.

    Accelerators: the data-sheet dense bf16 peak of their chip times their
    count. CPUs: an f32 matmul measured now on one of this process's devices
    (chains of dependent 1024x1024 products, best of a few rounds, about
    0.3 s), times the number of hosts (`_num_hosts`): a host's CPU devices
    share its cores, and every host is taken to be like this one.

    Returns:
      ``(flops_per_second, source)``, or None for an accelerator not in the table.
    """
    kind = devices[0].device_kind
    if devices[0].platform == "cpu":
        local = [d for d in devices if d.process_index == jax.process_index()]
        return _num_hosts(devices) * measure_matmul_flops(local[0]), "measured f32 matmul"
    for prefix, peak in _PEAK_FLOPS.items():
        if kind.startswith(prefix):
            return len(devices) * peak, f"{prefix} bf16 data sheet"
    return None


def _num_hosts(devices: list[jax.Device]) -> int:
    """Hosts under ``devices``: one per process, unless the coordinator is this host's
    loopback (``launch local``), where every process shares this host's cores."""
    from replicator.runtime.compat import coordinator_address
    from replicator.runtime.processes import is_loopback, split_address

    address = coordinator_address()
    if address and is_loopback(split_address(address)[0]):
        return 1
    return len({d.process_index for d in devices})


def measure_matmul_flops(device: jax.Device, n: int = 1024, rounds: int = 5) -> float:
    """Best f32 matmul rate of ``device`` in FLOP/s, over ``rounds`` chains of 4 products."""
    rng = np.random.default_rng(0)
    a = jax.device_put(rng.standard_normal((n, n), np.float32), device)
    b = jax.device_put(rng.standard_normal((n, n), np.float32) / np.sqrt(n), device)
    chain = jax.jit(lambda a, b: jax.lax.fori_loop(0, 4, lambda i, c: c @ b, a))
    chain(a, b).block_until_ready()  # compile
    best = math.inf
    for _ in range(rounds):
        start = time.perf_counter()
        chain(a, b).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 4 * 2 * n**3 / best


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
        record |= _utilization(run, state, end.batch, steps - 1, watch)
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
    """The train step's FLOPs (XLA's count) and model FLOPs utilization over ``steps``.

    MFU = FLOPs per step x steps / compute time / peak FLOP/s of the mesh's
    devices (`peak_flops_per_second`). Compute time excludes the first,
    compiling step, as ``steps`` does.
    """
    devices = list(run.repl.mesh.devices.flat)
    result: dict[str, Any] = {}
    try:
        # The compiled program is cached: this neither traces nor compiles again.
        compiled = run.train_step.lower(state, batch).compile()
        if run.config.diloco is not None:
            result |= _island_traffic(run, compiled.as_text(), state)
        cost = compiled.cost_analysis()
        flops = float(cost["flops"]) * len(devices)  # XLA counts one device's program
        result["flops_per_step"] = flops
        compute = watch.totals.get("compute", 0.0)
        peak = peak_flops_per_second(devices)
        if peak is not None and compute > 0 and flops > 0:
            result |= {
                "mfu": flops * steps / compute / peak[0],
                "peak_flops_per_sec": peak[0],
                "peak_source": peak[1],
            }
    except Exception as e:  # noqa: BLE001  (an instrument must not fail the run)
        log.warning("No FLOP count or MFU for the train step: %s", e)
    return result


def _island_traffic(run, hlo: str, state) -> dict:
    """DiLoCo's bytes per step between islands, measured from the step's HLO, next to
    what data parallelism's gradient all-reduce over the same replicas would send."""
    settings = dict(run.config.diloco)
    axis, inner_steps = settings.get("axis", "data"), settings["inner_steps"]
    sent = diloco.traffic(hlo, run.repl.mesh, axis)
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
