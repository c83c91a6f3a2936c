"""The paths every process of a multi-host run must share: on a pod, only buckets are.

The workers of a TPU pod share no disk. A ``train`` command whose ``--workdir`` is a
local path would run on every worker all the same, each keeping its own
checkpoints, metrics and logs on its own disk, and nothing would say so; a local
``--config.data_dir`` would need its own copy of the data on every worker.
`check_shared_paths` refuses both in one line, before anything is shipped (``launch
tpu``) or started (``launch local --gcs``, the rehearsal of a pod, whose processes
share this machine's disk but must not rely on it), unless asked to allow them.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from replicator.errors import LaunchError

# The words of a command that name storage every process must see the same.
SHARED_FLAGS = ("--workdir", "--config.data_dir")
ALLOW_FLAG = "--allow-local-workdir"
# gcloud's accelerator types whose number counts TensorCores (two per chip) rather
# than chips, and the chips one host (TPU VM worker) drives in a multi-host slice.
_COUNTS_CORES = ("v2", "v3", "v4", "v5p", "tpu7x")
_CHIP_COUNTS = ("v5e", "v5litepod", "v6e")
_CHIPS_PER_HOST = 4


def local_paths(command: Sequence[str]) -> list[tuple[str, str]]:
    """The flags of `SHARED_FLAGS` in ``command`` whose value is a local path.

    >>> local_paths(["train", "--workdir", "runs/x", "--config.data_dir=gs://b/tfds"])
    [('--workdir', 'runs/x')]
    >>> local_paths(["train", "--workdir=gs://b/run", "--config.data_dir", "None"])
    []
    """
    words, found = list(command), []
    for i, word in enumerate(words):
        flag, equals, value = word.partition("=")
        if flag not in SHARED_FLAGS:
            continue
        if not equals and i + 1 < len(words):
            value = words[i + 1]
        if value.strip("'\"") not in ("", "None") and "://" not in value:
            found.append((flag, value))
    return found


def pod_workers(accelerator: str | None, slices: int = 1) -> int | None:
    """The TPU VM workers (hosts) of ``slices`` slices of ``accelerator``; None when
    neither says (an unknown type, one slice).

    >>> pod_workers("v4-8"), pod_workers("v4-32"), pod_workers("v5litepod-8")
    (1, 4, 1)
    >>> pod_workers("v5litepod-16", slices=2), pod_workers(None), pod_workers(None, 2)
    (8, None, 2)
    """
    match = re.fullmatch(r"([a-z0-9]+?)-(\d+)", (accelerator or "").strip().lower())
    if match is None or match.group(1) not in (*_COUNTS_CORES, *_CHIP_COUNTS):
        return slices if slices > 1 else None
    chips = int(match.group(2)) // (2 if match.group(1) in _COUNTS_CORES else 1)
    single_host = 8 if match.group(1) in _CHIP_COUNTS else _CHIPS_PER_HOST
    hosts = 1 if chips <= single_host else -(-chips // _CHIPS_PER_HOST)
    return hosts * slices


def check_shared_paths(
    command: Sequence[str], *, workers: int | None, where: str, rehearsal: bool = False
) -> None:
    """Refuses a command whose workdir or data_dir is local when several hosts run it.

    Args:
      command: the job's command.
      workers: the hosts that run it (None: unknown, as in a dry run without
        ``--accelerator-type``, or when gcloud cannot say; refused too, with how to tell).
      where: the pod's name, or ``this rehearsal``.
      rehearsal: the processes run on this machine (``launch local --gcs``).

    Raises:
      LaunchError: one line naming the paths, what goes wrong, and the ways out.
    """
    local = local_paths(command)
    if not local or workers == 1:
        return
    named = " and ".join(f"{flag} {value}" for flag, value in local)
    paths = "are local paths" if len(local) > 1 else "is a local path"
    alone = "each would keep its own checkpoints, metrics and data"
    if rehearsal:
        why = f"which the {workers} processes of {where} share, but a pod's workers would not"
        out = f" ({alone}). Give a gs:// path on the rehearsal's server (e.g. gs://rehearsal/run)"
    elif workers is None:
        why = (
            f"but a pod's workers share no disk ({alone}), and how many {where} has is unknown here"
        )
        out = ". Give a gs:// path, --accelerator-type TYPE (one worker may keep local paths)"
    else:
        why = f"but the {workers} workers of {where} share no disk"
        out = f": {alone}. Give a gs:// path (docs/pods.md)"
    raise LaunchError(f"{named} {paths}, {why}{out}, or {ALLOW_FLAG} to run it anyway.")
