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
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence

from replicator.runtime import preflight, rehearse, shared_paths, slurm, tpu
from replicator.runtime.processes import ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID

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
    """
    once = functools.partial(_launch_once, env_of=env_of)
    code = once(command, processes, devices_per_process, grace_s, python, elastic)
    for attempt in range(1, restarts + 1):
        if code == 0:
            break
        print(
            f"launch: the run failed (exit code {code}); restart {attempt} of {restarts}, "
            "from the last checkpoint.",
            file=sys.stderr,
            flush=True,
        )
        code = once(command, processes, devices_per_process, grace_s, python, elastic)
    return code


def _launch_once(
    command, processes, devices_per_process, grace_s, python, elastic, env_of=None
) -> int:
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
            env={**env, **(env_of(i) if env_of else {}), ENV_PROCESS_ID: str(i)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        reader = threading.Thread(
            target=_prefix_lines, args=(proc.stdout, f"[{i}] ", _killed_before(procs, i)),
            daemon=True,
        )  # fmt: skip
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
        if failed:  # a process killed from outside is the cause; its peers' errors follow
            i, code = min(failed, key=lambda f: (f[1] >= 0, f[0]))
            print(_failure_line(i, code), file=sys.stderr, flush=True)
            _stop(procs, grace_s)
            return code if code > 0 else 1
        if all(c == 0 for c in codes):
            return 0
        time.sleep(0.1)


def _failure_line(i: int, code: int) -> str:
    if code >= 0:
        return f"launch: process {i} failed with exit code {code}; stopping the others."
    name = signal.Signals(-code).name if -code in signal.valid_signals() else f"signal {-code}"
    return (
        f"launch: process {i} was killed ({name}), not a failure of the run: rerun the same "
        "command to resume from its last checkpoint (--restarts N does it by itself)."
    )


def _killed_before(procs: list[subprocess.Popen], mine: int) -> Callable[[], bool]:
    """Whether a process other than ``mine`` was killed by a signal not of `_stop`'s."""

    def killed() -> bool:
        return any(
            j != mine and (p.poll() or 0) < 0 and not getattr(p, "stopped", False)
            for j, p in enumerate(procs)
        )

    return killed


def _stop(procs: list[subprocess.Popen], grace_s: float) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.stopped = True  # its signal is ours: `_killed_before`
            proc.terminate()
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 0))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# What the processes' C++ libraries print on every multi-process start, which says
# nothing a user acts on: gloo's peer count per rank (written by several threads at
# once, so its pieces interleave within a line), and the coordination service's
# notice that --elastic turned on JAX's recoverable tasks (which the user asked for).
_GLOO = re.compile(
    r"\[Gloo\] Rank(?: \d+)?|\s*is connected to \d+ peer ranks\. "
    r"Expected number of connected peer ranks is : \d+"
)
_NOTICE = re.compile(
    r"^[IW]\d{4} [\d:.]+ +\d+ coordination_service\.cc:\d+\] .*recoverable task feature"
)
_HOLD_S = 5.0  # how long a traceback is held back while its process still prints


def _prefix_lines(stream, prefix: str, other_killed: Callable[[], bool] = lambda: False) -> None:
    """Relays a process's output, each line prefixed, without the start-up noise above.

    A traceback is held back until the process's output ends (or goes on for `_HOLD_S`
    past it): the error of a survivor whose peer was killed from outside (gloo's lost
    connection) goes to a file the console names (``train`` logs it too), the console
    having said that the run resumes; any other traceback is shown as it was."""
    rank_cut = False  # a "[Gloo] Rank" whose number went to the next line
    held, since = [], 0.0
    for line in stream:
        if held or line.startswith("Traceback (most recent call last)"):
            since = since if held else time.monotonic()
            held.append(line)
            if time.monotonic() - since > _HOLD_S:
                held = _write(prefix, held)
            continue
        if _NOTICE.search(line):
            continue
        if rank_cut and line.strip().isdigit():
            rank_cut = False
            continue
        rank_cut = bool(re.search(r"\[Gloo\] Rank\s*$", line))
        if "[Gloo]" in line or "peer ranks" in line:
            line = _GLOO.sub("", line)
            if not line.strip():
                continue
        _write(prefix, [line])
    if held and other_killed():
        fd, path = tempfile.mkstemp(
            prefix=f"replicator-launch-{prefix.strip('[] ')}-", suffix=".txt"
        )
        with os.fdopen(fd, "w") as f:
            f.writelines(held)
        _write(prefix, [f"(its error once another process was killed: {path})\n"])
    elif held:
        _write(prefix, held)


