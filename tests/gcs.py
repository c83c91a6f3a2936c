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
