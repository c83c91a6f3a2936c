"""Run instruments: metric records (JSONL + TensorBoard), progress, weighted sums.

Metrics are reduced as weighted sums: every step or eval batch contributes sums
(loss x examples, correct predictions, examples), and a mean is taken only once,
at the end, over the total weight. That keeps padded and uneven batches exact.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn


def summarize_sums(sums: Mapping[str, Any]) -> dict[str, float]:
    """Turns summed ``loss``, ``correct`` and ``count`` into means.

    Args:
      sums: host or device scalars; ``loss`` and ``correct`` are sums over the
        ``count`` real examples.

    Returns:
      ``{"loss", "accuracy", "num_examples"}``.

    >>> summarize_sums({"loss": 3.0, "correct": 2.0, "count": 4.0})
    {'loss': 0.75, 'accuracy': 0.5, 'num_examples': 4}
    """
    count = float(sums["count"])
    mean = lambda key: float(sums[key]) / count if count else math.nan
    return {"loss": mean("loss"), "accuracy": mean("correct"), "num_examples": int(round(count))}


class MetricWriter:
    """Appends metric records to ``WORKDIR/metrics.jsonl`` and TensorBoard events.

    Only process 0 writes; on other processes every call is a no-op.

    Args:
      workdir: the run's directory.
      resume_step: the step a resumed run restarts from. Records of later steps
        (written before an interruption, and about to be redone) are dropped from
        the JSONL file and purged from TensorBoard, so the history reads as if the
        run had never stopped. None only appends (a sidecar evaluator).
      enabled: whether to write (default: on process 0 only).
    """

    def __init__(self, workdir: str, *, resume_step: int | None = 0, enabled: bool | None = None):
        self.enabled = jax.process_index() == 0 if enabled is None else enabled
        self._jsonl = self._tensorboard = None
        if self.enabled:
            from tensorboardX import SummaryWriter

            os.makedirs(workdir, exist_ok=True)
            path = os.path.join(workdir, "metrics.jsonl")
            if resume_step is not None:
                _drop_records_after(path, resume_step)
            self._jsonl = open(path, "a")
            self._tensorboard = SummaryWriter(
                os.path.join(workdir, "tensorboard"),
                purge_step=resume_step + 1 if resume_step else None,
            )

    def write(self, step: int, metrics: Mapping[str, Any], *, split: str | None = None) -> None:
        """Writes one record: ``{"step": step, "split": split, **metrics}``."""
        if not self.enabled:
            return
        record = {"step": int(step), **({"split": split} if split else {})}
        record.update({k: _to_python(v) for k, v in metrics.items()})
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        for key, value in record.items():
            if key not in ("step", "split") and isinstance(value, int | float):
                self._tensorboard.add_scalar(f"{split or 'train'}/{key}", value, int(step))
        self._tensorboard.flush()

    def close(self) -> None:
        if self.enabled:
            self._jsonl.close()
            self._tensorboard.close()


def _drop_records_after(path: str, step: int) -> None:
    if not os.path.exists(path):
        return
    with open(path) as f:
        lines = f.readlines()
    keep = []
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line torn by a crash
        if record.get("step", 0) <= step and record.get("split") != "summary":
            keep.append(json.dumps(record) + "\n")
    if len(keep) != len(lines):
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            f.writelines(keep)
        os.replace(tmp, path)


def _to_python(value: Any) -> Any:
    if isinstance(value, jax.Array | np.ndarray | np.generic):
        value = np.asarray(value).item()
    return value


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
    from jax._src.distributed import global_state  # private; jax is pinned < 0.11

    from replicator.mesh import is_loopback, split_address

    address = global_state.coordinator_address
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


def plot_metrics(workdir: str) -> list[str]:
    """Writes PNG plots of loss, accuracy and throughput from ``WORKDIR/metrics.jsonl``.

    Args:
      workdir: a run's directory.

    Returns:
      The paths of the PNG files written into ``WORKDIR/plots/``.
    """
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f if line.strip()]
    train = [r for r in records if "split" not in r]
    evals = {}
    for r in records:
        if r.get("split") not in (None, "summary"):
            evals.setdefault(r["split"], []).append(r)
    os.makedirs(os.path.join(workdir, "plots"), exist_ok=True)
    paths = []
    for key, label in (
        ("loss", "loss"),
        ("accuracy", "accuracy"),
        ("examples_per_sec", "examples / s"),
    ):
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot(
            [r["step"] for r in train if key in r],
            [r[key] for r in train if key in r],
            label="train",
        )
        for split, rs in evals.items():
            points = [(r["step"], r[key]) for r in rs if key in r]
            if points:
                ax.plot(*zip(*points), marker="o", label=split)
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend()
        path = os.path.join(workdir, "plots", f"{key}.png")
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths
