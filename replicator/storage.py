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

A storage that stops answering is retried by every library alike (this module's
calls, gcsfs's requests: `gcsfs_with_deadline`, tensorstore's: `tensorstore_retries`)
for at most `DEADLINE_S` after the first request it left unanswered: a shorter
outage is ridden out, a longer one is one `StorageUnavailableError`, after which a
call tries once, briefly (a run that stops writes what it still can, quickly).

Tests point gcsfs and tensorstore at a local GCS server through their own
variables (``STORAGE_EMULATOR_HOST``, ``TENSORSTORE_GCS_HTTP_URL``); nothing here
is specific to tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import os
import re
import shutil
import socket
import tempfile
import threading
import time
import uuid
import weakref
from collections.abc import Callable
from typing import TypeVar

from etils import epath

from replicator.errors import StorageError as StorageError
from replicator.errors import StorageUnavailableError as StorageUnavailableError
from replicator.runtime import compat

log = logging.getLogger("replicator")
T = TypeVar("T")


def _without_bucket_type_notice(record: logging.LogRecord) -> bool:
    # gcsfs asks a second API (storage control) for the bucket's layout and, where
    # that API is out of reach, falls back to plain GCS calls with a warning per
    # bucket: a fallback that works, not something for the user to act on.
    return not str(record.msg).startswith("Could not determine bucket type")


logging.getLogger("gcsfs").addFilter(_without_bucket_type_notice)

