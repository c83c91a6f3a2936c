"""tfds datasets in a bucket: read through a local copy, published by upload.

tfds reads and writes a dataset's metadata through etils `epath`, so a
``gs://`` data_dir works for it; the array_record files are another matter.
They are written by ArrayRecord's C++ writer, which cannot create a ``gs://``
file (google/array_record#120), and read by its C++ reader, which reaches GCS
only through its own client: its own credentials and endpoint variable, no
deadline (with no server it waits for good), and a request per record read
with the readahead tfds turns off for random access. So a dataset in a bucket
is never handed to ArrayRecord: each machine reads a copy on its own disk (pod
workers share none) and a dataset is prepared on a disk, then uploaded.

* A copy is the dataset's prepared version directory
  (``DATA_DIR/NAME/CONFIG/VERSION``), not the whole data_dir, kept under
  ``CACHE_DIR/BUCKET/PATH``. It is made once per machine: `fill_once` holds a
  file lock while it fills the directory, so the other processes of the
  machine wait and then reuse it, and writes a marker file last, so a copy cut
  short (a kill, a full disk) is redone from scratch by the next open.
* `upload` writes a version directory's data files first and the metadata
  tfds' ``is_prepared()`` looks for last, so a reader sees the dataset as
  prepared only once every file of it is in the bucket.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterator

from replicator import storage

# tfds takes a version directory holding these as prepared (`is_valid_variant_dir`).
METADATA_FILES = ("features.json", "dataset_info.json")
COMPLETE_MARKER = ".replicator-copy-complete"


def default_cache_dir() -> str:
    """Where copies of bucket datasets live: ``$XDG_CACHE_HOME/replicator/tfds``
    (``~/.cache/replicator/tfds`` by default)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "replicator", "tfds")


def local_path(url: str, cache_dir: str | os.PathLike | None = None) -> str:
    """The local place of bucket path ``url`` in the cache: ``CACHE_DIR/BUCKET/PATH``.

    >>> local_path("gs://my-bucket/tfds/digits/1.0.0", cache_dir="/cache")
    '/cache/my-bucket/tfds/digits/1.0.0'
    """
    url = storage.normalize(url)
    if not storage.is_remote(url):
        raise ValueError(f"{url} is not in a bucket")
    relative = url.split("://", 1)[1]
    root = storage.normalize(cache_dir if cache_dir is not None else default_cache_dir())
    return os.path.join(root, *relative.split("/"))


def is_complete(local_dir: str | os.PathLike) -> bool:
    """Whether ``local_dir`` holds a finished copy (its marker was written)."""
    return os.path.isfile(os.path.join(local_dir, COMPLETE_MARKER))


def fill_once(
    url: str, fill: Callable[[str], None], *, cache_dir: str | os.PathLike | None = None
) -> str:
    """The local copy of bucket directory ``url``, made by ``fill`` unless made before.

    On each machine the first caller fills the directory; callers there at the
    same time (other processes of the run) wait for it and reuse its copy. A
    directory without its marker (a copy cut short) is removed and filled anew.

    Args:
      url: the bucket directory the copy stands for.
      fill: called with the (absent) local directory; must create it.
      cache_dir: the root of the copies (default `default_cache_dir`).

    Returns:
      The local directory, complete.
    """
    local_dir = local_path(url, cache_dir)
    if is_complete(local_dir):
        return local_dir
    with _machine_lock(local_dir, cache_dir):
        if is_complete(local_dir):  # made by another process while this one waited
            return local_dir
        if os.path.lexists(local_dir):
            shutil.rmtree(local_dir)
        fill(local_dir)
        if not os.path.isdir(local_dir):
            raise RuntimeError(f"Filling {local_dir} (a copy of {url}) left no directory there.")
        marker = {"source": storage.normalize(url), "files": _local_files(local_dir)}
        storage.write_text(os.path.join(local_dir, COMPLETE_MARKER), json.dumps(marker))
    return local_dir


def is_uploaded(url: str) -> bool:
    """Whether bucket directory ``url`` holds a prepared tfds version (its metadata files)."""
    return all(storage.isfile(storage.join(url, name)) for name in METADATA_FILES)


def download(url: str, local_dir: str | os.PathLike) -> None:
    """Copies every file under bucket directory ``url`` into ``local_dir``, the metadata
    last (as `upload` does)."""
    for name in _metadata_last(list_files(url)):
        storage.write_bytes(
            os.path.join(local_dir, *name.split("/")),
            storage.read_bytes(storage.join(url, *name.split("/"))),
        )


def upload(local_dir: str | os.PathLike, url: str) -> None:
    """Copies version directory ``local_dir`` to bucket directory ``url``, the metadata
    that makes tfds take it as prepared last (a reader never sees half of it)."""
    names = [name for name in _local_files(local_dir) if name != COMPLETE_MARKER]
    for name in _metadata_last(names):
        with open(os.path.join(local_dir, *name.split("/")), "rb") as f:
            storage.write_bytes(storage.join(url, *name.split("/")), f.read())


def list_files(url: str) -> list[str]:
    """Every file under bucket directory ``url``, as sorted paths relative to it."""
    import fsspec

    root = storage.normalize(url).split("://", 1)[1]
    fs = fsspec.filesystem("gcs")

    def find() -> list[str]:
        # Listings are cached per process: another process may have uploaded since.
        fs.invalidate_cache(root)
        return fs.find(root)

    return sorted(p[len(root) + 1 :] for p in storage.call("list", url, find))


def _metadata_last(names: list[str]) -> list[str]:
    return sorted(names, key=lambda n: METADATA_FILES.index(n) + 1 if n in METADATA_FILES else 0)


def _local_files(local_dir: str | os.PathLike) -> list[str]:
    found = []
    for root, _, files in os.walk(local_dir):
        relative = os.path.relpath(root, local_dir)
        parts = [] if relative == "." else relative.split(os.sep)
        found += ["/".join([*parts, name]) for name in files]
    return sorted(found)


@contextlib.contextmanager
def _machine_lock(local_dir: str, cache_dir: str | os.PathLike | None) -> Iterator[None]:
    # Kept apart from the copies, where tfds would take the file for a version. The
    # kernel releases the lock of a process that dies.
    root = storage.normalize(cache_dir if cache_dir is not None else default_cache_dir())
    locks = os.path.join(root, ".locks")
    os.makedirs(locks, exist_ok=True)
    name = hashlib.sha256(local_dir.encode()).hexdigest()[:24]
    with open(os.path.join(locks, f"{name}.lock"), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
