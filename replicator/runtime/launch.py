"""Launchers: the same command on several local processes, a Cloud TPU pod or SLURM.

``python -m replicator launch local --processes 2 --devices-per-process 4 -- COMMAND``
starts the processes on 127.0.0.1 with fake CPU devices and gloo collectives:
the code path of a real pod, on one machine; with ``--gcs`` they share no disk,
only the buckets of a local GCS server, as a pod's workers
(`replicator.runtime.rehearse`). ``launch tpu`` ships the project to
every worker of a Cloud TPU pod and starts the command there, detached
(`replicator.runtime.tpu`); ``launch slurm`` submits an sbatch job. Both print
their commands (``--dry-run``: only print them); there JAX's own cluster
detection gives each process its id and the coordinator.

COMMAND is a replicator subcommand (``train ...``, ``eval ...``, ``plot ...``),
run as ``python -m replicator train ...``, or any command, e.g. ``python
my_script.py ARGS`` for a custom loop that calls ``rp.initialize()`` first; see
`resolve_command`.

The command line and its checks are `replicator.runtime.launch_args`' (a mistake is
one line, exit status 2, before anything starts); the local processes
`replicator.runtime.local_processes`'.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence

from replicator.errors import LaunchError
from replicator.runtime import launch_args, preflight, rehearse, shared_paths, slurm, tpu
from replicator.runtime.local_processes import free_port_pair as free_port_pair
from replicator.runtime.local_processes import run_processes
from replicator.runtime.processes import ENV_COORDINATOR as ENV_COORDINATOR
from replicator.runtime.processes import ENV_NUM_PROCESSES as ENV_NUM_PROCESSES
from replicator.runtime.processes import ENV_PROCESS_ID as ENV_PROCESS_ID

USAGE_ERROR = 2  # the exit status of a launch that cannot go ahead, as the CLI's

# First words that mean ``python -m replicator <word>`` (the CLI's subcommands).
REPLICATOR_COMMANDS = ("train", "eval", "plot")
# First words replaced by the launcher's interpreter (locally: this virtualenv's).
PYTHON_NAMES = ("python", "python3")


def resolve_command(command: Sequence[str], python: str) -> list[str]:
    """The command each process runs.

    Args:
      command: the words after ``--``.
      python: the interpreter to run Python with (``sys.executable`` locally,
        ``.venv/bin/python`` on a cluster).

    Returns:
      ``python -m replicator COMMAND`` when the first word is a replicator
      subcommand; ``COMMAND`` with a first word ``python``/``python3`` replaced
      by ``python``; any other command as given.

    >>> resolve_command(["train", "--config", "c.py"], "/venv/bin/python")
    ['/venv/bin/python', '-m', 'replicator', 'train', '--config', 'c.py']
    >>> resolve_command(["python", "my_script.py", "out"], "/venv/bin/python")
    ['/venv/bin/python', 'my_script.py', 'out']
    >>> resolve_command(["bash", "run.sh"], "/venv/bin/python")
    ['bash', 'run.sh']
    """
    command = list(command)
    if not command:
        raise ValueError("No command to launch; give it after --, e.g. -- python my_script.py.")
    if command[0] in REPLICATOR_COMMANDS:
        return [python, "-m", "replicator", *command]
    if command[0] in PYTHON_NAMES:
        return [python, *command[1:]]
    return command


def launch_local(
    command: Sequence[str],
    *,
    processes: int,
    devices_per_process: int,
    grace_s: float = 30.0,
    python: str = sys.executable,
    elastic: bool = False,
    restarts: int = 0,
    env_of: Callable[[int], Mapping[str, str]] | None = None,
) -> int:
    """Runs ``command`` (see `resolve_command`) as ``processes`` local processes.

    The processes find each other through ``REPLICATOR_COORDINATOR``,
    ``REPLICATOR_NUM_PROCESSES`` and ``REPLICATOR_PROCESS_ID``, which
    ``rp.initialize()`` (and ``python -m replicator train``) read. Each process
    gets ``devices_per_process`` fake CPU devices. Output lines are prefixed
    with ``[i]``. SIGTERM and SIGINT are forwarded to every process. If one
    process fails, the others are stopped (SIGTERM, then SIGKILL after
    ``grace_s``) and the exit code is non-zero.

    With ``elastic`` (DiLoCo's elastic islands, `replicator.runtime.elastic.ElasticIslands`)
    a process other than 0 that dies is reported and the others go on; process
    0 failing still stops them all (it serves JAX's coordination service).

    With ``restarts``, a failed run is started again, all processes, up to that
    many times: ``train`` resumes from its last checkpoint (a custom loop from
    its own), e.g. after a sync timeout of elastic islands or the loss of
    process 0.

    ``env_of(i)`` gives variables of process ``i``'s own (``launch local --gcs``:
    the local GCS server's and a private disk, `replicator.runtime.rehearse`).

    Returns:
      0 if every process succeeded (elastic: process 0 and every process that
      did not die of a signal), else the first failure's exit code (or 1).

    Raises:
      LaunchError: fewer than 1 process or device per process, or negative restarts:
        a run of nothing is refused, never reported as a success.
    """
    if processes < 1 or devices_per_process < 1 or restarts < 0:
        raise LaunchError(
            f"launch_local: processes ({processes}) and devices_per_process "
            f"({devices_per_process}) must be 1 or more, restarts ({restarts}) 0 or more"
        )
    argv = resolve_command(command, python)
    once = functools.partial(
        run_processes, argv, processes, devices_per_process, grace_s=grace_s, elastic=elastic,
        env_of=env_of,
    )  # fmt: skip
    code = once()
    for attempt in range(1, restarts + 1):
        if code == 0:
            break
        print(
            f"launch: the run failed (exit code {code}); restart {attempt} of {restarts}, "
            "from the last checkpoint.",
            file=sys.stderr,
            flush=True,
        )
        code = once()
    return code


def main(argv: Sequence[str]) -> int:
    """``python -m replicator launch {local,tpu,slurm} [options] -- COMMAND...``.

    Returns:
      The exit status: the run's for ``local``; 2 after a one-line ``error: ...``
      for a launch that cannot go ahead (arguments that cannot launch, checked before
      anything is created; no gcloud, no gcloud account, no sbatch).
    """
    try:
        args, command = launch_args.parse(argv)
        if args.where == "local":
            return _launch_local(args, command)
        if args.where == "slurm":
            return _launch_slurm(args, command)
        try:
            return _launch_tpu(args, command)
        except KeyboardInterrupt:  # Ctrl-C ends following a log, or the launch: not the job
            return 130
    except LaunchError as e:
        return _error(str(e))


def _launch_local(args: argparse.Namespace, command: list[str]) -> int:
    program = resolve_command(command, sys.executable)[0]
    if shutil.which(program) is None:  # before a rehearsal starts its server
        raise LaunchError(f"cannot run {program!r}: no such program on PATH.")
    rehearsal, outcome = contextlib.nullcontext(), {}
    if args.gcs:
        rehearsal = rehearse.rehearsal(
            command,
            args.processes,
            directory=args.gcs_dir,
            allow_local_paths=args.allow_local_workdir,
            outcome=outcome,
        )
    with rehearsal as env_of:
        outcome["code"] = launch_local(
            command,
            processes=args.processes,
            devices_per_process=args.devices_per_process,
            elastic=args.elastic,
            restarts=args.restarts,
            env_of=env_of,
        )
    return outcome["code"]


def _error(message: str) -> int:
    print(f"error: {message}", file=sys.stderr, flush=True)
    return USAGE_ERROR


def _launch_tpu(args: argparse.Namespace, command: list[str]) -> int:
    pod = tpu.Pod(args.tpu, args.zone, args.project, args.slices, args.internal_ip)
    if not (args.logs or args.stop):
        if not args.allow_local_workdir:
            _check_shared_paths(args, pod, command)
        # The pre-flight compiles with the workers' JAX, which they then pin.
        make = not (args.dry_run or args.no_preflight or command[:1] != ["train"])
        if make:
            tpu.check_gcloud()  # before the environment is made (minutes, once)
        compiler = preflight.compiler_for(args.python, make=make)
        tpu.launch(
            command,
            pod,
            python=args.python,
            pins=preflight.pins(compiler, args.python),
            wheels=args.wheels,
            keep_bundles=args.keep_bundles,
            restarts=args.restarts,
            log_dir=args.log_dir,
            dry_run=args.dry_run,
            before_shipping=None if args.no_preflight else functools.partial(
                preflight.check_fit, pod=pod, accelerator=args.accelerator_type,
                python=compiler, asked=args.python, dry_run=args.dry_run,
            ),
        )  # fmt: skip
        if not args.dry_run:
            again = f"python -m replicator launch tpu {shlex.join(_pod_options(pod))}"
            print(f"# follow: {again} --logs\n# stop:   {again} --stop", flush=True)
        return 0
    if not args.dry_run:
        tpu.check_gcloud()
    if args.logs:
        gcloud = tpu.logs_command(pod, args.worker, args.slice)
    else:
        gcloud = tpu.stop_command(pod, args.grace)
    print(shlex.join(gcloud), flush=True)
    return 0 if args.dry_run else subprocess.run(gcloud, check=False).returncode


def _check_shared_paths(args: argparse.Namespace, pod: tpu.Pod, command: list[str]) -> None:
    """A local workdir on a pod of several workers: refused (the pod's accelerator type
    is asked of gcloud when that decides it, and kept for the pre-flight)."""
    if not shared_paths.local_paths(command):
        return
    if args.accelerator_type is None and pod.slices == 1 and not args.dry_run:
        tpu.check_gcloud()
        try:
            args.accelerator_type = preflight.accelerator_type(pod)
        except tpu.LaunchError:  # then it says what a dry run says: how many is unknown
            pass
    workers = shared_paths.pod_workers(args.accelerator_type, pod.slices)
    where = pod.name + (f" ({args.accelerator_type})" if args.accelerator_type else "")
    shared_paths.check_shared_paths(command, workers=workers, where=where)


def _pod_options(pod: tpu.Pod) -> list[str]:
    options = ["--tpu", pod.name, "--zone", pod.zone]
    options += ["--project", pod.project] if pod.project else []
    options += ["--slices", str(pod.slices)] if pod.slices > 1 else []
    return options + (["--internal-ip"] if pod.internal_ip else [])


def _launch_slurm(args: argparse.Namespace, command: list[str]) -> int:
    script = slurm.slurm_script(
        resolve_command(command, ".venv/bin/python"),
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        process_per_gpu=not args.process_per_node,
    )
    return slurm.submit(script, dry_run=args.dry_run)
