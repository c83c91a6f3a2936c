"""Metric records: ``WORKDIR/metrics.jsonl`` and TensorBoard events, process 0 only."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np


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
