"""A local GCS server for tests: gcp-storage-emulator, reached through the libraries'
own variables (no project-specific switch, no client mock)."""

from __future__ import annotations

import contextlib
import os
import uuid

from replicator.runtime import gcs_server
from replicator.runtime.gcs_server import VARIABLES as VARIABLES


def free_port() -> int:
    return gcs_server.free_port()


@contextlib.contextmanager
def emulator():
    """Starts the server (in memory; replicator/runtime/gcs_server.py), sets the variables,
    yields its URL; stops it after."""
    saved = {name: os.environ.get(name) for name in VARIABLES}
    with gcs_server.LocalGCS() as server:
        os.environ.update(server.environ)
        try:
            yield server.url
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


def new_bucket() -> str:
    """Creates a bucket with a fresh name; returns ``gs://NAME``."""
    import fsspec

    name = f"test-{uuid.uuid4().hex[:12]}"
    fsspec.filesystem("gcs").mkdir(name)
    return f"gs://{name}"


def list_objects(url: str) -> list[str]:
    """Every object under ``url``, as paths relative to it."""
    import fsspec

    fs = fsspec.filesystem("gcs")
    fs.invalidate_cache()
    root = url.removeprefix("gs://").rstrip("/")
    return sorted(p[len(root) + 1 :] for p in fs.find(root))


@contextlib.contextmanager
def answering(status: int, pattern: str):
    """A second server, in this process, whose uploads of objects named like ``pattern``
    (a regex over the request's path and query) get ``status`` instead of the usual
    answer: the storage saying what a client does not expect. The variables point at
    it inside the block (and at whatever they named before, after it); yields
    ``(url, hits)``, hits being the requests so answered.
    """
    import re
    from http import HTTPStatus

    import fsspec
    from gcp_storage_emulator import server as emulator_server

    gcs_server.install_patches()
    port = gcs_server.free_port()
    server = emulator_server.create_server("127.0.0.1", port, in_memory=True)
    router, hits = emulator_server.Router.handle, []

    def handle(self, method):
        request = self._request_handler
        upload = method in ("POST", "PUT") and "/upload/" in request.path
        if not (upload and re.search(pattern, request.path)):
            return router(self, method)
        hits.append(f"{method} {request.path}")
        request.rfile.read(int(request.headers.get("Content-Length") or 0))
        response = emulator_server.Response(request)
        response.status = HTTPStatus(status)
        response.json({"error": {"code": status, "message": f"the test's {status} answer"}})
        response.close()

    url = f"http://127.0.0.1:{port}"
    saved = {name: os.environ.get(name) for name in VARIABLES}
    emulator_server.Router.handle = handle
    server.start()
    os.environ.update(dict(zip(VARIABLES, (url, url, "rehearsal"))))
    fsspec.get_filesystem_class("gs").clear_instance_cache()  # (it holds the endpoint)
    try:
        yield url, hits
    finally:
        emulator_server.Router.handle = router
        server.stop()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        fsspec.get_filesystem_class("gs").clear_instance_cache()
