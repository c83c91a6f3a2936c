"""The mistakes a user can make, as types: every one is a `UserError`.

A `UserError` says what was wrong with what the user gave (a flag, a config, a
workdir, a checkpoint, a mesh, an axis name, a launch) and how to fix it, so
``python -m replicator`` prints it as one line, ``error: ...``, with exit status
2. Any other exception is a bug and keeps its traceback (exit status 1). One
`UserError` is no mistake: a `StorageUnavailableError` (a storage outage) is one
line too, with its own exit status, 75.

Each class keeps the built-in base it had before it lived here (a `ConfigError`
is a ``ValueError``, a `StorageError` an ``OSError``), so ``except`` clauses
written for those keep working. The modules that raise them re-export them under
their old names (``replicator.checkpoints.checkpoint.CorruptCheckpointError``). This module
imports nothing of the project, so every layer can raise these.

>>> issubclass(ConfigError, ValueError) and issubclass(ConfigError, UserError)
True
"""

from __future__ import annotations


class UserError(Exception):
    """A mistake in what the user asked for, not a bug: reported in one line."""


class UsageError(UserError):
    """A command line that cannot run: an unknown command or flag, a missing argument."""


class ConfigError(UserError, ValueError):
    """A mistake in a config (or in a run's saved one), found by the trainer or by an
    experiment checking its settings."""


class StorageError(UserError, OSError):
    """A path cannot be read or written: a missing bucket, no permission, no answer."""


class StorageUnavailableError(StorageError):
    """The storage did not answer for the whole deadline (`replicator.storage.DEADLINE_S`):
    an outage, not a mistake. Nothing is lost: the same command, rerun once the storage
    answers, resumes from the last checkpoint. ``python -m replicator`` reports it in one
    line with exit status 75 (``EX_TEMPFAIL``: try again later)."""


class CheckpointMismatchError(UserError, ValueError):
    """A checkpoint's parameters do not fit the model being restored."""


class CorruptCheckpointError(UserError, RuntimeError):
    """A finalized checkpoint cannot be read (files truncated or missing)."""


class CheckpointNotFoundError(UserError, FileNotFoundError):
    """No checkpoint of the step asked for, or no checkpoint at all."""


class ShardingError(UserError, ValueError):
    """Rules that do not fit the model or the mesh (raised under ``strict=True``)."""


class AxisNameError(UserError, NameError):
    """A collective named an axis that is not the replicas' (``repl.axis_name``)."""


class DatasetError(UserError, ValueError):
    """A dataset that cannot be read as asked: an unknown name or split, records
    without a feature the experiment reads, examples of different shapes."""


class DatasetNotPreparedError(DatasetError):
    """A dataset's files are missing and cannot be built on this machine."""


class WorkdirBusyError(UserError):
    """Another run holds the workdir's lease (`replicator.trainer.lease`)."""


class LaunchError(UserError):
    """A launch that cannot go ahead (no gcloud, no account, no TPU of that name)."""


class TopologyError(UserError, ValueError):
    """A TPU topology that cannot be compiled for: an accelerator name that is not one,
    a mesh that does not divide its chips, or no libtpu on this machine."""
