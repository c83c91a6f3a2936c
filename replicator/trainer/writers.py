"""Metric records: ``WORKDIR/metrics.jsonl``, TensorBoard events and W&B, process 0 only.

A resumed run redoes the steps after its checkpoint. So that every history reads
as if the run had never stopped, both are cut back to the checkpoint's step
before anything is written: `metrics.jsonl` loses its later records, and the
TensorBoard event files their later events (whatever loader reads them). Each run
also starts its event file with TensorBoard's restart marker (``SessionLog.START``
at the first step it writes), which TensorBoard's Python loader honours by
purging later steps. Both files are written synchronously and flushed record by
record, so a run killed at any moment has lost nothing it reported.

In a bucket (a ``gs://`` workdir), where objects cannot be appended to, each file
is a `storage.Mirror`: the same local writes, uploaded whole in the background
and, through `MetricWriter.sync`, as a part of every checkpoint save (the save's
``before_commit``: Orbax commits the step only after the upload). A run killed at
any moment then has on the bucket every record up to the checkpoint it resumes
from; the later ones it redoes, as a local run does. A record torn by an upload
racing a write is the last one, and dropped on resume like one torn by a crash.
Writing a record costs the step loop what it costs on a local disk.

Weights & Biases (``writers=("tensorboard", "wandb")``, `replicator.trainer.wandb_writer`)
gets the same records, one W&B run per workdir continued on resume; its history
cannot be cut back, so a resumed run sends it only steps it has not seen.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from replicator import storage
from replicator.errors import ConfigError

WRITERS = ("tensorboard", "wandb")


def check_writers(writers: Sequence[str]) -> tuple[str, ...]:
    """Checks the record writers asked for (besides ``metrics.jsonl``, always written).

    Call it before touching the workdir: each name must be one of `WRITERS`, and
    each writer's library importable (``wandb`` is an optional dependency).

    Args:
      writers: names from `WRITERS`.

    Returns:
      The names, as a tuple.

    Raises:
      ConfigError: an unknown name, or ``"wandb"`` without wandb installed, in one
        line that says what to do.

    >>> check_writers(["tensorboard"])
    ('tensorboard',)
    """
    if isinstance(writers, str):
        raise ConfigError(
            f"writers is a sequence of names, e.g. ('tensorboard', 'wandb'), not {writers!r}"
        )
    unknown = [w for w in writers if w not in WRITERS]
    if unknown:
        raise ConfigError(f"writers has {unknown}; the writers are {', '.join(map(repr, WRITERS))}")
    if "wandb" in writers:
        from replicator.trainer.wandb_writer import check_wandb

        check_wandb()
    return tuple(writers)


class MetricWriter:
    """Appends metric records to ``WORKDIR/metrics.jsonl``, TensorBoard events and W&B.

    Only process 0 writes; on other processes every call is a no-op.

    Args:
      workdir: the run's directory.
      resume_step: the step a run starts from (0 for a fresh run). Records of
        later steps (written before an interruption, and about to be redone) are
        dropped from the JSONL file and the TensorBoard event files, and a
        restart marker at ``resume_step + 1`` begins the new event file, so the
        history reads as if the run had never stopped (W&B, whose history cannot
        be cut, is sent only steps after the last one written before). None only
        appends (a sidecar evaluator).
      enabled: whether to write (default: on process 0 only).
      name: the JSONL file's name in ``workdir``.
      writers: where records go besides ``metrics.jsonl``: "tensorboard" (events in
        ``workdir/tensorboard``) and "wandb" (a Weights & Biases run, see
        `replicator.trainer.wandb_writer`); checked by `check_writers`.
      config: the run's config, for W&B.
      wandb_project: the W&B project (default: ``$WANDB_PROJECT``, else "replicator").
    """

    def __init__(
        self,
        workdir: str,
        *,
        resume_step: int | None = 0,
        enabled: bool | None = None,
        name: str = "metrics.jsonl",
        writers: Sequence[str] = ("tensorboard",),
        config: Mapping[str, Any] | None = None,
        wandb_project: str | None = None,
    ):
        writers = check_writers(writers)
        self.enabled = jax.process_index() == 0 if enabled is None else enabled
        self._jsonl = self._tensorboard = self._wandb = None
        self._wandb_after: int | None = None  # W&B has the steps up to this one
        self._write_s = 0.0
        if not self.enabled:
            return
        storage.makedirs(workdir)
        events = storage.join(workdir, "tensorboard")
        self._mirror = storage.Mirror(storage.join(workdir, name))
        kept, reported = [], None  # the records a resumed run keeps; the last step written
        if resume_step is not None:
            kept, reported = _drop_records_after(self._mirror.local_path, resume_step)
            if "tensorboard" in writers:
                _drop_events_after(events, resume_step)
            self._mirror.sync()
        self._jsonl = open(self._mirror.local_path, "a")
        if "tensorboard" in writers:
            self._tensorboard = _EventFile(
                events, restart_step=None if resume_step is None else resume_step + 1
            )
        if "wandb" in writers:
            self._start_wandb(workdir, config, wandb_project, kept, reported)

    def _start_wandb(self, workdir, config, project, kept, reported) -> None:
        from replicator.trainer.wandb_writer import WandbRun

        self._wandb = WandbRun(workdir, config=config, project=project)
        if not self._wandb.created:
            self._wandb_after = reported  # redone steps: W&B keeps what it has
        elif kept:  # W&B turned on for a run under way: it gets the records so far
            for record in sorted(kept, key=lambda r: r.get("step", 0)):
                self._wandb.log(record.get("step", 0), _scalars(record))

    def write(self, step: int, metrics: Mapping[str, Any], *, split: str | None = None) -> None:
        """Writes one record: ``{"step": step, "split": split, **metrics}``."""
        if not self.enabled:
            return
        start = time.perf_counter()
        record = {"step": int(step), **({"split": split} if split else {})}
        record.update({k: _to_python(v) for k, v in metrics.items()})
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        scalars = _scalars(record)
        if self._tensorboard is not None:
            self._tensorboard.write_scalars(int(step), scalars)
        if self._wandb is not None and split == "summary":
            self._wandb.update_summary(
                {f"summary/{k}": v for k, v in record.items() if k not in ("step", "split")}
            )
        elif self._wandb is not None and (self._wandb_after is None or step > self._wandb_after):
            self._wandb.log(int(step), scalars)
        self._write_s += time.perf_counter() - start

    @property
    def write_seconds(self) -> float:
        """Time the caller spent in `write` (uploads to a bucket run in the background)."""
        return self._write_s

    @property
    def upload_seconds(self) -> float:
        """Time spent uploading to a bucket, off the caller's thread (0 for local files)."""
        if not self.enabled:
            return 0.0
        events = self._tensorboard.mirror.upload_seconds if self._tensorboard else 0.0
        return self._mirror.upload_seconds + events

    def sync(self) -> None:
        """Puts every record written so far in the workdir's bucket (local files: nothing
        to do); the trainer's checkpoint saves call it, from Orbax's thread, before
        they commit."""
        if self.enabled:
            self._mirror.sync()
            if self._tensorboard is not None:
                self._tensorboard.mirror.sync()

    def close(self) -> None:
        if self.enabled:
            self._jsonl.close()
            for writer in (self._tensorboard, self._wandb):
                if writer is not None:
                    writer.close()
            self._mirror.close()


