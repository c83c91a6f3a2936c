"""A checkpoint directory on its storage: checked, its failures named, its steps set aside.

`replicator.checkpoints.checkpoint.Checkpoints` keeps its steps in one directory, on a local
disk or in a ``gs://`` bucket, and leaves the files to Orbax. This is what it
needs of that directory besides:

* `check_directory`: a missing or silent bucket is one line before Orbax starts,
  and tensorstore (Orbax's array writer) gives up on a bucket that does not
  answer within the storage deadline (`replicator.storage.DEADLINE_S`), as
  gcsfs and the storage layer's own calls do;
* `storage_errors`: what Orbax raises when the storage fails (its gcsfs calls,
  tensorstore's reads and writes, a save's ``before_commit``) becomes the
  one-line `StorageError` it stands for, a `StorageUnavailableError` for an
  outage; every other error stays as it is; `save_errors`, for a save, also
  makes any other answer of the storage service one line (a save never ends
  in a traceback for what the bucket said);
* `move_aside` and `unfinished_steps`: a step that must make way (saved again,
  unreadable, a save cut short by a kill or an outage) moves to
  ``<directory>.<reason>/<step>``, never deleted.
"""

from __future__ import annotations

import contextlib
import itertools
import re
import traceback
from collections.abc import Iterable, Iterator

import jax
import orbax.checkpoint as ocp

from replicator import storage
from replicator.runtime import compat

_BARRIERS = itertools.count()  # every process moves the same steps aside, in the same order


def check_directory(directory: str) -> None:
    """Fails in one line when the bucket of ``directory`` is missing or does not answer,
    and bounds tensorstore's retries of a bucket to the storage deadline (a local
    ``directory``: nothing to do).

    Raises:
      StorageError: no such bucket, no permission, or no answer in time.
    """
    storage.check_bucket(directory)  # a missing bucket: one line, not Orbax's retries
    if storage.is_remote(directory):
        compat.set_orbax_gcs_retries(storage.tensorstore_retries())


@contextlib.contextmanager
def storage_errors(what: str, directory: str) -> Iterator[None]:
    """Raises a storage failure in the block (``directory`` in a bucket) as the
    one-line `StorageError` it stands for, ``cannot {what} {directory}: ...``; any
    other error as it is.

    Example::

      with storage_errors("save checkpoint 80 in", directory):
          manager.wait_until_finished()
    """
    try:
        yield
    except Exception as e:
        error = storage.failure(e, what, directory) if storage.is_remote(directory) else None
        if error is None or error is e:
            raise
        raise type(error)(str(error)) from e


@contextlib.contextmanager
def save_errors(what: str, directory: str) -> Iterator[None]:
    """`storage_errors` for a save, and besides: any other answer of the storage service
    (an HTTP status that gcsfs or tensorstore reports, which no rule above expects) as
    a `StorageUnavailableError`, one line. The save was not committed, so nothing is
    lost: the previous checkpoint stands, and a rerun resumes from it. (A lost answer
    retried, say, draws a 404 or a 410 from a server that finished the upload.)

    Example::

      with save_errors("save checkpoint 80 in", directory):
          manager.wait_until_finished()
    """
    try:
        with storage_errors(what, directory):
            yield
    except storage.StorageError:
        raise
    except Exception as e:
        answer = _storage_answer(e, directory) if storage.is_remote(directory) else None
        if answer is None:
            raise
        raise storage.StorageUnavailableError(
            f"cannot {what} {directory}: the storage service gave an answer a save does not "
            f"expect ({type(answer).__name__}: {_first_line(answer)})"
        ) from e


def _storage_answer(error: BaseException, directory: str) -> BaseException | None:
    """The error in ``error``'s chain that is the storage service's answer, if any:
    gcsfs's (its HTTP errors; an OSError it raised for a status), or tensorstore's
    about the bucket of ``directory`` (a ValueError naming it, with tensorstore's spec)."""
    bucket = f"gs://{storage.bucket_of(directory)}/"
    for e in storage.causes(error):
        if type(e).__module__.split(".")[0] == "gcsfs" or (
            isinstance(e, OSError) and _raised_in(e, ("gcsfs", "aiohttp"))
        ):
            return e
        if isinstance(e, ValueError) and "tensorstore_spec=" in str(e) and bucket in str(e):
            return e
    return None


def _raised_in(error: BaseException, packages: tuple[str, ...]) -> bool:
    """Whether ``error`` was raised by code of one of ``packages``."""
    frames = traceback.extract_tb(error.__traceback__)
    return bool(frames) and any(f"/{p}/" in frames[-1].filename for p in packages)


def _first_line(error: BaseException) -> str:
    """The error's first line, without tensorstore's spec dump (which says nothing to a
    reader), at most 300 characters."""
    lines = str(error).strip().splitlines()
    return re.split(r"\s*\[tensorstore_spec=", lines[0])[0].rstrip(" :;,")[:300] if lines else ""


def move_aside(directory: str, step: int, reason: str) -> str:
    """Moves ``directory/step`` to ``<directory>.<reason>/<step>`` (``<step>.<n>`` when
    that is taken) on process 0, every process waiting for it.

    Returns:
      Where the step is now.
    """
    aside = f"{directory}.{reason}"
    target, n = storage.join(aside, str(step)), 0
    if jax.process_index() == 0:
        while storage.exists(target):
            n += 1
            target = storage.join(aside, f"{step}.{n}")
        storage.move(storage.join(directory, str(step)), target)
    if jax.process_count() > 1:
        ocp.multihost.sync_global_processes(f"replicator_aside_{step}_{next(_BARRIERS)}")
    return target


def unfinished_steps(directory: str, finished: Iterable[int]) -> list[int]:
    """The steps with files in ``directory`` that are not among ``finished``: in a
    bucket, saves cut short. (Orbax marks a finished step there with
    ``commit_success.txt`` instead of renaming a temporary directory, so an
    unfinished one leaves objects at its step's name, which the next save of that
    step would delete.)"""
    finished = set(finished)
    return [int(n) for n in storage.listdir(directory) if n.isdigit() and int(n) not in finished]
