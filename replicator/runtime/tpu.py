"""Cloud TPU pods: the gcloud commands that start a job on every worker, follow it and
stop it.

``launch tpu`` runs a command on every worker of a TPU VM pod (or, with
``--slices N``, of every slice of a queued resource) with these gcloud commands,
each printed before it runs (``--dry-run`` prints them and runs nothing):

1. ``ssh`` to every worker: the probe (`replicator.runtime.worker_env.probe_script`).
   Has it the environment, the Python and the project's dependencies keyed by
   their hash? If not, can it reach what installing needs? A worker that cannot
   is refused here, in one line naming what is missing.
2. ``scp`` of one tarball, the *bundle* (`replicator.runtime.bundle`: the project's
   files and the experiment's, named by their content hash), to every worker;
   with ``--wheels``, and a worker without the environment, also the wheels.
3. ``ssh`` to every worker: unpack the bundle into ``~/.replicator/bundles/HASH``
   and install the environment into ``~/.replicator/envs/NAME`` where it is
   missing (`replicator.runtime.worker_env.setup_script`): a code edit installs
   nothing.
4. ``ssh`` to every worker: keep the newest bundles and the environments they use
   (`replicator.runtime.worker_env.prune_script`), free the TPU (kill the
   processes holding it, remove libtpu's lock file) and start the command
   detached under the worker supervisor, `replicator.runtime.worker`, which
   outlives the ssh session, logs to ``~/.replicator/job/worker.log`` and
   mirrors that log to ``WORKDIR/launch/worker-N.log``.

Before any of it, ``launch tpu`` refuses a local workdir on a pod of several
workers (`replicator.runtime.shared_paths`) and compiles a ``train`` command's
config for the pod here, refusing a run that does not fit
(`replicator.runtime.preflight`).

`logs_command` follows a worker's log; `stop_command` stops the job on every
worker (SIGTERM, which the trainer turns into a checkpoint; SIGKILL after a
grace period) and frees the TPU.
"""

from __future__ import annotations

import dataclasses
import shlex
import shutil
import subprocess
from collections.abc import Callable, Sequence

from replicator.errors import LaunchError as LaunchError
from replicator.runtime import worker_env
from replicator.runtime.bundle import (
    Bundle,
    describe_bundle,
    local_bundle_path,
    plan_bundle,
    project_root,
    write_bundle,
)
from replicator.runtime.worker_env import DEFAULT_PYTHON as DEFAULT_PYTHON
from replicator.runtime.worker_env import KEEP_BUNDLES, Environment

# On every worker ($HOME is the worker's): the job's pid and log.
JOB = "$HOME/.replicator/job"
# What holds a TPU (v4 and older: /dev/accel*; v5 and v6: /dev/vfio/*) and libtpu's lock.
TPU_DEVICES = "/dev/accel* /dev/vfio/*"
TPU_LOCKFILE = "/tmp/libtpu_lockfile"


@dataclasses.dataclass(frozen=True)
class Pod:
    """The TPU VMs a job runs on, as gcloud names them.

    Attributes:
      name: the TPU VM (one slice) or the queued resource (``slices > 1``).
      zone: their zone, e.g. ``us-central2-b``.
      project: their Google Cloud project (None: gcloud's default).
      slices: the slices of the queued resource; 1 is a plain TPU VM.
      internal_ip: connect through the workers' internal IP addresses.
    """

    name: str
    zone: str
    project: str | None = None
    slices: int = 1
    internal_ip: bool = False

    def gcloud(self, verb: str, *args: str, worker: str = "all", node: str = "all") -> list[str]:
        """``gcloud compute tpus ... VERB ARGS`` addressed to ``worker`` (of ``node``).

        >>> shlex.join(Pod("pod", "us-east5-a").gcloud("ssh", "pod"))
        'gcloud compute tpus tpu-vm ssh pod --worker=all --zone=us-east5-a'
        >>> shlex.join(Pod("qr", "us-east5-a", slices=2).gcloud("ssh", "qr"))
        'gcloud compute tpus queued-resources ssh qr --worker=all --node=all --zone=us-east5-a'
        """
        where = [f"--worker={worker}"]
        if self.slices > 1:
            base = ["gcloud", "compute", "tpus", "queued-resources", verb]
            where.append(f"--node={node}")
        else:
            base = ["gcloud", "compute", "tpus", "tpu-vm", verb]
        where.append(f"--zone={self.zone}")
        if self.project:
            where.append(f"--project={self.project}")
        if self.internal_ip:
            where.append("--internal-ip")
        return [*base, *args, *where]


# ---------------------------------------------------------------- the command