class _EventFile:
    """A TensorBoard event file of this run, written as records arrive (tensorboardX's
    SummaryWriter queues them for a thread, which a kill -9 can lose).

    Files are named ``events.out.tfevents.<seconds>.<host>.<nanoseconds>``: unique
    even for runs started within one second, and in the order of the runs
    (loaders read them in name order).
    """

    def __init__(self, directory: str, *, restart_step: int | None):
        from tensorboardX.proto.event_pb2 import Event, SessionLog

        storage.makedirs(directory)
        now = time.time_ns()
        name = f"events.out.tfevents.{now // 10**9:010d}.{socket.gethostname()}.{now}"
        self.mirror = storage.Mirror(storage.join(directory, name), keep=False)
        self._file = open(self.mirror.local_path, "ab")
        self._write(Event(wall_time=time.time(), file_version="brain.Event:2"))
        if restart_step is not None:
            start = SessionLog(status=SessionLog.START)
            self._write(Event(wall_time=time.time(), step=restart_step, session_log=start))

    def write_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        from tensorboardX.proto.event_pb2 import Event
        from tensorboardX.proto.summary_pb2 import Summary

        values = [Summary.Value(tag=tag, simple_value=value) for tag, value in scalars.items()]
        self._write(Event(wall_time=time.time(), step=step, summary=Summary(value=values)))

    def close(self) -> None:
        self._file.close()
        self.mirror.close()

    def _write(self, event) -> None:
        from tensorboardX.record_writer import masked_crc32c

        data = event.SerializeToString()
        header = struct.pack("<Q", len(data))
        crcs = struct.pack("<I", masked_crc32c(header)), struct.pack("<I", masked_crc32c(data))
        self._file.write(header + crcs[0] + data + crcs[1])
        self._file.flush()