def _write(prefix: str, lines: list[str]) -> list[str]:
    sys.stdout.write("".join(prefix + line for line in lines))
    sys.stdout.flush()
    return []


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
     TPU) and refuses a run that does not fit a chip's HBM, in one line; the
     report stays in ~/.cache/replicator/preflight/NAME. The type is asked of
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


def main(argv: Sequence[str]) -> int:
    """``python -m replicator launch {local,tpu,slurm} [options] -- COMMAND...``.

    Returns:
      The exit status: the run's for ``local``; 2 after a one-line ``error: ...``
      for a launch that cannot go ahead (no gcloud, no gcloud account, no sbatch).
    """
    argv = list(argv)
    command = argv[argv.index("--") + 1 :] if "--" in argv else []
    options = argv[: argv.index("--")] if "--" in argv else argv
    parser = _parser()
    args = parser.parse_args(options)
    follow_or_stop = args.where == "tpu" and (args.logs or args.stop)
    if follow_or_stop and command:
        parser.error("--logs and --stop take no command")
    if not command and not follow_or_stop:
        parser.error(
            "give the command after --, e.g. -- train --config FILE ... or -- python "
            "my_script.py ARGS"
        )
    if args.where == "local":
        if args.processes < 1 or args.devices_per_process < 1 or args.restarts < 0:
            parser.error(
                f"--processes ({args.processes}) and --devices-per-process "
                f"({args.devices_per_process}) must be 1 or more, --restarts ({args.restarts}) "
                "0 or more"
            )
        if not args.gcs and (args.gcs_dir or args.allow_local_workdir):
            parser.error(f"--gcs-dir and {shared_paths.ALLOW_FLAG} go with --gcs (a rehearsal)")
        try:
            return _launch_local(args, command)
        except FileNotFoundError as e:
            parser.error(str(e))
        except tpu.LaunchError as e:
            return _error(str(e))
    if args.where == "slurm":
        return _launch_slurm(args, command)
    if args.slices < 1:
        parser.error(f"--slices must be 1 or more, not {args.slices}")
    try:
        return _launch_tpu(args, command)
    except tpu.LaunchError as e:
        return _error(str(e))
    except KeyboardInterrupt:  # Ctrl-C ends following a log, or the launch: not the job
        return 130


def _launch_local(args: argparse.Namespace, command: list[str]) -> int:
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
        tpu.launch(
            command,
            pod,
            python=args.python,
            wheels=args.wheels,
            keep_bundles=args.keep_bundles,
            restarts=args.restarts,
            log_dir=args.log_dir,
            dry_run=args.dry_run,
            before_shipping=None if args.no_preflight else functools.partial(
                preflight.check_fit, pod=pod, accelerator=args.accelerator_type,
                dry_run=args.dry_run,
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
    try:
        return slurm.submit(script, dry_run=args.dry_run)
    except tpu.LaunchError as e:
        return _error(str(e))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m replicator launch",
        usage="%(prog)s {local,tpu,slurm} [options] -- COMMAND [ARGS ...]",
        description="Runs COMMAND as every process of a multi-process run.",
        epilog=_COMMAND_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="where", required=True)

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
        help="the workers' Python: a version uv brings (default: this one's, %(default)s), or "
        "the path of an interpreter installed on every worker",
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
