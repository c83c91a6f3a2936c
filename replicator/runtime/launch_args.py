"""`python -m replicator launch`'s command line: its options, its help, and the checks
that refuse a launch that cannot go ahead, in one line, before anything is created.

`replicator.runtime.launch` runs what these parse.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from replicator.errors import LaunchError
from replicator.runtime import shared_paths, slurm, tpu

_COMMAND_HELP = """\
COMMAND after -- is what every process runs:
  train|eval|plot ARGS    python -m replicator train|eval|plot ARGS
  python SCRIPT ARGS      any Python program, e.g. a custom loop that calls
                          rp.initialize() first; `python`/`python3` become this
                          interpreter locally (sys.executable, so the virtualenv
                          is used), the environment's on TPU VMs and
                          .venv/bin/python under SLURM
  ANY OTHER COMMAND       run as given

examples:
  python -m replicator launch local --processes 2 --devices-per-process 4 -- \\
      train --config configs/digits_cnn.py --workdir runs/digits_2x4
  python -m replicator launch local --processes 2 --devices-per-process 4 -- \\
      python my_script.py ARGS
  python -m replicator launch local --processes 2 --gcs -- \\
      train --config configs/digits_cnn.py --workdir gs://rehearsal/digits
  python -m replicator launch tpu --tpu my-pod --zone us-central2-b -- \\
      train --config my_config.py --workdir gs://my-bucket/runs/a
  python -m replicator launch slurm --nodes 2 --gpus-per-node 8 --dry-run -- \\
      python my_script.py ARGS
"""

_TPU_HELP = f"""\
what it does, each gcloud command printed first (--dry-run: printed only):
  0. refuses a local --workdir or --config.data_dir when the pod has several
     workers (they share no disk; --allow-local-workdir runs it anyway; a dry
     run knows the workers from --accelerator-type or --slices). Pre-flight,
     for a train command: compiles its config here for the pod's accelerator
     type and slices (python -m replicator compile; libtpu, the tpu extra, no
     TPU) with the workers' Python and JAX (an environment made here once with
     uv, ~/.cache/replicator/envs; the workers then pin its jax and libtpu) and
     refuses a run that does not fit a chip's HBM, in one line; the report
     stays in ~/.cache/replicator/preflight/NAME. The type is asked of
     gcloud, or given with --accelerator-type (a dry run compiles only with
     it); --no-preflight skips the check
  1. asks every worker whether it has the environment (Python and the
     project's dependencies, keyed by their hash) and, if not, whether it can
     reach what installing takes: PyPI (pypi.org, files.pythonhosted.org) for
     uv and the packages, github.com for uv's CPython; one that cannot is
     refused in one line (the ways out: Cloud NAT, --wheels, --python PATH)
  2. copies one tarball, named by its content hash, to every worker: the
     project's files (git ls-files of the checkout replicator is imported from;
     never .venv, runs/ or data) and the Python files COMMAND names (--config
     FILE, python SCRIPT) with the Python files beside them, at their paths
     relative to this directory, where COMMAND runs. With --wheels, and a
     worker without the environment, also the wheels (pip download --platform
     here, kept in ~/.cache/replicator/wheels)
  3. unpacks it into ~/.replicator/bundles/HASH and, where the environment is
     missing, installs the project's dependencies with its tpu extra in a uv
     virtualenv ~/.replicator/envs/pyX.Y-HASH with Python {tpu.DEFAULT_PYTHON} (--python X.Y, or
     --python PATH: an interpreter on every worker): a code edit installs
     nothing, a change of the dependencies installs anew
  4. keeps the newest --keep-bundles bundles and the environments they use
     (the rest is removed), frees the TPU and starts COMMAND detached on every
     worker, under `python -m replicator.runtime.worker`: it outlives the ssh
     session; its output goes to ~/.replicator/job/worker.log on each worker,
     mirrored to WORKDIR/launch/worker-N.log (slice-S-worker-N.log across
     slices; --log-dir)

follow and stop the job (with the same --tpu, --zone, --project, --slices):
  launch tpu --tpu NAME --zone ZONE --logs [--worker N] [--slice S]
      tail -F the log of worker N (of slice S)
  launch tpu --tpu NAME --zone ZONE --stop [--grace SECONDS]
      SIGTERM to the job on every worker (train saves a checkpoint and exits),
      SIGKILL after --grace seconds; then frees the TPU

Use gs:// paths: the workers share no disk. With --restarts N each
worker runs a failed command again, up to N times; train resumes from its
last checkpoint. A pod that was preempted or recreated has lost its job:
launch the same command again, and train resumes from the checkpoints in the
bucket.