def job_command(command: Sequence[str], slices: int) -> list[str]:
    """``command`` as every worker runs it: across ``slices > 1`` TPU slices a ``train``
    command gets ``--config.dcn_mesh={"data": slices}`` (the data axis across the
    slices, the config's ``mesh`` within each) unless it sets ``--config.dcn_mesh``.

    >>> job_command(["train", "--config", "c.py"], slices=2)
    ['train', '--config', 'c.py', '--config.dcn_mesh={"data": 2}']
    """
    command = list(command)
    given = any(w.split("=", 1)[0] == "--config.dcn_mesh" for w in command)
    if slices > 1 and command[:1] == ["train"] and not given:
        command.append(f'--config.dcn_mesh={{"data": {slices}}}')
    return command


def workdir_of(command: Sequence[str]) -> str | None:
    """The value of ``--workdir`` in ``command``, if any.

    >>> workdir_of(["train", "--workdir=gs://b/run"]), workdir_of(["python", "x.py"])
    ('gs://b/run', None)
    """
    words = list(command)
    for i, word in enumerate(words):
        if word == "--workdir" and i + 1 < len(words):
            return words[i + 1]
        if word.startswith("--workdir="):
            return word.split("=", 1)[1]
    return None


def default_log_dir(command: Sequence[str]) -> str | None:
    """Where the workers' logs are mirrored by default: ``WORKDIR/launch``."""
    workdir = workdir_of(command)
    return None if workdir is None else f"{workdir.rstrip('/')}/launch"


# ---------------------------------------------------------------- the scripts the workers run


def free_tpu_script() -> str:
    """Bash that frees the TPU for the next job: kills the processes holding its
    devices and removes libtpu's lock file (what MaxText's runner does)."""
    return "\n".join(
        [
            f"held=$(ls -d {TPU_DEVICES} 2>/dev/null || true)",
            'if [ -n "$held" ]; then',
            "  sudo -n lsof -t $held 2>/dev/null | sort -u | xargs -r sudo -n kill -9 || true",
            "fi",
            f"sudo -n rm -f {TPU_LOCKFILE} 2>/dev/null || rm -f {TPU_LOCKFILE} || true",
        ]
    )


def start_script(
    bundle: Bundle,
    env: Environment,
    command: Sequence[str],
    *,
    restarts: int = 0,
    log_dir: str | None = None,
    keep_bundles: int = KEEP_BUNDLES,
) -> str:
    """Bash that starts ``command`` detached on a worker, under the worker supervisor.

    It refuses while a job runs there (its process group, from ``JOB/pid``, is
    alive), keeps the ``keep_bundles`` newest bundles and the environments they
    use (`replicator.runtime.worker_env.prune_script`), frees the TPU
    (`free_tpu_script`) and starts ``python -m replicator.runtime.worker`` with
    ``setsid nohup ... &`` in the bundle's image of the working directory, with
    ``env``'s interpreter and the bundle's project on ``PYTHONPATH``, then waits
    until the supervisor has written its pid file.
    """
    worker = [
        '"$env/bin/python"',
        "-m",
        "replicator.runtime.worker",
        "--pid-file",
        '"$job/pid"',
        "--log",
        '"$job/worker.log"',
        *(["--log-dir", worker_env.quote(log_dir)] if log_dir else []),
        *(["--restarts", str(restarts)] if restarts else []),
        "--",
        *(worker_env.quote(w) for w in command),
    ]
    return "\n".join(
        [
            "set -eu",
            f'bundle="{bundle.remote_dir}"',
            f'env="{env.remote_dir}"',
            f'job="{JOB}"',
            'mkdir -p "$job"',
            'if [ -f "$job/pid" ] && kill -0 -- "-$(cat "$job/pid")" 2>/dev/null; then',
            '  echo "error: $(hostname) runs a job (process group $(cat "$job/pid")); '
            'stop it first: launch tpu ... --stop" >&2',
            "  exit 1",
            "fi",
            'rm -f "$job/pid"',
            worker_env.prune_script(keep_bundles),
            free_tpu_script(),
            'export PYTHONPATH="$bundle/project"',  # the environment holds no project
            f'cd "$bundle/{bundle.run_dir}"',
            f'setsid nohup {" ".join(worker)} > "$job/supervisor.out" 2>&1 < /dev/null &',
            'while [ ! -f "$job/pid" ] && kill -0 $! 2>/dev/null; do sleep 0.2; done',
            'if [ -f "$job/pid" ]; then',
            '  echo "$(hostname): started, process group $(cat "$job/pid"), log $job/worker.log"',
            "else",
            '  echo "$(hostname): the job ended at once:" >&2',
            '  tail -n 20 "$job/supervisor.out" "$job/worker.log" >&2 || true',
            "fi",
        ]
    )


