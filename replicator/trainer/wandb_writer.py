"""Weights & Biases beside ``metrics.jsonl`` and TensorBoard: one W&B run per workdir.

`MetricWriter` keeps one of these when its ``writers`` name ``"wandb"``. The run's
id is kept in ``WORKDIR/wandb_run_id`` (made on the workdir's first start), so
every start in that workdir, a resume after preemption included, continues the
same W&B run (``resume="allow"``). The run's config goes to W&B's config, each
record to the run's history under the keys TensorBoard gets (``train/loss``,
``test/accuracy``: ``split/metric`` at the record's step), and the final summary
record to the run's summary (``summary/mfu``, ...).

W&B cannot delete history it has, and its steps only go up, so the steps a
resumed run redoes after its checkpoint are not sent again: `MetricWriter` sends
only records of steps after the last one the earlier attempt wrote to
``metrics.jsonl`` (a resumed run redoes its steps with the same values, so what
W&B holds for them stands). W&B's rewind (``resume_from``) would cut the history
back instead, but it is a private preview and needs the server. A kill -9 can cost
W&B the records of the last step before it (W&B sends a step's row when the next
step starts); a preemption or a crash that closes the writer loses nothing. A run
that starts using W&B part way (no ``wandb_run_id`` yet) first sends the records
``metrics.jsonl`` keeps.

Everything else is W&B's own: ``WANDB_MODE`` (``offline`` writes the run under
``WANDB_DIR``, or else ``WORKDIR/wandb/``, to upload later with ``wandb sync``;
``disabled``), ``WANDB_PROJECT``, ``WANDB_ENTITY``, ``WANDB_API_KEY`` and the rest.
"""

from __future__ import annotations

import logging
import os
import secrets
import tempfile
from collections.abc import Mapping
from typing import Any

from replicator import storage
from replicator.errors import ConfigError

log = logging.getLogger("replicator")

RUN_ID_FILE = "wandb_run_id"
DEFAULT_PROJECT = "replicator"


def check_wandb() -> None:
    """Raises a one-line `ConfigError` unless ``wandb`` can be imported."""
    try:
        import wandb  # noqa: F401
    except ImportError as e:
        raise ConfigError(
            f"writers has 'wandb' but wandb cannot be imported ({e}): pip install "
            "'replicator[wandb]' (or drop 'wandb' from writers)"
        ) from None


class WandbRun:
    """The workdir's W&B run, started (or continued) on construction; process 0 only.

    Args:
      workdir: the run's directory (local or ``gs://``): it keeps the run's id.
      config: the run's config, shown as the W&B run's config.
      project: the W&B project (default: ``$WANDB_PROJECT``, else "replicator").

    Attributes:
      created: whether this start made the workdir's W&B run (else it continues one).
    """

    def __init__(
        self,
        workdir: str,
        *,
        config: Mapping[str, Any] | None = None,
        project: str | None = None,
    ):
        import wandb

        run_id, self.created = _run_id(workdir)
        try:
            self._run = wandb.init(
                project=project or os.environ.get("WANDB_PROJECT") or DEFAULT_PROJECT,
                id=run_id,
                resume="allow",
                name=os.path.basename(workdir.rstrip("/")) or None,
                dir=_local_dir(workdir),
                config=dict(config or {}),
                allow_val_change=True,  # a resumed run may change a key (the driver warns)
                reinit="create_new",  # its own run, even beside another in the process
            )
        except wandb.errors.UsageError as e:  # no login, a bad setting: the user's to fix
            raise ConfigError(
                f"Weights & Biases: {e} (or WANDB_MODE=offline: runs kept locally for `wandb sync`)"
            ) from None
        if self._run.offline:
            log.info("W&B run %s, offline: %s", run_id, self._run.settings.sync_dir)
        elif not self._run.disabled:
            log.info("W&B run %s: %s", run_id, self._run.url)

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        """Adds ``scalars`` to the run's history at ``step``."""
        if scalars:
            self._run.log(dict(scalars), step=step)

    def update_summary(self, values: Mapping[str, Any]) -> None:
        """Sets keys of the run's summary."""
        self._run.summary.update(dict(values))

    def close(self) -> None:
        self._run.finish()


def _run_id(workdir: str) -> tuple[str, bool]:
    """The id in ``WORKDIR/wandb_run_id``, and whether it was written there just now."""
    path = storage.join(workdir, RUN_ID_FILE)
    if storage.exists(path):
        run_id = storage.read_text(path).strip()
        if run_id:
            return run_id, False
    run_id = secrets.token_hex(4)  # W&B's ids: lowercase letters and digits
    storage.write_text(path, run_id + "\n")
    return run_id, True


def _local_dir(workdir: str) -> str | None:
    """Where W&B keeps the run's files: ``$WANDB_DIR`` (W&B reads it itself, so None),
    else the workdir, else (a bucket: W&B writes only local files) a temporary one."""
    if os.environ.get("WANDB_DIR"):
        return None
    if storage.is_remote(workdir):
        return tempfile.mkdtemp(prefix="replicator-wandb-")
    return workdir
