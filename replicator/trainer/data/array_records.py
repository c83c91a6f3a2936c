"""array_record files of one's own: one example a record, written and read without tfds.

A record holds one example, a dict of numpy arrays (nested dicts, numbers and
strings too), serialized by flax's msgpack (`flax.serialization.msgpack_serialize`):
each array keeps its dtype and shape, a record costs a few bytes beyond its
arrays and decodes in microseconds, and there is no schema to declare. Write
files with `write_array_records` (or ``msgpack_serialize`` and ArrayRecord's own
writer); read them with `ArrayRecordSource`, or name them in a config as
``dataset='array_record:/data/mine/{split}-*.array_record'``.

Files written another way (tfds' ``tf.train.Example`` records, protos of your
own) are not this format: a tfds dataset is read by its name, and anything else
by a function source (``'module:function'``) whose ``__getitem__`` decodes them.

Files in a bucket (``gs://``) are read from a copy on this machine's disk, made
once per machine by the first process to ask (`remote.fill_once`), as tfds data
in a bucket is: ArrayRecord's reader reaches GCS only through its own client
(its own credentials and endpoint, no deadline) and issues one request per
record for random access (`replicator.trainer.data.remote`). The copy is keyed
by the files' names, sizes and checksums, so changed files are copied anew.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from collections.abc import Iterable, Sequence
from typing import Any

import grain
from array_record.python.array_record_module import ArrayRecordWriter
from flax import serialization

from replicator import storage
from replicator.errors import DatasetError
from replicator.trainer.data import remote
from replicator.trainer.data.records import Example

_WILDCARDS = "*?["
# One record per chunk: the fastest random access (grain's advice for ArrayRecord).
_WRITER_OPTIONS = "group_size:1"


def encode_example(example: Example) -> bytes:
    """Serializes one example (a dict of arrays) into a record.

    >>> import numpy as np
    >>> record = encode_example({"x": np.arange(3, dtype=np.float32), "y": np.int64(1)})
    >>> decode_example(record)["x"].tolist()
    [0.0, 1.0, 2.0]
    """
    if not isinstance(example, dict):
        raise TypeError(f"an example is a dict of arrays, not a {type(example).__name__}")
    return serialization.msgpack_serialize(example)


def decode_example(record: bytes) -> Example:
    """The example that `encode_example` serialized into ``record``."""
    example = serialization.msgpack_restore(record)
    if not isinstance(example, dict):
        raise ValueError(f"the record holds a {type(example).__name__}, not a dict")
    return example


def write_array_records(path: str | os.PathLike, examples: Iterable[Example]) -> int:
    """Writes ``examples`` to one array_record file, one record each, in order.

    Split a large data set over several files (``train-00000-of-00004.array_record``,
    ...): a source reads them in the order of their sorted names, as one.

    Args:
        path: a local file to create (ArrayRecord cannot write to a bucket: write
            here, then ``gcloud storage cp`` the files).
        examples: dicts of numpy arrays (or numbers, strings, nested dicts); every
            example of a split needs the same keys, shapes and dtypes.

    Returns:
        How many examples were written.

    >>> import tempfile
    >>> import numpy as np
    >>> tmp_dir = tempfile.TemporaryDirectory()
    >>> path = os.path.join(tmp_dir.name, "train-00000-of-00001.array_record")
    >>> write_array_records(path, ({"x": np.full(2, i, np.int32)} for i in range(5)))
    5
    >>> source = ArrayRecordSource(os.path.join(tmp_dir.name, "train-*.array_record"))
    >>> len(source), source[3]["x"].tolist()
    (5, [3, 3])
    >>> tmp_dir.cleanup()
    """
    path = os.fspath(path)
    if storage.is_remote(path):
        raise ValueError(
            f"cannot write {path}: ArrayRecord writes local files only; write them here, "
            "then copy them into the bucket (gcloud storage cp)."
        )
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    writer = ArrayRecordWriter(path, _WRITER_OPTIONS)
    count = 0
    try:
        for example in examples:
            writer.write(encode_example(example))
            count += 1
    finally:
        writer.close()
    return count


class ArrayRecordSource(Sequence[Example]):
    """Examples stored one per record in array_record files (`write_array_records`).

    A random-access source like a tfds split: ``len(source)``, ``source[i]`` (a
    dict of numpy arrays) and ``source.__getitems__(indices)``, which reads the
    records with one call. The files are read in the order of their sorted
    names, as one sequence.

    Args:
        paths: a file, a glob pattern (``/data/train-*.array_record``), or a list
            of them; local or ``gs://`` (copied to this machine first, see above).
        cache_dir: where copies of files in a bucket go (default
            ``$XDG_CACHE_HOME/replicator/tfds``, as for tfds data).

    Raises:
        DatasetError: no file matches, or a file is not an array_record file.
        replicator.storage.StorageError: a bucket that does not exist or answer.
    """

    def __init__(
        self,
        paths: str | os.PathLike | Sequence[str | os.PathLike],
        *,
        cache_dir: str | os.PathLike | None = None,
    ):
        patterns = [os.fspath(paths)] if isinstance(paths, (str, os.PathLike)) else paths
        self._patterns = [os.fspath(p) for p in patterns]
        self._files = [f for p in self._patterns for f in _local_files(p, cache_dir)]
        try:
            self._records = grain.sources.ArrayRecordDataSource(self._files)
        except (RuntimeError, ValueError, OSError) as e:
            raise DatasetError(f"cannot read {self._described()} as array_record: {e}") from e

    def __len__(self) -> int:
        return len(self._records)

    def __getitem__(self, index: int) -> Example:  # type: ignore[override]
        if not -len(self) <= index < len(self):
            raise IndexError(f"index {index} is out of range for {len(self)} records")
        return self._decode(self._records[index % len(self)], index)

    def __getitems__(self, indices: Sequence[int]) -> list[Example]:
        """The examples at ``indices``, their records read with one call."""
        indices = [int(i) for i in indices]
        records = self._records.__getitems__(indices)
        return [self._decode(record, i) for record, i in zip(records, indices)]

    def _decode(self, record: bytes, index: int) -> Example:
        try:
            return decode_example(record)
        except Exception as e:  # noqa: BLE001  (msgpack raises many kinds)
            raise DatasetError(
                f"record {index} of {self._described()} is not an example written by "
                f"write_array_records (flax msgpack of a dict of arrays): "
                f"{type(e).__name__}: {e}. Files of tfds are read by their tfds name; "
                "other formats by a function source that decodes them."
            ) from e

    def _described(self) -> str:
        shown = ", ".join(self._patterns)
        return f"{shown} ({len(self._files)} file{'s' * (len(self._files) != 1)})"

    def __repr__(self) -> str:
        return f"ArrayRecordSource({self._described()})"


def _local_files(pattern: str, cache_dir: str | os.PathLike | None) -> list[str]:
    """The local files ``pattern`` stands for, sorted: bucket files through this
    machine's copy."""
    if storage.is_remote(pattern):
        return _bucket_copy(storage.normalize(pattern), cache_dir)
    files = sorted(glob.glob(os.path.expanduser(pattern), recursive=True))
    files = [f for f in files if os.path.isfile(f)]
    if not files:
        raise DatasetError(f"no array_record file matches {pattern!r}")
    return files