--slices N (a multislice queued resource, named by --tpu) runs the commands
through `gcloud compute tpus queued-resources ssh|scp --worker=all --node=all`,
and a train command gets --config.dcn_mesh='{{"data": N}}' (data parallel across
slices, the config's mesh within each) unless it sets --config.dcn_mesh (a
dcn_mesh set in the config file is replaced: give it on the command line).
"""


# The least each count may be: below it a launch would run nothing (0 processes), or
# break what it ships (0 bundles kept removes the one just shipped).
_LEAST = {
    "local": (("--processes", 1), ("--devices-per-process", 1), ("--restarts", 0)),
    "tpu": (("--slices", 1), ("--restarts", 0), ("--keep-bundles", 1), ("--grace", 0)),
    "slurm": (("--nodes", 1), ("--gpus-per-node", 1)),
}


class _Parser(argparse.ArgumentParser):
    """An argument mistake is a `LaunchError`: one line, exit status 2, as the CLI's."""

    def error(self, message: str):
        raise LaunchError(f"{self.prog}: {message} (--help shows the options)")


def parse(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """Reads ``launch``'s arguments and checks them (`check_arguments`).

    Args:
      argv: the words after ``python -m replicator launch``.

    Returns:
      The options, and the command after ``--``.

    Raises:
      LaunchError: arguments that cannot launch, said in one line.

    >>> args, command = parse(["local", "--processes", "2", "--", "python", "job.py"])
    >>> args.processes, args.devices_per_process, command
    (2, 1, ['python', 'job.py'])
    >>> parse(["local", "--processes", "0", "--", "python", "job.py"])
    Traceback (most recent call last):
    ...
    replicator.errors.LaunchError: launch local --processes 0: give 1 or more
    """
    argv = list(argv)
    command = argv[argv.index("--") + 1 :] if "--" in argv else []
    options = argv[: argv.index("--")] if "--" in argv else argv
    args = _parser().parse_args(options)
    check_arguments(args, command)
    return args, command


def check_arguments(args: argparse.Namespace, command: Sequence[str]) -> None:
    """Refuses options that cannot launch: a missing command (or one given to ``--logs``
    or ``--stop``), a count below its least, ``--gcs``' options without ``--gcs``.

    Raises:
      LaunchError: the first such mistake, in one line.
    """
    follow_or_stop = args.where == "tpu" and (args.logs or args.stop)
    if follow_or_stop and command:
        raise LaunchError("launch tpu --logs and --stop take no command")
    if not command and not follow_or_stop:
        raise LaunchError(
            f"launch {args.where}: give the command after --, e.g. -- train --config FILE ... "
            "or -- python my_script.py ARGS"
        )
    for flag, least in _LEAST[args.where]:
        value = getattr(args, flag.removeprefix("--").replace("-", "_"))
        if value < least:
            raise LaunchError(f"launch {args.where} {flag} {value}: give {least} or more")
    if args.where == "local" and not args.gcs and (args.gcs_dir or args.allow_local_workdir):
        raise LaunchError(
            f"launch local: --gcs-dir and {shared_paths.ALLOW_FLAG} go with --gcs (a rehearsal)"
        )


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="python -m replicator launch",
        usage="%(prog)s {local,tpu,slurm} [options] -- COMMAND [ARGS ...]",
        description="Runs COMMAND as every process of a multi-process run.",
        epilog=_COMMAND_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="where", required=True, metavar="{local,tpu,slurm}")

    def add_parser(name: str, help: str, usage: str, epilog: str) -> argparse.ArgumentParser:
        return sub.add_parser(
            name,
            help=help,
            prog=f"python -m replicator launch {name}",
            usage=usage,
            epilog=epilog,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )

    usage = "%(prog)s [options] -- COMMAND [ARGS ...]"
    local = add_parser("local", "processes on this machine (127.0.0.1)", usage, _COMMAND_HELP)
    _add_local_options(local)
    tpu_usage = (
        "%(prog)s --tpu NAME --zone ZONE [options] -- COMMAND [ARGS ...]\n"
        "       %(prog)s --tpu NAME --zone ZONE [options] --logs [--worker N] [--slice S]\n"
        "       %(prog)s --tpu NAME --zone ZONE [options] --stop [--grace SECONDS]"
    )
    tpu_parser = add_parser(
        "tpu",
        "every worker of a Cloud TPU VM pod (or of every slice of a queued resource)",
        tpu_usage,
        _TPU_HELP + "\n" + _COMMAND_HELP,
    )
    _add_tpu_options(tpu_parser)
    slurm_parser = add_parser("slurm", "an sbatch job", usage, _COMMAND_HELP)
    slurm.add_options(slurm_parser)
    return parser


