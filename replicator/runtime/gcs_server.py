"""A Google Cloud Storage server on 127.0.0.1: the bucket a pod rehearsal (and the tests) use.

``python -m replicator.runtime.gcs_server [--port PORT] [--dir DIR]`` serves the GCS
JSON API with gcp-storage-emulator (the ``rehearse`` extra), its objects kept in
DIR (in memory without it), and prints the variables through which the client
libraries reach it: ``STORAGE_EMULATOR_HOST`` (google-cloud-storage, gcsfs),
``TENSORSTORE_GCS_HTTP_URL`` and ``GOOGLE_AUTH_TOKEN_FOR_TESTING`` (tensorstore,
Orbax's array writer). Nothing project-specific: `LocalGCS` runs it in a
subprocess for ``launch local --gcs`` (`replicator.runtime.rehearse`) and the tests.

The emulator (2026.7) lacks two parts of the API that tensorstore relies on. Orbax
writes each checkpoint as an OCDBT database, whose manifest several writers commit
with conditional writes, and tensorstore reads objects back with their generation;
without these it stops with "Malformed StorageGeneration" once a checkpoint has
more than a few arrays. This server adds, as GCS documents them:

* ``x-goog-generation`` / ``x-goog-metageneration`` on every media download
  (https://cloud.google.com/storage/docs/xml-api/reference-headers);
* the ``ifGenerationMatch`` precondition on uploads and deletes: 412 Precondition
  Failed when the object's generation differs (0: the object must not exist),
  checked and written under one lock so that two writers cannot both win
  (https://cloud.google.com/storage/docs/request-preconditions).

and makes one more answer GCS's: a PUT to a resumable upload session that has already
completed (a client retrying the last chunk whose reply was lost, as gcsfs does after a
dropped connection) gets 200 and the object resource the upload created, where the
emulator, having deleted the session, answers 404
(https://cloud.google.com/storage/docs/performing-resumable-uploads). The completed
sessions are remembered in memory and, with ``--dir``, in ``DIR/.completed_uploads.json``,
so a restarted server still knows them.

The emulator has no IAM, so one more rule stands in for a bucket the caller may
read but not write: in a bucket whose name starts with ``readonly-``, every upload
and delete is refused with 403 Forbidden and GCS's message for a caller without
the permission (``storage.objects.create`` / ``storage.objects.delete``).
Everything else is the emulator's own server, unchanged.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from http import HTTPStatus

from replicator.errors import LaunchError

VARIABLES = ("STORAGE_EMULATOR_HOST", "TENSORSTORE_GCS_HTTP_URL", "GOOGLE_AUTH_TOKEN_FOR_TESTING")
READ_ONLY = "readonly-"  # buckets named so refuse writes, as GCS does without the permission
_WRITE = threading.Lock()
_ORIGINAL = {}  # the emulator's handlers that ours wrap: "download", "insert", "delete", ...
_COMPLETED: dict[str, dict] = {}  # upload_id -> the object resource its upload created
_COMPLETED_FILE = ".completed_uploads.json"
_KEEP_COMPLETED = 10_000  # the newest sessions remembered
_directory: list[str] = []  # where the objects are kept, if on disk (set by `serve`)


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def have_emulator() -> bool:
    """Whether gcp-storage-emulator (the ``rehearse`` extra) is installed."""
    import importlib.util

    return importlib.util.find_spec("gcp_storage_emulator") is not None


class LocalGCS:
    """The server in a subprocess, stopped on exit.

    Args:
      directory: where the objects are kept, across runs (None: in memory).
      port: its port on 127.0.0.1 (None: a free one).

    Example::

      with LocalGCS("/tmp/gcs") as gcs:
          gcs.create_bucket("rehearsal")
          subprocess.run(command, env={**os.environ, **gcs.environ})
    """

    def __init__(self, directory: str | os.PathLike | None = None, port: int | None = None):
        self.directory = None if directory is None else os.path.abspath(directory)
        self.port = port or free_port()
        self._server: subprocess.Popen | None = None
        self._errors = tempfile.TemporaryFile(mode="w+")

    @property
    def url(self) -> str:
        """The server's address, ``http://127.0.0.1:PORT``."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def environ(self) -> dict[str, str]:
        """The variables through which the client libraries reach the server."""
        return dict(zip(VARIABLES, (self.url, self.url, "rehearsal")))

    def start(self, timeout_s: float = 30.0) -> LocalGCS:
        """Starts the server and waits until it answers.

        Raises:
          LaunchError: it did not start (no gcp-storage-emulator, a busy directory).
        """
        argv = [sys.executable, "-m", "replicator.runtime.gcs_server", "--port", str(self.port)]
        argv += ["--dir", self.directory] if self.directory else []
        argv += ["--parent", str(os.getpid())]
        # A session of its own: a Ctrl-C meant for the run's processes (which then save
        # a checkpoint through it) does not reach the server; `stop` ends it after them.
        self._server = subprocess.Popen(
            argv, stdout=subprocess.DEVNULL, stderr=self._errors, start_new_session=True
        )
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.2).close()
                return self
            except OSError:
                if self._server.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    self._errors.seek(0)
                    said = self._errors.read().strip().splitlines()
                    raise LaunchError(
                        said[-1].removeprefix("error: ") if said else
                        f"the local GCS server did not start on port {self.port}"
                    ) from None  # fmt: skip
                time.sleep(0.1)

    def create_bucket(self, name: str) -> None:
        """Creates bucket ``name``; one that exists is kept as it is."""
        request = urllib.request.Request(
            f"{self.url}/storage/v1/b?project=rehearsal",
            data=json.dumps({"name": name}).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        try:
            urllib.request.urlopen(request, timeout=30).close()
        except urllib.error.HTTPError as e:
            if e.code != HTTPStatus.CONFLICT:  # 409: it exists
                raise LaunchError(f"cannot create bucket gs://{name} on {self.url}: {e}") from e

    def stop(self) -> None:
        """Stops the server (what it keeps in its directory stays)."""
        if self._server is not None and self._server.poll() is None:
            self._server.terminate()
            try:
                self._server.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._server.kill()
                self._server.wait()

    def __enter__(self) -> LocalGCS:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# ---------------------------------------------------------------- the server process


def _generation(storage, bucket: str, name: str) -> str:
    from gcp_storage_emulator.exceptions import NotFound

    try:
        return str(storage.get_file_obj(bucket, name)["generation"])
    except NotFound:
        return "0"


def _download(request, response, storage, *args, **kwargs):
    from gcp_storage_emulator.exceptions import NotFound

    _ORIGINAL["download"](request, response, storage, *args, **kwargs)
    try:
        obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
    except NotFound:
        return
    response["x-goog-generation"] = str(obj["generation"])
    response["x-goog-metageneration"] = str(obj["metageneration"])


def _forbidden(request, response, permission: str) -> bool:
    bucket = request.params.get("bucket_name", "")
    if not bucket.startswith(READ_ONLY):
        return False
    response.status = HTTPStatus.FORBIDDEN
    message = (
        f"tester@example.iam.gserviceaccount.com does not have {permission} access to the "
        f"Google Cloud Storage bucket {bucket}."
    )
    response.json({"error": {"code": 403, "message": message}})
    return True


def _delete(request, response, storage, *args, **kwargs):
    if _forbidden(request, response, "storage.objects.delete"):
        return
    wanted = request.query.get("ifGenerationMatch")
    with _WRITE:
        current = _generation(storage, request.params["bucket_name"], request.params["object_id"])
        if wanted and current != "0" and current != wanted[0]:
            response.status = HTTPStatus.PRECONDITION_FAILED
            response.json({"error": {"code": 412, "message": "Precondition Failed"}})
            return
        _ORIGINAL["delete"](request, response, storage, *args, **kwargs)


def _insert(request, response, storage, *args, **kwargs):
    if _forbidden(request, response, "storage.objects.create"):
        return
    if "upload_id" in request.query:  # a chunk POSTed to a resumable session (gcsfs does)
        _upload_partial(request, response, storage, *args, **kwargs)  # (checked when begun)
        return
    wanted = request.query.get("ifGenerationMatch")
    name = request.query.get("name")
    with _WRITE:
        if wanted and name:
            current = _generation(storage, request.params["bucket_name"], name[0])
            if current != wanted[0]:
                response.status = HTTPStatus.PRECONDITION_FAILED
                response.json({"error": {"code": 412, "message": "Precondition Failed"}})
                return
        _ORIGINAL["insert"](request, response, storage, *args, **kwargs)


def _upload_partial(request, response, storage, *args, **kwargs):
    upload_id = request.query.get("upload_id", [""])[0]
    with _WRITE:
        if upload_id and upload_id not in storage.resumable and upload_id in _COMPLETED:
            response.status = HTTPStatus.OK  # GCS: a completed session answers with its object
            response.json(_COMPLETED[upload_id])
            return
        _ORIGINAL["upload_partial"](request, response, storage, *args, **kwargs)
        if upload_id and upload_id not in storage.resumable and response.status == HTTPStatus.OK:
            _COMPLETED[upload_id] = json.loads(response._content)
            while len(_COMPLETED) > _KEEP_COMPLETED:  # GCS forgets a session after a week
                del _COMPLETED[next(iter(_COMPLETED))]
            _save_completed()


def _save_completed() -> None:
    if _directory:
        path = os.path.join(_directory[0], _COMPLETED_FILE)
        with open(f"{path}.tmp", "w") as f:
            json.dump(_COMPLETED, f)
        os.replace(f"{path}.tmp", path)  # a server killed while writing keeps the old list


def _load_completed(directory: str) -> None:
    _directory[:] = [directory]
    try:
        with open(os.path.join(directory, _COMPLETED_FILE)) as f:
            _COMPLETED.update(json.load(f))
    except FileNotFoundError:
        pass


def install_patches() -> None:
    """Puts the handlers above in the emulator's routing table (once)."""
    from gcp_storage_emulator import server
    from gcp_storage_emulator.handlers import objects

    if _ORIGINAL:
        return
    _ORIGINAL.update(download=objects.download, insert=objects.insert, delete=objects.delete,
                     upload_partial=objects.upload_partial)  # fmt: skip
    ours = {objects.download: _download, objects.insert: _insert, objects.delete: _delete,
            objects.upload_partial: _upload_partial}  # fmt: skip
    for _, handlers in server.HANDLERS:
        for method, handler in list(handlers.items()):
            if handler in ours:
                handlers[method] = ours[handler]
    objects.insert = _insert  # the server's fallback for uploads posted without /upload
    objects.download = _download  # what a GET of .../o/NAME?alt=media calls through objects.get
    objects.upload_partial = _upload_partial  # what a POST with an upload_id calls


def serve(port: int, directory: str | None = None, parent: int | None = None) -> None:
    """Serves on 127.0.0.1:``port`` until killed, or until process ``parent`` is gone,
    its objects in ``directory`` (or memory).

    Raises:
      SystemExit: another server keeps its objects in ``directory``.
    """
    from gcp_storage_emulator import server

    install_patches()
    if directory:
        os.makedirs(directory, exist_ok=True)
        _lock(directory)
        _load_completed(directory)
    gcs = server.create_server(
        "127.0.0.1", port, in_memory=directory is None, data_dir=directory or None
    )
    gcs.start()
    while parent is None or os.getppid() == parent:  # an orphan is reparented
        time.sleep(1.0)
    gcs.stop()


def _lock(directory: str) -> None:
    """One server per directory: two would overwrite each other's index of the objects."""
    import fcntl

    lock = open(os.path.join(directory, ".lock"), "w")  # noqa: SIM115  (held until exit)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        sys.exit(
            f"error: another local GCS server keeps its objects in {directory} (a rehearsal "
            "still running?): stop it, or give another directory (--gcs-dir)"
        )
    _ORIGINAL["lock"] = lock


def main(argv: Sequence[str]) -> int:
    """``python -m replicator.runtime.gcs_server [--port PORT] [--dir DIR]``."""
    parser = argparse.ArgumentParser(
        prog="python -m replicator.runtime.gcs_server",
        description="A GCS JSON API server on 127.0.0.1 (gcp-storage-emulator, the rehearse "
        "extra) that tensorstore, gcsfs and google-cloud-storage reach through their own "
        "variables, printed at start.",
    )
    parser.add_argument("--port", type=int, default=0, help="its port (default: a free one)")
    parser.add_argument("--dir", help="keep the objects in DIR (default: in memory)")
    parser.add_argument("--parent", type=int, help="stop when process PARENT is gone")
    args = parser.parse_args(argv)
    if not have_emulator():
        sys.exit("error: the GCS server needs gcp-storage-emulator: pip install -e '.[rehearse]'")
    port = args.port or free_port()
    url = f"http://127.0.0.1:{port}"
    for name, value in zip(VARIABLES, (url, url, "rehearsal")):
        print(f"export {name}={value}", flush=True)
    serve(port, os.path.abspath(args.dir) if args.dir else None, args.parent)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