REMOTE_PREFIXES = ("gs://",)
# A storage that does not answer is retried for at most this long, counted from the
# first request it left unanswered: a missing bucket, a bucket one cannot write or a
# server that does not answer ends in one line, not a hang.
DEADLINE_S = 60.0
_RETRY_DELAYS_S = (0.5, 1.0, 2.0, 4.0, 8.0)  # then 8 s, until the deadline
_LAST_TRY_S = 2.0  # what a call gets once the deadline has passed: one short try


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
    p = normalize(p)
    if is_remote(p):
        gcsfs_with_deadline()
    return epath.Path(p)


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
    are retried with backoff until the deadline, counted from when the storage
    went silent: this call's start, or the first request it left unanswered
    before. Either way the error is a `StorageError` naming ``url`` and what was
    being done, in one line.

    Args:
      what: what the call does, for the message, e.g. ``"write"``.
      url: the path it works on.
      fn: the call.
      deadline_s: the time allowed, retries included (default `DEADLINE_S`).

    Returns:
      What ``fn`` returns.

    Raises:
      StorageUnavailableError: no answer within the deadline.
      StorageError: a refusal (no such bucket, no permission).
      FileNotFoundError: no such file.
    """
    if not is_remote(url):
        return fn()
    gcsfs_with_deadline()
    budget = DEADLINE_S if deadline_s is None else deadline_s
    start = time.monotonic()
    for attempt in itertools.count():
        # Past the deadline already (an outage met before): one short try all the same.
        first_try = min(_LAST_TRY_S, budget) if attempt == 0 else 0.0
        asked = time.monotonic()
        try:
            value = _with_timeout(fn, max(_deadline(start, budget) - asked, first_try))
        except FileNotFoundError:
            _answered()
            raise
        except _BucketMissing as e:
            raise StorageError(f"cannot {what} {url}: {e}") from e
        except PermissionError as e:
            raise StorageError(f"cannot {what} {url}: {_reason(e)}") from e
        except Exception as e:  # noqa: BLE001  (gcsfs/aiohttp raise many kinds)
            if _is_permanent(e):
                raise StorageError(f"cannot {what} {url}: {_reason(e)}") from e
            _unanswered(asked)
            error = e
        else:
            _answered()
            return value
        delay = _RETRY_DELAYS_S[min(attempt, len(_RETRY_DELAYS_S) - 1)]
        if time.monotonic() + delay > _deadline(start, budget):
            break
        time.sleep(delay)
    raise StorageUnavailableError(
        f"cannot {what} {url}: {_no_answer(since=_deadline(start, 0.0))} ({_reason(error)})"
    ) from error


# When the first request left unanswered since the storage's last answer was sent.
_silent_since: float | None = None
_silence_lock = threading.Lock()


def _unanswered(asked: float) -> None:
    """Notes a request sent at ``asked`` that got no answer."""
    global _silent_since
    with _silence_lock:
        if _silent_since is None or asked < _silent_since:
            _silent_since = asked


def _answered() -> None:
    global _silent_since
    _silent_since = None


def _deadline(start: float, budget_s: float) -> float:
    """When retrying a request begun at ``start`` stops: ``budget_s`` after the storage
    went silent (this request's start, or an earlier request's left unanswered)."""
    since = _silent_since
    return (start if since is None else min(start, since)) + budget_s


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
    return code in (400, 401, 403, 404) if isinstance(code, int) else _forbidden(error)


def _forbidden(error: BaseException) -> bool:
    """gcsfs's 403: a plain OSError, "Forbidden: URL" then the service's message."""
    return type(error) is OSError and str(error).startswith("Forbidden:")


def _reason(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    if _forbidden(error) and len(lines) > 1:
        return f"permission denied: {lines[1][:300]}"  # the service says who lacks what
    # (tensorstore's errors end in a dump of their spec, which says nothing to a reader)
    text = re.split(r"\s*\[tensorstore_spec=", lines[0])[0][:200] if lines else ""
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def failure(error: BaseException, what: str, url: str) -> StorageError | None:
    """The `StorageError` that ``error`` stands for, raised by a library (Orbax,
    tensorstore, gcsfs) while it worked on ``url``; None when it stands for none (a
    bug, or a missing file, which the caller judges).

    No answer (refused or dropped connections, time-outs, server errors,
    tensorstore's retries spent) is a `StorageUnavailableError`, past the deadline
    from then on, as is an upload the service lost; a refusal (no permission), a `StorageError`.

    >>> failure(ConnectionRefusedError(111, "Connection refused"), "save", "gs://b/c")
    StorageUnavailableError('cannot save gs://b/c: the storage service did not answer (ConnectionRefusedError: [Errno 111] Connection refused)')
    >>> failure(KeyError("a bug"), "save", "gs://b/c") is None
    True
    """  # noqa: E501
    chain = causes(error)
    for e in chain:
        if isinstance(e, StorageError):
            return e
    for e in chain:
        if _is_unanswered(e):
            text = f"cannot {what} {url}: {_no_answer(since=_silent_since)} ({_reason(e)})"
            _unanswered(time.monotonic() - DEADLINE_S)  # past the deadline from now on
            return StorageUnavailableError(text)
        if isinstance(e, PermissionError) or _forbidden(e) or "PERMISSION_DENIED" in str(e):
            return StorageError(f"cannot {what} {url}: {_reason(e)}")
        if isinstance(e, FileNotFoundError) and "/upload/storage/" in str(e):
            lost = f"the storage service lost an upload ({_reason(e)})"
            return StorageUnavailableError(f"cannot {what} {url}: {lost}")
    return None


def _no_answer(since: float | None) -> str:
    silence = "" if since is None else f" for {time.monotonic() - since:.0f} s"
    return f"the storage service did not answer{silence}"


def causes(error: BaseException) -> list[BaseException]:
    """``error``, then what it was raised from or during, then the errors of a group."""
    found, todo = [], [error]
    while todo:
        e = todo.pop(0)
        if e is None or any(e is f for f in found):
            continue
        found.append(e)
        context = None if e.__suppress_context__ else e.__context__  # (not: from None)
        todo += [e.__cause__, context, *getattr(e, "exceptions", ())]
    return found


# tensorstore (Orbax's arrays) raises ValueErrors; these say it got no answer.
_TENSORSTORE_NO_ANSWER = re.compile(r"retry attempts failed|CURL error")


def _is_unanswered(e: BaseException) -> bool:
    if isinstance(e, (ConnectionError, TimeoutError)):
        return True
    if isinstance(e, ValueError) and _TENSORSTORE_NO_ANSWER.search(str(e)):
        return True
    code = getattr(e, "code", None) or getattr(e, "status", None)
    if isinstance(code, int) and not (code >= 500 or code in (408, 429)):
        return False  # an answer: 404, 403, ...
    module = type(e).__module__.split(".")[0]
    if module == "google":  # google-auth: no token without a network
        return type(e).__name__ == "TransportError" or isinstance(code, int)
    # aiohttp's connection errors, gcsfs's HTTP errors, requests' (gcsfs's 502).
    return module in ("aiohttp", "gcsfs", "requests") and not isinstance(
        e, (FileNotFoundError, PermissionError)
    )


@functools.cache
def gcsfs_with_deadline() -> None:
    """Makes every ``gs://`` path of this process (this module's, and Orbax's, tfds's,
    through epath and fsspec) go through gcsfs with this module's deadline: retried
    as `call` retries, where gcsfs alone gives up after 6 tries in about 30 s (the
    error Orbax lets through), and a try given up after 30 s without a byte of an
    answer (gcsfs alone: never)."""
    import fsspec

    cls = _gcsfs_class()
    for protocol in ("gs", "gcs"):
        fsspec.register_implementation(protocol, cls, clobber=True)


def _gcsfs_class() -> type:
    import aiohttp
    import gcsfs
    from gcsfs.retry import is_retriable

    one_try = compat.gcsfs_request_without_retries()
    if one_try is None:
        return gcsfs.GCSFileSystem  # another gcsfs: its own retries, then

    class GCSFileSystemWithDeadline(gcsfs.GCSFileSystem):
        def __init__(self, *args, requests_timeout=None, **kwargs):
            if requests_timeout is None:
                requests_timeout = aiohttp.ClientTimeout(sock_connect=30, sock_read=30)
            super().__init__(*args, requests_timeout=requests_timeout, **kwargs)

        async def _request(self, *args, **kwargs):
            start = time.monotonic()
            for attempt in itertools.count():
                asked = time.monotonic()
                try:
                    result = await one_try(self, *args, **kwargs)
                except Exception as e:
                    if not (is_retriable(e) or isinstance(e, (TimeoutError, ConnectionError))):
                        _answered()  # the service's own answer (404, 403, ...), or a bug
                        raise
                    _unanswered(asked)
                    delay = _RETRY_DELAYS_S[min(attempt, len(_RETRY_DELAYS_S) - 1)]
                    if time.monotonic() + delay > _deadline(start, DEADLINE_S):
                        raise
                    await asyncio.sleep(delay)
                else:
                    _answered()
                    return result

    return GCSFileSystemWithDeadline


def tensorstore_retries(deadline_s: float | None = None) -> dict:
    """tensorstore's ``Context.gcs_request_retries`` that give up within ``deadline_s``
    (default `DEADLINE_S`; tensorstore's own, 32 tries, take about 15 minutes). It
    waits ``initial_delay``, then twice as long each time up to ``max_delay``, plus
    up to 1 s at random.

    >>> tensorstore_retries(60.0)
    {'max_retries': 9, 'initial_delay': '1s', 'max_delay': '8s'}
    """
    deadline_s = DEADLINE_S if deadline_s is None else deadline_s
    waited, tries = 0.0, 1
    while (waited := waited + min(2.0 ** (tries - 1), 8.0) + 1.0) <= deadline_s:
        tries += 1
    return {"max_retries": tries, "initial_delay": "1s", "max_delay": "8s"}


# ---------------------------------------------------------------- whole files


def exists(p: str | os.PathLike) -> bool:
    """Whether a file or directory exists at ``p`` (bounded for a bucket)."""
    return call("read", normalize(p), lambda: path(p).exists())


def isdir(p: str | os.PathLike) -> bool:
    """Whether ``p`` is a directory (a prefix with objects under it, in a bucket)."""
    return call("read", normalize(p), lambda: path(p).is_dir())


def isfile(p: str | os.PathLike) -> bool:
    """Whether ``p`` is a file (an object, in a bucket)."""
    return call("read", normalize(p), lambda: path(p).is_file())


def read_bytes(p: str | os.PathLike) -> bytes:
    """The contents of file ``p``; FileNotFoundError when there is none."""
    return call("read", normalize(p), lambda: path(p).read_bytes())


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
    if not is_remote(p):
        os.makedirs(normalize(p), exist_ok=True)


def listdir(p: str | os.PathLike) -> list[str]:
    """The names in directory ``p``, sorted; [] when it does not exist."""
    p = normalize(p)
    if not is_remote(p):
        return sorted(os.listdir(p)) if os.path.isdir(p) else []
    return sorted(call("list", p, lambda: _names_in(p)))


def _names_in(p: str) -> list[str]:
    if not path(p).is_dir():
        return []
    try:
        return [c.name for c in path(p).iterdir()]
    except FileNotFoundError:  # its last object went since is_dir (another process's probe)
        return []


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
    seconds from a background thread, on `sync`, and on `close`. A killed process's
    directory (``replicator-mirror-PID@HOST-...``) goes at this host's next mirror.

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
        _remove_orphaned_mirrors()
        self._dir = tempfile.mkdtemp(prefix=f"{_MIRROR_PREFIX}{os.getpid()}@{_HOST}-")
        self.local_path = os.path.join(self._dir, os.path.basename(self.target))
        data = b""
        if keep:
            with contextlib.suppress(FileNotFoundError):
                data = read_bytes(self.target)
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
                    # An outage is the run's to report (in one line, if it lasts): the log only.
                    quiet = {"log_only": isinstance(e, StorageUnavailableError)}
                    log.warning("Could not upload %s (will retry): %s", self.target, e, extra=quiet)
                self._failed = e


_OPEN: weakref.WeakSet[Mirror] = weakref.WeakSet()
_MIRROR_PREFIX = "replicator-mirror-"
_HOST = socket.gethostname()


@functools.cache
def _remove_orphaned_mirrors() -> None:
    """Removes the working copies of this host's mirrors whose process is gone (killed
    before its `close`), once per process: a resumed run redoes their last records."""
    mine = re.compile(rf"{re.escape(_MIRROR_PREFIX)}(\d+)@{re.escape(_HOST)}-")
    root = tempfile.gettempdir()
    for name in os.listdir(root):
        found = mine.match(name)
        if found and not _is_alive(int(found.group(1))):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def _is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except OSError as e:
        return isinstance(e, PermissionError)  # another user's: alive


def _close_open_mirrors() -> None:
    """A process that exits without closing its mirrors still uploads them. (Run at
    threading's shutdown, before `atexit` hooks: gcsfs closes its HTTP session in one.)"""
    for mirror in list(_OPEN):
        try:
            mirror.close()
        except Exception as e:  # noqa: BLE001
            log.warning("Could not upload %s at exit: %s", mirror.target, e)


compat.at_thread_shutdown(_close_open_mirrors)