def _scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """A record's numbers under the names TensorBoard and W&B show: ``split/metric``."""
    split = record.get("split") or "train"
    return {
        f"{split}/{key}": value
        for key, value in record.items()
        if key not in ("step", "split") and isinstance(value, int | float)
    }


def _drop_records_after(path: str, step: int) -> tuple[list[dict[str, Any]], int | None]:
    """Cuts the JSONL file back to the records of steps <= ``step`` (summaries and torn
    lines dropped). Returns the records kept and the last step the file had (or None)."""
    if not os.path.exists(path):
        return [], None
    with open(path) as f:
        lines = f.readlines()
    keep, last = [], None
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line torn by a crash
        if record.get("split") == "summary":
            continue
        last = max(last or 0, record.get("step", 0))
        if record.get("step", 0) <= step:
            keep.append(record)
    if len(keep) != len(lines):
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            f.writelines(json.dumps(record) + "\n" for record in keep)
        os.replace(tmp, path)
    return keep, last


def _drop_events_after(directory: str, step: int) -> None:
    """Cuts every TensorBoard event file in ``directory`` (local or a bucket) back to the
    events of steps <= ``step``, and drops a record torn by a crash."""
    from google.protobuf.message import DecodeError
    from tensorboardX.proto.event_pb2 import Event

    for name in storage.listdir(directory):
        path = storage.join(directory, name)
        if not name.startswith("events.out.tfevents") or storage.isdir(path):
            continue
        data = storage.read_bytes(path)
        keep = []
        for raw, payload in _framed_records(data):
            try:
                event = Event.FromString(payload)
            except DecodeError:
                break  # garbled: nothing after it can be trusted
            if event.step <= step:
                keep.append(raw)
        if sum(map(len, keep)) != len(data):
            storage.write_bytes(path, b"".join(keep))


def _framed_records(data: bytes):
    """``(record, payload)`` for each TFRecord of ``data`` up to the first torn one: a
    little-endian uint64 length, its masked CRC32C, the payload, the payload's CRC."""
    from tensorboardX.record_writer import masked_crc32c

    pos = 0
    while pos + 12 <= len(data):
        header = data[pos : pos + 8]
        (header_crc,) = struct.unpack("<I", data[pos + 8 : pos + 12])
        end = pos + 12 + struct.unpack("<Q", header)[0] + 4
        if end > len(data) or header_crc != masked_crc32c(header):
            return
        yield data[pos:end], data[pos + 12 : end - 4]
        pos = end


def _to_python(value: Any) -> Any:
    if isinstance(value, jax.Array | np.ndarray | np.generic):
        value = np.asarray(value).item()
    return value