def stop_script(grace_s: int = 300) -> str:
    """Bash that stops a worker's job, then frees the TPU (`free_tpu_script`).

    SIGTERM to the job's process group (the trainer saves a checkpoint and
    exits; the supervisor restarts nothing), SIGKILL if it still runs after
    ``grace_s`` seconds.
    """
    return "\n".join(
        [
            f'job="{JOB}"',
            'group=$(cat "$job/pid" 2>/dev/null || true)',
            'if [ -n "$group" ] && kill -TERM -- "-$group" 2>/dev/null; then',
            f'  echo "$(hostname): SIGTERM to process group $group; waiting up to {grace_s} s"',
            "  waited=0",
            f'  while kill -0 -- "-$group" 2>/dev/null && [ $waited -lt {grace_s} ]; do',
            "    sleep 1; waited=$((waited + 1))",
            "  done",
            '  if kill -KILL -- "-$group" 2>/dev/null; then',
            f'    echo "$(hostname): still running after {grace_s} s: SIGKILL"',
            "  fi",
            '  echo "$(hostname): stopped"',
            "else",
            '  echo "$(hostname): no job running"',
            "fi",
            'rm -f "$job/pid"',
            free_tpu_script(),
        ]
    )


# ---------------------------------------------------------------- the gcloud commands


def probe_command(pod: Pod, env: Environment) -> list[str]:
    """The gcloud command that asks every worker of ``pod`` about ``env``
    (`replicator.runtime.worker_env.probe_script`)."""
    return [*pod.gcloud("ssh", pod.name), f"--command={worker_env.probe_script(env)}"]


def start_commands(
    pod: Pod,
    bundle: Bundle,
    env: Environment,
    command: Sequence[str],
    *,
    ship_wheels: bool = False,
    restarts: int = 0,
    log_dir: str | None = None,
    keep_bundles: int = KEEP_BUNDLES,
) -> list[list[str]]:
    """The gcloud commands that copy ``bundle`` (and with ``ship_wheels`` the wheels of
    ``env``) to every worker of ``pod``, set them up
    (`replicator.runtime.worker_env.setup_script`) and start ``command`` there
    (`start_script`)."""
    start = start_script(
        bundle, env, command, restarts=restarts, log_dir=log_dir, keep_bundles=keep_bundles
    )
    copies = [pod.gcloud("scp", local_bundle_path(bundle), f"{pod.name}:{bundle.name}")]
    if ship_wheels:
        wheels = worker_env.local_wheelhouse_path(env)
        copies.append(pod.gcloud("scp", wheels, f"{pod.name}:{env.wheelhouse}"))
    return [
        *copies,
        [*pod.gcloud("ssh", pod.name), f"--command={worker_env.setup_script(bundle, env)}"],
        [*pod.gcloud("ssh", pod.name), f"--command={start}"],
    ]


def logs_command(pod: Pod, worker: str = "0", slice_id: str = "0", lines: int = 100) -> list[str]:
    """The gcloud command that follows the log of one worker (of one slice) of ``pod``."""
    follow = f'--command=tail -n {lines} -F "{JOB}/worker.log"'
    return [*pod.gcloud("ssh", pod.name, worker=worker, node=slice_id), follow]


def stop_command(pod: Pod, grace_s: int = 300) -> list[str]:
    """The gcloud command that stops the job on every worker of ``pod`` (`stop_script`)."""
    return [*pod.gcloud("ssh", pod.name), f"--command={stop_script(grace_s)}"]