def _bucket_copy(pattern: str, cache_dir: str | os.PathLike | None) -> list[str]:
    found = _bucket_glob(pattern)
    # The part of the pattern before its first wildcard: the copy mirrors what is below it.
    fixed = pattern[: min((pattern.find(c) for c in _WILDCARDS if c in pattern), default=None)]
    parent = fixed.rsplit("/", 1)[0]
    names = [url[len(parent) + 1 :] for url in found]
    digest = hashlib.sha256(
        json.dumps([pattern, sorted(found.items())], sort_keys=True).encode()
    ).hexdigest()[:16]

    def fill(local_dir: str) -> None:
        for url, name in zip(found, names):
            storage.write_bytes(os.path.join(local_dir, *name.split("/")), storage.read_bytes(url))

    copy_url = storage.join(parent, f".array_record-{digest}")
    local_dir = remote.fill_once(copy_url, fill, cache_dir=cache_dir)
    return [os.path.join(local_dir, *name.split("/")) for name in names]


def _bucket_glob(pattern: str) -> dict[str, Any]:
    """``{url: what identifies its content}`` of the bucket files matching ``pattern``."""
    import fsspec

    storage.check_bucket(pattern)
    fs = fsspec.filesystem("gcs")

    def find() -> dict[str, Any]:
        fs.invalidate_cache()  # another process may have uploaded files since
        if not any(c in pattern for c in _WILDCARDS):
            return {pattern.split("://", 1)[1]: fs.info(pattern)}
        return fs.glob(pattern, detail=True)

    try:
        details = storage.call("list", pattern, find)
    except FileNotFoundError:
        details = {}
    found = {
        f"gs://{name}": [info.get("size"), info.get("md5Hash") or info.get("etag")]
        for name, info in sorted(details.items())
        if info.get("type", "file") == "file"
    }
    if not found:
        raise DatasetError(f"no array_record file matches {pattern!r}")
    return found
