"""Metric records: ``WORKDIR/metrics.jsonl`` and TensorBoard events, process 0 only.

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
"""

from __future__ import annotations

import json
import os
import socket
import struct
import time
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from replicator import storage


class MetricWriter:
    """Appends metric records to ``WORKDIR/metrics.jsonl`` and TensorBoard events.

    Only process 0 writes; on other processes every call is a no-op.

    Args:
      workdir: the run's directory.
      resume_step: the step a run starts from (0 for a fresh run). Records of
        later steps (written before an interruption, and about to be redone) are
        dropped from the JSONL file and the TensorBoard event files, and a
        restart marker at ``resume_step + 1`` begins the new event file, so the
        history reads as if the run had never stopped. None only appends (a
        sidecar evaluator).
      enabled: whether to write (default: on process 0 only).
      name: the JSONL file's name in ``workdir``.
    """

    def __init__(
        self,
        workdir: str,
        *,
        resume_step: int | None = 0,
        enabled: bool | None = None,
        name: str = "metrics.jsonl",
    ):
        self.enabled = jax.process_index() == 0 if enabled is None else enabled
        self._jsonl = self._tensorboard = None
        self._write_s = 0.0
        if self.enabled:
            storage.makedirs(workdir)
            events = storage.join(workdir, "tensorboard")
            self._mirror = storage.Mirror(storage.join(workdir, name))
            if resume_step is not None:
                _drop_records_after(self._mirror.local_path, resume_step)
                _drop_events_after(events, resume_step)
                self._mirror.sync()
            self._jsonl = open(self._mirror.local_path, "a")
            self._tensorboard = _EventFile(
                events, restart_step=None if resume_step is None else resume_step + 1
            )

    def write(self, step: int, metrics: Mapping[str, Any], *, split: str | None = None) -> None:
        """Writes one record: ``{"step": step, "split": split, **metrics}``."""
        if not self.enabled:
            return
        start = time.perf_counter()
        record = {"step": int(step), **({"split": split} if split else {})}
        record.update({k: _to_python(v) for k, v in metrics.items()})
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        scalars = {
            f"{split or 'train'}/{key}": value
            for key, value in record.items()
            if key not in ("step", "split") and isinstance(value, int | float)
        }
        self._tensorboard.write_scalars(int(step), scalars)
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
        return self._mirror.upload_seconds + self._tensorboard.mirror.upload_seconds

    def sync(self) -> None:
        """Puts every record written so far in the workdir's bucket (local files: nothing
        to do); the trainer's checkpoint saves call it, from Orbax's thread, before
        they commit."""
        if self.enabled:
            self._mirror.sync()
            self._tensorboard.mirror.sync()

    def close(self) -> None:
        if self.enabled:
            self._jsonl.close()
            self._tensorboard.close()
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