def check_gcloud() -> None:
    """Raises `LaunchError` unless gcloud is on PATH and has an active account."""
    if shutil.which("gcloud") is None:
        raise LaunchError(
            "launch tpu needs the gcloud CLI, and there is no gcloud on PATH: install the "
            "Google Cloud CLI (https://cloud.google.com/sdk/docs/install), then run "
            "`gcloud auth login`."
        )
    accounts = ["gcloud", "auth", "list", "--filter=status:ACTIVE", "--format=value(account)"]
    try:
        done = subprocess.run(accounts, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        raise LaunchError(f"`{shlex.join(accounts)}` failed: {e}") from e
    if done.returncode != 0 or not done.stdout.strip():
        raise LaunchError(
            "gcloud has no active account: run `gcloud auth login` (or `gcloud auth "
            "activate-service-account`) first."
        )


def run_commands(commands: Sequence[Sequence[str]]) -> None:
    """Runs ``commands`` one after the other, each printed first.

    Raises:
      LaunchError: a command failed; the ones after it are not run.
    """
    for command in commands:
        print(shlex.join(command), flush=True)
        code = subprocess.run(list(command), check=False).returncode
        if code != 0:
            raise LaunchError(f"{shlex.join(command[:6])} ... failed (exit status {code}).")


def ask_workers(pod: Pod, env: Environment) -> str | None:
    """Runs the probe (`probe_command`) and reads the workers' answers.

    Returns:
      The Python version the workers without ``env`` install it for; None when
      every worker has it.

    Raises:
      LaunchError: the probe failed, or a worker cannot install ``env``
        (`replicator.runtime.worker_env.check_answers`: one line, what is missing).
    """
    probe = probe_command(pod, env)
    print(shlex.join(probe), flush=True)
    done = subprocess.run(probe, stdout=subprocess.PIPE, text=True, check=False)
    print(done.stdout, end="", flush=True)
    if done.returncode != 0:
        raise LaunchError(f"{shlex.join(probe[:6])} ... failed (exit status {done.returncode}).")
    answers = worker_env.read_answers(done.stdout)
    version = worker_env.check_answers(answers, env, pod.name)
    missing = sum(not a.has_env for a in answers)
    print(
        f"# {len(answers) - missing} of {len(answers)} workers have environment {env.name}"
        + (f"; {missing} install it" if missing else ""),
        flush=True,
    )
    return version


def launch(
    command: Sequence[str],
    pod: Pod,
    *,
    python: str = DEFAULT_PYTHON,
    pins: tuple[str, ...] | None = None,
    wheels: bool = False,
    keep_bundles: int = KEEP_BUNDLES,
    restarts: int = 0,
    log_dir: str | None = None,
    dry_run: bool = False,
    before_shipping: Callable[[list[str]], None] | None = None,
) -> None:
    """Starts ``command`` on every worker of ``pod`` (see the module's docstring).

    Args:
      command: the words after ``--``, run in the image of the working directory.
      pod: the TPU VM or queued resource.
      python: the workers' Python: a version uv brings, or the absolute path of an
        interpreter installed on every worker.
      pins: the jax, jaxlib and libtpu the workers install (the pre-flight's compiler:
        `replicator.runtime.preflight.pins`); None pins this machine's.
      wheels: install the environment from wheels downloaded here (for the TPU
        VMs' platform) and shipped, not from PyPI.
      keep_bundles: the bundles each worker keeps (with their environments).
      restarts: the worker supervisor runs a failed command again up to this
        many times (``train`` resumes from its last checkpoint).
      log_dir: where each worker's log is mirrored (default: ``WORKDIR/launch``
        when the command has ``--workdir``); local on the worker or ``gs://``.
      dry_run: print the commands, run nothing, write nothing (no gcloud needed).
      before_shipping: called with the job's command once gcloud is there, before
        anything is written or copied (`replicator.runtime.preflight`); it raises
        `LaunchError` to stop the launch.

    Raises:
      LaunchError: no gcloud, no active account, a file outside the working
        directory, a worker that cannot install the environment, a gcloud command
        that failed, or ``before_shipping``'s refusal.
    """
    if not dry_run:
        check_gcloud()
    command = job_command(command, pod.slices)
    env = worker_env.plan_environment(project_root(), python, wheels, pins)
    if before_shipping is not None:
        before_shipping(command)
    bundle = plan_bundle(command)
    options = dict(restarts=restarts, log_dir=log_dir or default_log_dir(command))
    options.update(keep_bundles=keep_bundles)
    print(f"# {describe_bundle(bundle)}\n# {worker_env.describe_environment(env)}", flush=True)
    if dry_run:
        _print_dry_run(pod, bundle, env, command, options)
        return
    version = ask_workers(pod, env)
    ship_wheels = wheels and version is not None
    paths = [write_bundle(bundle, local_bundle_path(bundle))]
    try:
        if ship_wheels:
            wheelhouse = worker_env.download_wheels(env, version)
            paths.append(worker_env.write_wheelhouse(env, wheelhouse))
        run_commands(start_commands(pod, bundle, env, command, ship_wheels=ship_wheels, **options))
    finally:
        for path in paths:
            path.unlink(missing_ok=True)


def _print_dry_run(pod: Pod, bundle: Bundle, env: Environment, command: list[str], options):
    commands = [probe_command(pod, env)]
    commands += start_commands(pod, bundle, env, command, ship_wheels=env.wheels, **options)
    lines = [shlex.join(c) for c in commands]
    if env.wheels:  # where the probe finds a worker without the environment
        version = "VERSION" if env.preinstalled else env.python
        download = worker_env.download_command(env, version, worker_env.wheel_cache(env, version))
        lines.insert(1, f"# then, if a worker lacks {env.name}: {shlex.join(download)}")
    print("\n".join(lines), flush=True)