def _add_local_options(local: argparse.ArgumentParser) -> None:
    local.add_argument(
        "--processes", type=int, required=True, help="processes to start on this machine"
    )
    local.add_argument(
        "--devices-per-process", type=int, default=1, help="fake CPU devices in each process"
    )
    local.add_argument(
        "--restarts",
        type=int,
        default=0,
        help="start a failed run again (all processes, from the last checkpoint) up to N times",
    )
    local.add_argument(
        "--elastic",
        action="store_true",
        help="a process (not 0) killed by a signal does not stop the others (DiLoCo islands)",
    )
    local.add_argument(
        "--gcs",
        action="store_true",
        help="rehearse a pod: a local GCS server for the gs:// paths of COMMAND (its buckets "
        "created), a disk of its own for each process (the rehearse extra)",
    )
    local.add_argument(
        "--gcs-dir",
        metavar="DIR",
        help="--gcs: where the server keeps the objects, across runs "
        "(default: ~/.cache/replicator/gcs)",
    )
    _add_allow_local_workdir(local)


def _add_allow_local_workdir(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        shared_paths.ALLOW_FLAG,
        action="store_true",
        help="accept a local --workdir or --config.data_dir for several hosts (on a pod each "
        "worker keeps its own)",
    )


def _add_tpu_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--tpu",
        required=True,
        metavar="NAME",
        help="the TPU VM's name (with --slices: the queued resource's)",
    )
    parser.add_argument("--zone", required=True, help="its zone, e.g. us-central2-b")
    parser.add_argument("--project", help="its Google Cloud project (default: gcloud's)")
    parser.add_argument(
        "--slices",
        type=int,
        default=1,
        metavar="N",
        help="slices of a multislice queued resource (default 1: a TPU VM)",
    )
    parser.add_argument(
        "--internal-ip", action="store_true", help="reach the workers by their internal IPs"
    )
    parser.add_argument(
        "--restarts",
        type=int,
        default=0,
        metavar="N",
        help="each worker runs a failed command again, from the last checkpoint, up to N times",
    )
    parser.add_argument(
        "--log-dir",
        metavar="DIR",
        help="mirror each worker's log to DIR/worker-N.log, local to the worker or gs:// "
        "(default: WORKDIR/launch when COMMAND has --workdir)",
    )
    parser.add_argument(
        "--accelerator-type",
        metavar="TYPE",
        help="the pod's accelerator type for the pre-flight compile, e.g. v5litepod-16 "
        "(default: asked of gcloud)",
    )
    parser.add_argument(
        "--no-preflight",
        action="store_true",
        help="ship a train command without compiling its config for the pod here first",
    )
    _add_environment_options(parser)
    action = parser.add_mutually_exclusive_group()
    action.add_argument(
        "--logs", action="store_true", help="follow a worker's log instead of starting a job"
    )
    action.add_argument(
        "--stop",
        action="store_true",
        help="stop the job on every worker (SIGTERM: a checkpoint; SIGKILL after --grace) "
        "and free the TPU",
    )
    parser.add_argument("--worker", default="0", metavar="N", help="--logs: the worker (0)")
    parser.add_argument(
        "--slice", default="0", metavar="S", help="--logs with --slices: the slice (0)"
    )
    parser.add_argument(
        "--grace",
        type=int,
        default=300,
        metavar="SECONDS",
        help="--stop: the time to save a checkpoint before SIGKILL (300)",
    )
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")


def _add_environment_options(parser: argparse.ArgumentParser) -> None:
    """launch tpu's options on the workers' environment and disk."""
    parser.add_argument(
        "--python",
        default=tpu.DEFAULT_PYTHON,
        metavar="X.Y|PATH",
        help="the workers' Python: a version uv brings (default: %(default)s, for the newest "
        "JAX and libtpu; the pre-flight compiles with the same, here), or the path of an "
        "interpreter installed on every worker",
    )
    parser.add_argument(
        "--wheels",
        action="store_true",
        help="install the packages from wheels downloaded here for the TPU VMs (pip download "
        "--platform) and shipped with the bundle, not from PyPI",
    )
    parser.add_argument(
        "--keep-bundles",
        type=int,
        default=tpu.KEEP_BUNDLES,
        metavar="N",
        help="the bundles each worker keeps, with the environments they use (%(default)s)",
    )
    _add_allow_local_workdir(parser)
