"""A run's lease on its workdir: one ``train`` at a time writes there.

Two runs on one workdir would interleave their records and replace each other's
checkpoints, so `train_and_evaluate` takes the workdir's lease before it writes
anything there, and a second run is refused in one line naming the holder
(`WorkdirBusyError`, exit status 2). Only the chief process (process 0) of a
multi-process run takes it.

* A local workdir: ``WORKDIR/lease.lock``, locked with ``flock``. The operating
  system releases it when the process ends, however it ends: a killed run's
  successor is never kept waiting. The file names the holder (host, pid, time).
* A workdir in a bucket: the object ``WORKDIR/lease.json`` (holder, a token of its
  own, the time), created only if absent (GCS's ``ifGenerationMatch=0``) and
  renewed every `RENEW_S` by a daemon thread, each write conditional on the
  generation it wrote before, so that two runs cannot both hold it. A lease not
  renewed for `EXPIRY_S` is stale: a killed run's successor takes it over after
  at most that long (at once when the holder was on this host and its process is
  gone, or when its time says it expired long ago), watching it meanwhile; a lease
  that is renewed while it watches has a live holder, and the successor is refused.

Example::

  with hold(workdir):
      ...  # write the run's files
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator

import jax

from replicator import storage
from replicator.errors import WorkdirBusyError as WorkdirBusyError
from replicator.runtime import compat

log = logging.getLogger("replicator")
LOCAL_NAME, REMOTE_NAME = "lease.lock", "lease.json"
RENEW_S = 10.0  # a bucket lease is rewritten this often
EXPIRY_S = 45.0  # ... and is stale when it has not been for this long
_POLL_S = 1.0  # how often a successor looks at a lease it waits for


@contextlib.contextmanager
def hold(workdir: str) -> Iterator[None]:
    """Holds ``workdir``'s lease in the block (process 0 only; other processes hold
    nothing). The workdir is created if it is local.

    Raises:
      WorkdirBusyError: another run holds it (one line naming the holder).
    """
    if jax.process_index() != 0:
        yield
        return
    workdir = storage.normalize(workdir)
    lease = _BucketLease(workdir) if storage.is_remote(workdir) else _LocalLease(workdir)
    try:
        yield
    finally:
        lease.release()


def _holder() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(), "since": time.time()}


def _describe(holder: dict, lease: str) -> str:
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("since", 0)))
    return (
        f"another run holds this workdir: process {holder.get('pid', '?')} on "
        f"{holder.get('host', '?')}, since {since} ({lease}); let it finish or stop it, "
        "or train in another --workdir"
    )


class _LocalLease:
    def __init__(self, workdir: str):
        os.makedirs(workdir, exist_ok=True)
        self.path = os.path.join(workdir, LOCAL_NAME)
        # Opened without truncating: the holder's lines stay until the lock is ours.
        self._file = open(self.path, "a+")  # noqa: SIM115  (held until `release`)
        try:
            fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._file.seek(0)
            try:
                holder = json.loads(self._file.read() or "{}")
            except ValueError:
                holder = {}
            self._file.close()
            raise WorkdirBusyError(_describe(holder, self.path)) from None
        self._file.truncate(0)
        self._file.write(json.dumps(_holder()))
        self._file.flush()

    def release(self) -> None:
        self._file.close()  # unlocks; the file stays (removing it races a newcomer)


class _BucketLease:
    def __init__(self, workdir: str):
        self.url = storage.join(workdir, REMOTE_NAME)
        self.token, self.since = uuid.uuid4().hex, time.time()
        self._stop = threading.Event()
        self.generation = self._take()
        self._thread = threading.Thread(target=self._renew, daemon=True, name="replicator-lease")
        self._thread.start()

    def _record(self) -> bytes:
        holder = {**_holder(), "since": self.since, "token": self.token, "renewed": time.time()}
        return json.dumps(holder).encode()

    def _take(self) -> str:
        """The lease's new generation, ours; waits for a stale one to expire."""
        watching, seen_at = None, time.monotonic()
        while True:
            generation = _write_if(self.url, self._record(), "0")
            if generation is not None:
                return generation
            found = _read(self.url)
            if found is None:
                continue  # released in between: try again
            generation, holder = found
            if holder.get("token") == self.token:
                return generation  # our own write, its answer lost
            if watching is not None and generation != watching:
                raise WorkdirBusyError(_describe(holder, self.url))  # renewed: alive
            if watching is None:
                watching, seen_at = generation, time.monotonic()
                log.info("%s has a lease; waiting up to %.0f s to see whether its holder "
                         "renews it", self.url, EXPIRY_S)  # fmt: skip
            if _stale(holder) or time.monotonic() - seen_at > EXPIRY_S:
                taken = _write_if(self.url, self._record(), generation)
                if taken is not None:
                    log.warning("Took over the stale lease of %s (%s)", self.url, holder)
                    return taken
                continue  # another successor was faster, or the holder renewed: look again
            time.sleep(_POLL_S)

    def _renew(self) -> None:
        while not self._stop.wait(RENEW_S):
            try:
                generation = _write_if(self.url, self._record(), self.generation)
            except Exception as e:  # noqa: BLE001  (an outage: the next renewal tries again)
                log.warning("Could not renew the lease %s: %s", self.url, e,
                            extra={"log_only": True})  # fmt: skip
                continue
            if generation is None:
                found = _read(self.url)
                if found is None or found[1].get("token") != self.token:
                    log.warning("Lost the lease %s to another run (%s)", self.url,
                                found[1] if found else "deleted")  # fmt: skip
                    return
                generation = found[0]  # our own renewal, its answer lost
            self.generation = generation

    def release(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * storage._LAST_TRY_S)  # (a renewal in an outage: short)
        with contextlib.suppress(FileNotFoundError, FileExistsError, storage.StorageError):
            _delete_if(self.url, self.generation)


