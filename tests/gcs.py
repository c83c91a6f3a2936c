"""A local GCS server for tests: gcp-storage-emulator, reached through the libraries'
own variables (no project-specific switch, no client mock)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import uuid

VARIABLES = ("STORAGE_EMULATOR_HOST", "TENSORSTORE_GCS_HTTP_URL", "GOOGLE_AUTH_TOKEN_FOR_TESTING")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def emulator():
    """Starts the server (in memory; tests/gcs_server.py), sets the variables, yields its
    URL; stops it after."""
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, os.path.join(os.path.dirname(__file__), "gcs_server.py"), str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            break
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("gcp-storage-emulator did not start") from None
            time.sleep(0.1)
    saved = {name: os.environ.get(name) for name in VARIABLES}
    os.environ.update(
        STORAGE_EMULATOR_HOST=url, TENSORSTORE_GCS_HTTP_URL=url, GOOGLE_AUTH_TOKEN_FOR_TESTING="x"
    )
    try:
        yield url
    finally:
        server.terminate()
        server.wait(timeout=10)
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
