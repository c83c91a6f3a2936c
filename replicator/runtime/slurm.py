"""``launch slurm``: the same command as an sbatch job on a SLURM GPU cluster.

`slurm_script` writes the job: one process per GPU by default, each started by
``srun``; JAX reads the process ids, the count and the coordinator from SLURM's
variables, so the command needs nothing of its own. `submit` writes it to
``replicator.sbatch`` and hands it to ``sbatch`` (``--dry-run``: prints it).
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import subprocess
from collections.abc import Sequence

from replicator.errors import LaunchError


def slurm_script(
    argv: Sequence[str],
    *,
    nodes: int,
    gpus_per_node: int,
    process_per_gpu: bool = True,
    job_name: str = "replicator",
    time_limit: str = "24:00:00",
) -> str:
    """An sbatch script running ``argv`` on ``nodes`` nodes.

    Args:
      argv: the command every process runs
        (`replicator.runtime.launch.resolve_command`'s).
      nodes: the nodes of the job.
      gpus_per_node: the GPUs of each node it uses.
      process_per_gpu: one process per GPU (else one per node).
      job_name: SLURM's name of the job.
      time_limit: its time limit. ``--signal`` asks SLURM for a SIGTERM two
        minutes before, which replicator turns into a checkpoint.

    >>> print(slurm_script(["python", "x.py"], nodes=2, gpus_per_node=8).splitlines()[-1])
    srun --kill-on-bad-exit=1 python x.py
    """
    tasks = gpus_per_node if process_per_gpu else 1
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={job_name}",
        f"#SBATCH --nodes={nodes}",
        f"#SBATCH --ntasks-per-node={tasks}",
        f"#SBATCH --gpus-per-node={gpus_per_node}",
        f"#SBATCH --time={time_limit}",
        "#SBATCH --signal=TERM@120",
        "#SBATCH --output=%x-%j.out",
        "set -euo pipefail",
        f"srun --kill-on-bad-exit=1 {shlex.join(argv)}",
    ]
    return "\n".join(lines) + "\n"


def submit(script: str, *, dry_run: bool = False) -> int:
    """Writes ``script`` to ``replicator.sbatch`` and submits it; returns sbatch's status.

    Raises:
      LaunchError: there is no sbatch here (nothing is written).
    """
    if dry_run:
        print(script, end="")
        return 0
    if shutil.which("sbatch") is None:
        raise LaunchError(
            "launch slurm needs sbatch, and there is no sbatch on PATH: run it on a SLURM "
            "login node (--dry-run prints the script)."
        )
    with open("replicator.sbatch", "w") as f:
        f.write(script)
    print("wrote replicator.sbatch", flush=True)
    return subprocess.run(["sbatch", "replicator.sbatch"], check=False).returncode


def add_options(parser: argparse.ArgumentParser) -> None:
    """``launch slurm``'s options."""
    parser.add_argument("--nodes", type=int, required=True, help="nodes of the job")
    parser.add_argument(
        "--gpus-per-node", type=int, required=True, help="GPUs of each node the job uses"
    )
    parser.add_argument(
        "--process-per-node",
        action="store_true",
        help="one process per node instead of one per GPU",
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="print the sbatch script, submit nothing"
    )
