"""Launchers: the same command on several local processes, a Cloud TPU pod or SLURM.

``python -m replicator launch local --processes 2 --devices-per-process 4 -- COMMAND``
starts the processes on 127.0.0.1 with fake CPU devices and gloo collectives:
the code path of a real pod, on one machine. ``launch tpu`` and ``launch slurm``
run (or, with ``--dry-run``, print) the commands for real clusters; there JAX's
own cluster detection gives each process its id and the coordinator.

COMMAND is a replicator subcommand (``train ...``, ``eval ...``, ``plot ...``),
run as ``python -m replicator train ...``, or any command, e.g. ``python
my_script.py ARGS`` for a custom loop that calls ``rp.initialize()`` first; see
`resolve_command`.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

from replicator.runtime.processes import ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID

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


def free_port_pair() -> int:
    """A loopback port p with p + 1 also free (the coordinator and the roll call)."""
    for _ in range(100):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
                return port
    raise RuntimeError("No free pair of loopback ports found.")


def launch_local(
    command: Sequence[str],
    *,
    processes: int,
    devices_per_process: int,
    grace_s: float = 30.0,
    python: str = sys.executable,
    elastic: bool = False,
    restarts: int = 0,
) -> int:
    """Runs ``command`` (see `resolve_command`) as ``processes`` local processes.

    The processes find each other through ``REPLICATOR_COORDINATOR``,
    ``REPLICATOR_NUM_PROCESSES`` and ``REPLICATOR_PROCESS_ID``, which
    ``rp.initialize()`` (and ``python -m replicator train``) read. Each process
    gets ``devices_per_process`` fake CPU devices. Output lines are prefixed
    with ``[i]``. SIGTERM and SIGINT are forwarded to every process. If one
    process fails, the others are stopped (SIGTERM, then SIGKILL after
    ``grace_s``) and the exit code is non-zero.

    With ``elastic`` (DiLoCo's elastic islands, `replicator.diloco.ElasticIslands`)
    a process other than 0 that dies is reported and the others go on; process
    0 failing still stops them all (it serves JAX's coordination service).

    With ``restarts``, a failed run is started again, all processes, up to that
    many times: ``train`` resumes from its last checkpoint (a custom loop from
    its own), e.g. after a sync timeout of elastic islands or the loss of
    process 0.

    Returns:
      0 if every process succeeded (elastic: process 0 and every process that
      did not die of a signal), else the first failure's exit code (or 1).
    """
    code = _launch_once(command, processes, devices_per_process, grace_s, python, elastic)
    for attempt in range(1, restarts + 1):
        if code == 0:
            break
        print(
            f"launch: the run failed (exit code {code}); restart {attempt} of {restarts}, "
            "from the last checkpoint.",
            file=sys.stderr,
            flush=True,
        )
        code = _launch_once(command, processes, devices_per_process, grace_s, python, elastic)
    return code


def _launch_once(command, processes, devices_per_process, grace_s, python, elastic) -> int:
    argv = resolve_command(command, python)
    port = free_port_pair()
    env = dict(os.environ)
    env.update(
        {
            ENV_COORDINATOR: f"127.0.0.1:{port}",
            ENV_NUM_PROCESSES: str(processes),
            "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": f"{env.get('XLA_FLAGS', '')} "
            f"--xla_force_host_platform_device_count={devices_per_process}".strip(),
            "PYTHONUNBUFFERED": "1",
        }
    )
    if shutil.which(argv[0]) is None:
        raise FileNotFoundError(f"cannot run {argv[0]!r}: no such program on PATH.")
    procs, readers = [], []
    for i in range(processes):
        proc = subprocess.Popen(
            argv,
            env={**env, ENV_PROCESS_ID: str(i)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        reader = threading.Thread(target=_prefix_lines, args=(proc.stdout, f"[{i}] "), daemon=True)
        reader.start()
        procs.append(proc)
        readers.append(reader)

    def forward(signum, frame):
        del frame
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        code = _supervise(procs, grace_s, elastic)
        for reader in readers:  # the processes' last lines, still in the pipes
            reader.join(timeout=5)
        return code
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _supervise(procs: list[subprocess.Popen], grace_s: float, elastic: bool = False) -> int:
    lost: set[int] = set()
    while True:
        codes = [proc.poll() for proc in procs]
        failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0) and i not in lost]
        if elastic:  # a killed island is survivable; a failing program or process 0 is not
            for i, code in failed:
                if i != 0 and code < 0:
                    print(
                        f"launch: process {i} died (signal {-code}); the others go on "
                        "without it (--elastic).",
                        file=sys.stderr,
                        flush=True,
                    )
                    lost.add(i)
            failed = [(i, c) for i, c in failed if i not in lost]
            codes = [0 if i in lost else c for i, c in enumerate(codes)]
        if failed:
            i, code = failed[0]
            print(
                f"launch: process {i} failed with exit code {code}; stopping the others.",
                file=sys.stderr,
                flush=True,
            )
            _stop(procs, grace_s)
            return code if code > 0 else 1
        if all(c == 0 for c in codes):
            return 0
        time.sleep(0.1)


def _stop(procs: list[subprocess.Popen], grace_s: float) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 0))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _prefix_lines(stream, prefix: str) -> None:
    for line in stream:
        sys.stdout.write(prefix + line)
        sys.stdout.flush()


def tpu_commands(
    command: Sequence[str],
    *,
    tpu: str,
    zone: str,
    project: str | None = None,
    repo_dir: str = "~/replicator",
) -> list[list[str]]:
    """The gcloud commands that copy the repository to every TPU VM worker,
    install it, and run ``command`` (see `resolve_command`; Python is the
    repository's ``.venv/bin/python``) in it on all of them at once.

    JAX finds the workers, their ids and the coordinator on the TPU VMs itself.
    Use a ``gs://`` workdir so that every worker writes checkpoints to the same
    place (Orbax writes to buckets through tensorstore).
    """
    base = ["gcloud", "compute", "tpus", "tpu-vm"]
    where = ["--zone", zone, *(["--project", project] if project else [])]
    remote = f"cd {repo_dir} && {shlex.join(resolve_command(command, '.venv/bin/python'))}"
    setup = f"cd {repo_dir} && python3 -m venv .venv && .venv/bin/pip install -q -e '.[tpu]'"
    return [
        [*base, "scp", "--recurse", "--worker=all", *where, ".", f"{tpu}:{repo_dir}"],
        [*base, "ssh", tpu, "--worker=all", *where, "--command", setup],
        [*base, "ssh", tpu, "--worker=all", *where, "--command", remote],
    ]


def slurm_script(
    command: Sequence[str],
    *,
    nodes: int,
    gpus_per_node: int,
    process_per_gpu: bool = True,
    job_name: str = "replicator",
    time_limit: str = "24:00:00",
    python: str = ".venv/bin/python",
) -> str:
    """An sbatch script running ``command`` (see `resolve_command`) on ``nodes`` nodes.

    One process per GPU by default (one per node with ``process_per_gpu=False``);
    JAX reads the process ids, the count and the coordinator from SLURM's
    variables. ``--signal`` asks SLURM for a SIGTERM two minutes before the time
    limit, which replicator turns into a checkpoint.
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
        f"srun --kill-on-bad-exit=1 {shlex.join(resolve_command(command, python))}",
    ]
    return "\n".join(lines) + "\n"


_COMMAND_HELP = """\
COMMAND after -- is what every process runs:
  train|eval|plot ARGS    python -m replicator train|eval|plot ARGS
  python SCRIPT ARGS      any Python program, e.g. a custom loop that calls
                          rp.initialize() first; `python`/`python3` become this
                          interpreter locally (sys.executable, so the virtualenv
                          is used) and .venv/bin/python on TPU VMs and SLURM
  ANY OTHER COMMAND       run as given

examples:
  python -m replicator launch local --processes 2 --devices-per-process 4 -- \\
      train --config configs/digits_cnn.py --workdir runs/digits_2x4
  python -m replicator launch local --processes 2 --devices-per-process 4 -- \\
      python my_script.py ARGS
  python -m replicator launch slurm --nodes 2 --gpus-per-node 8 --dry-run -- \\
      python my_script.py ARGS
"""


def main(argv: Sequence[str]) -> int:
    """``python -m replicator launch {local,tpu,slurm} [options] -- COMMAND...``."""
    argv = list(argv)
    command = argv[argv.index("--") + 1 :] if "--" in argv else []
    options = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(
        prog="python -m replicator launch",
        usage="%(prog)s {local,tpu,slurm} [options] -- COMMAND [ARGS ...]",
        description="Runs COMMAND as every process of a multi-process run.",
        epilog=_COMMAND_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="where", required=True)

    def add_parser(name: str, help: str) -> argparse.ArgumentParser:
        return sub.add_parser(
            name,
            help=help,
            prog=f"python -m replicator launch {name}",
            usage="%(prog)s [options] -- COMMAND [ARGS ...]",
            epilog=_COMMAND_HELP,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )

    local = add_parser("local", "several processes on this machine (127.0.0.1)")
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
    tpu = add_parser("tpu", "every worker of a Cloud TPU VM pod")
    tpu.add_argument("--tpu", required=True, help="the TPU VM's name")
    tpu.add_argument("--zone", required=True, help="its zone, e.g. us-central2-b")
    tpu.add_argument("--project", help="its Google Cloud project (default: gcloud's)")
    tpu.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    slurm = add_parser("slurm", "an sbatch job")
    slurm.add_argument("--nodes", type=int, required=True, help="nodes of the job")
    slurm.add_argument(
        "--gpus-per-node", type=int, required=True, help="GPUs of each node the job uses"
    )
    slurm.add_argument(
        "--process-per-node",
        action="store_true",
        help="one process per node instead of one per GPU",
    )
    slurm.add_argument(
        "--dry-run", action="store_true", help="print the sbatch script, submit nothing"
    )
    args = parser.parse_args(options)
    if not command:
        parser.error(
            "give the command after --, e.g. -- train --config FILE ... or -- python "
            "my_script.py ARGS"
        )
    if args.where == "local":
        try:
            return launch_local(
                command,
                processes=args.processes,
                devices_per_process=args.devices_per_process,
                elastic=args.elastic,
                restarts=args.restarts,
            )
        except FileNotFoundError as e:
            parser.error(str(e))
    if args.where == "tpu":
        commands = tpu_commands(command, tpu=args.tpu, zone=args.zone, project=args.project)
        for cmd in commands:
            print(shlex.join(cmd), flush=True)
            if not args.dry_run:
                subprocess.run(cmd, check=True)
        return 0
    script = slurm_script(
        command,
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        process_per_gpu=not args.process_per_node,
    )
    if args.dry_run:
        print(script, end="")
        return 0
    with open("replicator.sbatch", "w") as f:
        f.write(script)
    print("wrote replicator.sbatch", flush=True)
    return subprocess.run(["sbatch", "replicator.sbatch"], check=False).returncode
