"""A pod rehearsed on one machine: ``launch local --gcs``.

The workers of a pod share no disk, only buckets. ``python -m replicator launch
local --processes N --gcs -- COMMAND`` runs COMMAND's N processes as a pod runs
its workers: it starts a Google Cloud Storage server on 127.0.0.1
(`replicator.runtime.gcs_server`, the ``rehearse`` extra), creates the buckets the
command names (``gs://BUCKET/...``), gives every process the variables through
which the client libraries reach that server (``STORAGE_EMULATOR_HOST``,
``TENSORSTORE_GCS_HTTP_URL``, ``GOOGLE_AUTH_TOKEN_FOR_TESTING``) and a disk of its
own: a private temporary directory as its ``HOME``, ``TMPDIR``, cache
(``XDG_CACHE_HOME``) and tfds data (``TFDS_DATA_DIR``). A local ``--workdir`` is
refused, as on a pod (`replicator.runtime.shared_paths`). The server keeps the
objects in a directory (``--gcs-dir``), so a later ``launch local --gcs`` (an
``eval``, a resumed ``train``, TensorBoard) finds them; it stops with the run.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence

from replicator.errors import LaunchError
from replicator.runtime import shared_paths
from replicator.runtime.gcs_server import LocalGCS, have_emulator
from replicator.runtime.tpu import workdir_of
from replicator.runtime.worker_env import cache_dir


def default_directory() -> str:
    """Where the rehearsals' objects are kept: ``$XDG_CACHE_HOME/replicator/gcs``."""
    return str(cache_dir("gcs"))


def buckets_of(command: Sequence[str]) -> list[str]:
    """The buckets ``command`` names, in order.

    >>> buckets_of(["train", "--workdir", "gs://rehearsal/run", "--config.data_dir=gs://d/t"])
    ['rehearsal', 'd']
    """
    found = []
    for word in command:
        for name in re.findall(r"gs://([a-z0-9][a-z0-9._-]*)", word):
            if name not in found:
                found.append(name)
    return found


def private_environ(root: str, process: int) -> dict[str, str]:
    """The variables that give process ``process`` a disk of its own under ``root``."""
    home = os.path.join(root, f"process-{process}")
    variables = {
        "HOME": home,
        "TMPDIR": os.path.join(home, "tmp"),
        "XDG_CACHE_HOME": os.path.join(home, ".cache"),
        "TFDS_DATA_DIR": os.path.join(home, "tensorflow_datasets"),
    }
    for path in variables.values():
        os.makedirs(path, exist_ok=True)
    return variables


@contextlib.contextmanager
def rehearsal(
    command: Sequence[str],
    processes: int,
    *,
    directory: str | None = None,
    allow_local_paths: bool = False,
    outcome: dict | None = None,
) -> Iterator[Callable[[int], dict[str, str]]]:
    """Runs a local GCS server for ``command`` while the context lasts.

    Args:
      command: the processes' command; the buckets it names are created.
      processes: how many processes run it.
      directory: where the server keeps the objects (default: `default_directory`).
      allow_local_paths: accept a local ``--workdir`` or ``--config.data_dir``.
      outcome: where the caller puts the run's exit status (``"code"``) before the
        context ends: the closing line advises evaluating only a run that succeeded.

    Yields:
      A function of a process index to the variables of that process: the
      server's and a private ``HOME``/``TMPDIR``/cache/tfds directory
      (`private_environ`), removed at the end.

    Raises:
      LaunchError: gcp-storage-emulator is missing, a local workdir, or the server
        did not start; each one line.
    """
    if not allow_local_paths:
        shared_paths.check_shared_paths(
            command, workers=processes, where="this rehearsal", rehearsal=True
        )
    if not have_emulator():
        raise LaunchError(
            "launch local --gcs runs a local GCS server, which needs gcp-storage-emulator: "
            "pip install -e '.[rehearse]'"
        )
    directory = os.path.abspath(os.path.expanduser(directory or default_directory()))
    private = tempfile.mkdtemp(prefix="replicator-rehearsal-")
    with LocalGCS(directory) as server:
        buckets = buckets_of(command)
        for bucket in buckets:
            server.create_bucket(bucket)
        processes_each = "1 process" if processes == 1 else f"{processes} processes, each"
        _say(
            f"a pod rehearsed: {processes_each} with a disk of its own "
            f"({private}/process-N), sharing only the GCS server at {server.url} "
            f"(objects kept in {directory})"
        )
        workdir = workdir_of(command)
        workdir = workdir if workdir and workdir.startswith("gs://") else None
        if buckets:
            named = f"; the workdir: {workdir}" if workdir else ""
            _say(f"buckets {', '.join(f'gs://{b}' for b in buckets)}{named}")
        try:
            yield lambda i: {**server.environ, **private_environ(private, i)}
        finally:
            shutil.rmtree(private, ignore_errors=True)
    if workdir and list(command[:1]) == ["train"] and (outcome or {}).get("code", 0) != 0:
        _say(f"the GCS server stopped; {workdir} stays in {directory}")
    elif workdir and list(command[:1]) == ["train"]:
        again = ["launch", "local", "--processes", "1", "--gcs"]
        again += [] if directory == default_directory() else ["--gcs-dir", directory]
        _say(
            f"the GCS server stopped; {workdir} stays in {directory}. Evaluate it with "
            f"python -m replicator {shlex.join(again)} -- eval --workdir {workdir}"
        )
    elif buckets:
        _say(f"the GCS server stopped; the buckets stay in {directory}")


def _say(message: str) -> None:
    print(f"launch: {message}", file=sys.stderr, flush=True)
