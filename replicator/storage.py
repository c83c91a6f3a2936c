"""Storage: every path a run reads or writes, on a local disk or a ``gs://`` bucket.

Pod workers share no disk, so a run's workdir, its checkpoints and its data may
live in a bucket. This module is the one place that knows the difference. It
stands on maintained libraries: etils `epath` for paths (the same paths tfds
and Orbax use), gcsfs under fsspec for ``gs://``, and Orbax's tensorstore for
checkpoint arrays (which takes ``gs://`` URLs natively). Local paths behave as
plain files always have.

Object stores have no append. A file that grows while a run writes it (the
metrics, the TensorBoard events, the log) is therefore a `Mirror`: written and
flushed locally, record by record, as on a local disk, and uploaded whole to its
object by a background thread, every few seconds and whenever asked. An upload
replaces the object atomically: a reader sees the previous version or the new
one, never a torn one. The trainer asks for an upload (and waits for it) when it
saves a checkpoint, so that a run killed at any moment has on the bucket every
record up to the checkpoint it will resume from; the records after it are
redone on resume anyway.

Tests point gcsfs and tensorstore at a local GCS server through their own
variables (``STORAGE_EMULATOR_HOST``, ``TENSORSTORE_GCS_HTTP_URL``); nothing here
is specific to tests.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
import threading
import time
import uuid
import weakref
from collections.abc import Callable
from typing import TypeVar

from etils import epath

from replicator.errors import StorageError as StorageError

log = logging.getLogger("replicator")
T = TypeVar("T")


def _without_bucket_type_notice(record: logging.LogRecord) -> bool:
    # gcsfs asks a second API (storage control) for the bucket's layout and, where
    # that API is out of reach, falls back to plain GCS calls with a warning per
    # bucket: a fallback that works, not something for the user to act on.
    return not str(record.msg).startswith("Could not determine bucket type")


logging.getLogger("gcsfs").addFilter(_without_bucket_type_notice)

REMOTE_PREFIXES = ("gs://",)
# Every call to the bucket gives up after this long, retries included: a missing
# bucket, a bucket one cannot write or a server that does not answer ends in one
# line, not a hang.
DEADLINE_S = 60.0
_RETRY_DELAYS_S = (0.5, 1.0, 2.0, 4.0, 8.0)


def is_remote(path: str | os.PathLike) -> bool:
    """Whether ``path`` is in an object store (``gs://...``) rather than on a local disk.

    >>> is_remote("gs://bucket/runs/a"), is_remote("runs/a")
    (True, False)
    """
    return os.fspath(path).startswith(REMOTE_PREFIXES)


def normalize(path: str | os.PathLike) -> str:
    """``path`` as the one string every layer uses: a local path made absolute, a
    bucket URL unchanged but for trailing slashes.

    >>> normalize("gs://bucket/runs/a/")
    'gs://bucket/runs/a'
    """
    text = os.fspath(path)
    if is_remote(text):
        return text.rstrip("/")
    return os.path.abspath(os.path.expanduser(text))


def path(p: str | os.PathLike) -> epath.Path:
    """An `etils.epath.Path` for a local path or a ``gs://`` URL (through gcsfs)."""
    return epath.Path(normalize(p))


def join(base: str | os.PathLike, *parts: str) -> str:
    """``base/part/...`` for a local path or a bucket URL.

    >>> join("gs://bucket/run", "checkpoints", "10")
    'gs://bucket/run/checkpoints/10'
    """
    base = normalize(base)
    if is_remote(base):
        return "/".join([base, *parts])
    return os.path.join(base, *parts)


def bucket_of(url: str) -> str:
    """The bucket of a ``gs://`` URL: ``gs://bucket/a/b`` -> ``bucket``."""
    return url.split("://", 1)[1].split("/", 1)[0]


# ---------------------------------------------------------------- calls with a deadline


def call(what: str, url: str, fn: Callable[[], T], *, deadline_s: float | None = None) -> T:
    """``fn()``, retried on transient errors, for at most ``deadline_s`` seconds.

    Local paths run ``fn`` once, as plain file code would. For a bucket, errors
    that retrying cannot fix (a missing object, no permission, a missing bucket)
    raise at once; others (a server that does not answer, a dropped connection)
    are retried with backoff until the deadline. Either way the error is a
    `StorageError` naming ``url`` and what was being done, in one line.

    Args:
      what: what the call does, for the message, e.g. ``"write"``.
      url: the path it works on.
      fn: the call.
      deadline_s: the time allowed, retries included (default `DEADLINE_S`).

    Returns:
      What ``fn`` returns.
    """
    if not is_remote(url):
        return fn()
    start = time.monotonic()
    deadline = start + (DEADLINE_S if deadline_s is None else deadline_s)
    for attempt in range(len(_RETRY_DELAYS_S) + 1):
        remaining = deadline - time.monotonic()
        try:
            return _with_timeout(fn, remaining)
        except FileNotFoundError:
            raise
        except _BucketMissing as e:
            raise StorageError(f"cannot {what} {url}: {e}") from e
        except PermissionError as e:
            raise StorageError(f"cannot {what} {url}: {_reason(e)}") from e
        except Exception as e:  # noqa: BLE001  (gcsfs/aiohttp raise many kinds)
            if _is_permanent(e):
                raise StorageError(f"cannot {what} {url}: {_reason(e)}") from e
            error = e
        if (
            attempt == len(_RETRY_DELAYS_S)
            or time.monotonic() + _RETRY_DELAYS_S[attempt] > deadline
        ):
            break
        time.sleep(_RETRY_DELAYS_S[attempt])
    raise StorageError(
        f"cannot {what} {url}: the storage service did not answer ({attempt + 1} tries in "
        f"{time.monotonic() - start:.0f} s; last: {_reason(error)})"
    ) from error


class _BucketMissing(Exception):
    pass


def _with_timeout(fn: Callable[[], T], timeout_s: float) -> T:
    """``fn()`` in a helper thread, abandoned after ``timeout_s`` (a hung socket)."""
    if timeout_s <= 0:
        raise TimeoutError("deadline passed")
    result: dict = {}

    def target():
        try:
            result["value"] = fn()
        except BaseException as e:  # noqa: BLE001  (re-raised in the caller)
            result["error"] = e

    thread = threading.Thread(target=target, daemon=True, name="replicator-storage-call")
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise TimeoutError(f"no answer in {timeout_s:.0f} s")
    if "error" in result:
        raise result["error"]
    return result["value"]


def _is_permanent(error: Exception) -> bool:
    code = getattr(error, "code", None) or getattr(error, "status", None)
    if isinstance(code, int):
        return code in (400, 401, 403, 404)
    return _forbidden(error)


def _forbidden(error: BaseException) -> bool:
    """gcsfs's 403: a plain OSError, "Forbidden: URL" then the service's message."""
    return type(error) is OSError and str(error).startswith("Forbidden:")


def _reason(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    if _forbidden(error) and len(lines) > 1:
        return f"permission denied: {lines[1][:300]}"  # the service says who lacks what
    text = lines[0][:200] if lines else ""
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


# ---------------------------------------------------------------- whole files


def exists(p: str | os.PathLike) -> bool:
    """Whether a file or directory exists at ``p`` (bounded for a bucket)."""
    p = normalize(p)
    return call("read", p, lambda: path(p).exists())


def isdir(p: str | os.PathLike) -> bool:
    """Whether ``p`` is a directory (a prefix with objects under it, in a bucket)."""
    p = normalize(p)
    return call("read", p, lambda: path(p).is_dir())


def isfile(p: str | os.PathLike) -> bool:
    """Whether ``p`` is a file (an object, in a bucket)."""
    p = normalize(p)
    return call("read", p, lambda: path(p).is_file())


def read_bytes(p: str | os.PathLike) -> bytes:
    """The contents of file ``p``; FileNotFoundError when there is none."""
    p = normalize(p)
    return call("read", p, lambda: path(p).read_bytes())


def read_text(p: str | os.PathLike) -> str:
    """The contents of text file ``p``; FileNotFoundError when there is none."""
    return read_bytes(p).decode()


def write_bytes(p: str | os.PathLike, data: bytes) -> None:
    """Replaces file ``p`` with ``data`` atomically: a reader (or a crash) sees the
    old contents or the new, never a part. Parent directories are created."""
    p = normalize(p)
    if is_remote(p):  # one object upload is atomic
        try:
            call("write", p, lambda: path(p).write_bytes(data))
        except FileNotFoundError as e:  # gcsfs' answer for a missing bucket
            raise StorageError(f"cannot write {p}: no such bucket gs://{bucket_of(p)}") from e
        return
    os.makedirs(os.path.dirname(p), exist_ok=True)
    tmp = f"{p}.{uuid.uuid4().hex[:8]}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, p)


def write_text(p: str | os.PathLike, text: str) -> None:
    """`write_bytes` of ``text`` in UTF-8."""
    write_bytes(p, text.encode())


def makedirs(p: str | os.PathLike) -> None:
    """Creates directory ``p`` and its parents (nothing to do in a bucket)."""
    p = normalize(p)
    if not is_remote(p):
        os.makedirs(p, exist_ok=True)


def listdir(p: str | os.PathLike) -> list[str]:
    """The names in directory ``p``, sorted; [] when it does not exist."""
    p = normalize(p)
    if not is_remote(p):
        return sorted(os.listdir(p)) if os.path.isdir(p) else []
    found = call("list", p, lambda: [c.name for c in path(p).iterdir()] if path(p).is_dir() else [])
    return sorted(found)


def copy_tree(source: str | os.PathLike, destination: str | os.PathLike) -> None:
    """Copies directory ``source`` into ``destination`` (created), file by file, between
    any two of local disk and bucket. Files are written whole (atomically each)."""
    source, destination = normalize(source), normalize(destination)
    if not is_remote(source) and not is_remote(destination):
        shutil.copytree(source, destination, dirs_exist_ok=True)
        return
    top = _without_scheme(source)
    for root, _, files in call("list", source, lambda: list(path(source).walk())):
        # epath walks a bucket with scheme-less roots ("bucket/a/b"), a disk with paths.
        relative = _without_scheme(os.fspath(root))[len(top) :].strip("/")
        parts = relative.split("/") if relative else []
        for name in files:
            write_bytes(join(destination, *parts, name), read_bytes(join(source, *parts, name)))


def move(source: str | os.PathLike, destination: str | os.PathLike) -> None:
    """Moves file or directory ``source`` to ``destination`` (parents created). In a
    bucket, where directories are name prefixes, every object under ``source`` is
    copied, then deleted."""
    source, destination = normalize(source), normalize(destination)
    if not is_remote(source):
        os.makedirs(os.path.dirname(destination), exist_ok=True)
        os.rename(source, destination)
        return
    # Through epath, whose gcsfs instance (and listing cache) Orbax shares.
    copy_tree(source, destination)
    call("remove", source, lambda: path(source).rmtree())


def _without_scheme(p: str) -> str:
    return p.split("://", 1)[1] if "://" in p else p


def check_writable(directory: str | os.PathLike, *, deadline_s: float | None = None) -> None:
    """Fails fast, in one line, when a run could not write into ``directory``.

    For a bucket: the bucket exists, an object can be written under
    ``directory`` and removed again (a uniquely named probe, so nothing already
    there is touched), all within the deadline. Local directories are left to
    the code that creates them.

    Raises:
      StorageError: no such bucket, no permission, or no answer in time.
    """
    directory = normalize(directory)
    if not is_remote(directory):
        return
    check_bucket(directory, deadline_s=deadline_s)
    probe = join(directory, f".replicator-write-check-{uuid.uuid4().hex[:12]}")
    call("write to", directory, lambda: path(probe).write_bytes(b""), deadline_s=deadline_s)
    call("write to", directory, lambda: path(probe).unlink(), deadline_s=deadline_s)


def check_bucket(url: str | os.PathLike, *, deadline_s: float | None = None) -> None:
    """Fails fast, in one line, when the bucket of ``url`` does not exist or does not
    answer (nothing to do for a local path).

    Raises:
      StorageError: no such bucket, no permission, or no answer in time.
    """
    url = normalize(url)
    if not is_remote(url):
        return
    bucket = bucket_of(url)

    def look():
        import fsspec

        try:
            fsspec.filesystem("gcs").info(bucket)
        except FileNotFoundError as e:
            raise _BucketMissing(
                f"no such bucket gs://{bucket} (create it: gcloud storage buckets create "
                f"gs://{bucket})"
            ) from e

    call("reach", url, look, deadline_s=deadline_s)


# ---------------------------------------------------------------- growing files


class Mirror:
    """Keeps the object at ``target`` equal to a local file that grows.

    For a local ``target`` the file *is* the target and a `Mirror` does nothing
    but name it. For a bucket, ``local_path`` is a working copy (made in a fresh
    temporary directory, filled with the object's current contents when
    ``keep``); whoever writes appends to it, flushing as on a local disk, and
    the mirror uploads the whole file whenever it changed: every ``interval_s``
    seconds from a background thread, on `sync`, and on `close`.

    Args:
      target: the file's real place, local or ``gs://``.
      keep: start from the contents already at ``target`` (else from empty).
      interval_s: seconds between background uploads.

    Example::

      mirror = Mirror("gs://bucket/run/metrics.jsonl")
      with open(mirror.local_path, "a") as f:
          f.write(line)
      mirror.sync()          # on the bucket now
      mirror.close()
    """

    def __init__(self, target: str | os.PathLike, *, keep: bool = True, interval_s: float = 5.0):
        self.target = normalize(target)
        self.remote = is_remote(self.target)
        if not self.remote:
            self.local_path = self.target
            return
        self._dir = tempfile.mkdtemp(prefix="replicator-mirror-")
        self.local_path = os.path.join(self._dir, os.path.basename(self.target))
        data = b""
        if keep:
            try:
                data = read_bytes(self.target)
            except FileNotFoundError:
                pass
        with open(self.local_path, "wb") as f:
            f.write(data)
        self._uploaded = data
        self._lock = threading.Lock()  # one upload at a time
        self._stop = threading.Event()
        self._failed: BaseException | None = None
        self._upload_s = 0.0
        self._thread = threading.Thread(
            target=self._run, args=(interval_s,), daemon=True, name="replicator-mirror"
        )
        self._thread.start()
        _OPEN.add(self)

    @property
    def upload_seconds(self) -> float:
        """Total time spent uploading (in the background, off the step loop)."""
        return 0.0 if not self.remote else self._upload_s

    def sync(self) -> None:
        """Uploads the file now if it changed since the last upload, and waits.

        Raises:
          StorageError: the upload failed within the deadline.
        """
        if not self.remote:
            return
        with self._lock:
            with open(self.local_path, "rb") as f:
                data = f.read()
            if data == self._uploaded:
                return
            start = time.perf_counter()
            write_bytes(self.target, data)
            self._upload_s += time.perf_counter() - start
            self._uploaded = data

    def close(self) -> None:
        """Uploads what is left and stops the background thread; the working copy goes."""
        if not self.remote or self._stop.is_set():
            return
        self._stop.set()
        self._thread.join()
        try:
            self.sync()
        finally:
            _OPEN.discard(self)
            shutil.rmtree(self._dir, ignore_errors=True)

    def discard(self) -> None:
        """Stops mirroring and removes the file, here and in the bucket (a command that
        was refused leaves nothing behind)."""
        if not self.remote:
            if os.path.exists(self.local_path):
                os.remove(self.local_path)
            return
        self._stop.set()
        self._thread.join()
        _OPEN.discard(self)
        shutil.rmtree(self._dir, ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            call("remove", self.target, lambda: path(self.target).unlink())

    def _run(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            try:
                self.sync()
            except Exception as e:  # noqa: BLE001  (reported once; the next try may work)
                if self._failed is None:
                    log.warning("Could not upload %s (will retry): %s", self.target, e)
                self._failed = e


_OPEN: weakref.WeakSet[Mirror] = weakref.WeakSet()


def _close_open_mirrors() -> None:
    """A process that exits without closing its mirrors still uploads them. (Run at
    threading's shutdown, before `atexit` hooks: gcsfs closes its HTTP session in one.)"""
    for mirror in list(_OPEN):
        try:
            mirror.close()
        except Exception as e:  # noqa: BLE001
            log.warning("Could not upload %s at exit: %s", mirror.target, e)


threading._register_atexit(_close_open_mirrors)