def _stale(holder: dict) -> bool:
    """Whether a lease's holder is surely gone: its process on this host has ended, or
    it has not renewed for twice the expiry by its clock (clocks may disagree a little)."""
    if holder.get("host") == socket.gethostname() and isinstance(holder.get("pid"), int):
        if holder["pid"] != os.getpid() and not _is_alive(holder["pid"]):
            return True
    return time.time() - holder.get("renewed", time.time()) > 2 * EXPIRY_S


def _is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except OSError as e:
        return isinstance(e, PermissionError)  # another user's


# ---------------------------------------------------------------- generation-matched objects


def _gcs():
    import fsspec

    storage.gcsfs_with_deadline()
    return fsspec.filesystem("gcs")


def _bucket_and_key(url: str) -> tuple[str, str]:
    bucket, key = url.removeprefix("gs://").split("/", 1)
    return bucket, key


def _write_if(url: str, data: bytes, generation: str) -> str | None:
    """Writes object ``url`` if its generation is ``generation`` ("0": if there is none);
    its new generation, or None when the precondition failed."""
    bucket, key = _bucket_and_key(url)
    fs = _gcs()
    upload = f"{compat.gcs_endpoint(fs)}/upload/storage/v1/b/{bucket}/o"

    def write() -> str | None:
        try:
            resource = fs.call(
                "POST", upload, uploadType="media",
                name=key, ifGenerationMatch=generation, data=data, json_out=True,
                headers={"Content-Type": "application/octet-stream"},
            )  # fmt: skip
        except FileExistsError:  # gcsfs's 412 Precondition Failed
            return None
        return str(resource["generation"])

    return storage.call("write", url, write)


def _read(url: str) -> tuple[str, dict] | None:
    """Object ``url``'s generation and JSON, or None when there is none."""
    bucket, key = _bucket_and_key(url)
    fs = _gcs()

    def read() -> tuple[str, dict] | None:
        try:
            headers, data = fs.call("GET", "b/{}/o/{}", bucket, key, alt="media")
        except FileNotFoundError:
            return None
        try:
            holder = json.loads(data)
        except ValueError:
            holder = {}
        return str(headers.get("x-goog-generation", "")), holder

    return storage.call("read", url, read)


def _delete_if(url: str, generation: str) -> None:
    bucket, key = _bucket_and_key(url)
    fs = _gcs()
    storage.call(
        "remove", url,
        lambda: fs.call("DELETE", "b/{}/o/{}", bucket, key, ifGenerationMatch=generation),
    )  # fmt: skip
    fs.invalidate_cache(url)
