"""The worker supervisor: one job on one machine, detached from ssh, logged and restarted.

``launch tpu`` starts it on every worker of a pod, in the bundle's image of the
working directory::

    setsid nohup python -m replicator.runtime.worker --pid-file ~/.replicator/job/pid \\
        --log ~/.replicator/job/worker.log --log-dir gs://bucket/run/launch \\
        --restarts 2 -- train --config my_config.py --workdir gs://bucket/run &

It writes its process group to the pid file (``launch tpu --stop`` signals that
group; the file goes when the job ends), runs the command (see
`replicator.runtime.launch.resolve_command`: ``python`` is this interpreter) and
appends the command's output to the log, which it mirrors whole to
``LOG_DIR/NAME.log`` (local or ``gs://``, through `replicator.storage`) every
`MIRROR_INTERVAL_S` seconds and when the command ends. NAME is
``worker-N`` (``slice-S-worker-N`` across slices) from the TPU VM's metadata.

A failed command is run again up to ``--restarts`` times: ``train`` resumes from
its last checkpoint. A SIGTERM to the job's process group reaches the command
(the trainer saves a checkpoint and exits) and ends the job without a restart.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Sequence
from typing import IO

from replicator import storage
from replicator.runtime.launch import resolve_command

MIRROR_INTERVAL_S = 30.0  # a log is uploaded whole: not too often
_METADATA = "http://metadata.google.internal/computeMetadata/v1/instance/attributes/"


def tpu_metadata(key: str, timeout_s: float = 5.0) -> str | None:
    """The TPU VM's metadata attribute ``key``; None off Google Cloud or without it."""
    request = urllib.request.Request(_METADATA + key, headers={"Metadata-Flavor": "Google"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as answer:
            return answer.read().decode().strip()
    except (OSError, ValueError):
        return None


def worker_name() -> str:
    """``worker-N`` on TPU VM worker N (``slice-S-worker-N`` across several slices);
    elsewhere the host name."""
    worker = tpu_metadata("agent-worker-number")
    if worker is None:
        return socket.gethostname()
    env = dict(os.environ)
    if "MEGASCALE_NUM_SLICES" not in env:  # the platform's values, as JAX reads them
        for line in (tpu_metadata("tpu-env") or "").splitlines():
            key, _, value = line.partition(":")
            env.setdefault(key.strip(), value.strip().strip("'\""))
    if int(env.get("MEGASCALE_NUM_SLICES") or 1) > 1:
        return f"slice-{env.get('MEGASCALE_SLICE_ID', 0)}-worker-{worker}"
    return f"worker-{worker}"


class JobLog:
    """The job's output: appended to a local file and mirrored to ``target``.

    Args:
      local_path: the log on this machine; a previous one is kept as ``.prev``.
      target: the file it is mirrored to, local or ``gs://`` (None: none). A
        target that cannot be reached is reported in the log, and the job runs on.
    """

    def __init__(self, local_path: str, target: str | None = None):
        os.makedirs(os.path.dirname(os.path.abspath(local_path)), exist_ok=True)
        if os.path.exists(local_path):
            os.replace(local_path, local_path + ".prev")
        self._files: list[IO[str]] = [open(local_path, "a", encoding="utf-8")]
        self._mirror: storage.Mirror | None = None
        if target:
            try:
                self._mirror = storage.Mirror(target, interval_s=MIRROR_INTERVAL_S)
                os.makedirs(os.path.dirname(self._mirror.local_path), exist_ok=True)
                self._files.append(open(self._mirror.local_path, "a", encoding="utf-8"))
            except Exception as e:  # noqa: BLE001  (the job matters more than its mirror)
                self._mirror = None
                self.note(f"cannot mirror this log to {target}: {e}")

    def write(self, text: str) -> None:
        """Appends ``text`` to the log (flushed: a reader sees it at once)."""
        for f in self._files:
            f.write(text)
            f.flush()

    def note(self, message: str) -> None:
        """A line of the supervisor's own, with the time."""
        self.write(f"worker [{time.strftime('%Y-%m-%d %H:%M:%S')}]: {message}\n")

    def sync(self) -> None:
        """Uploads the log to its mirror now."""
        if self._mirror is None:
            return
        try:
            self._mirror.sync()
        except Exception as e:  # noqa: BLE001
            self._files[0].write(f"worker: cannot mirror this log: {e}\n")

    def close(self) -> None:
        """Uploads what is left and closes the files."""
        for f in self._files:
            f.close()
        if self._mirror is not None:
            try:
                self._mirror.close()
            except Exception as e:  # noqa: BLE001
                print(f"worker: cannot mirror the log: {e}", file=sys.stderr)


def supervise(
    command: Sequence[str],
    *,
    pid_file: str,
    log: str,
    log_dir: str | None = None,
    name: str | None = None,
    restarts: int = 0,
    restart_delay_s: float = 10.0,
) -> int:
    """Runs ``command`` until it succeeds, is stopped, or has failed ``restarts + 1`` times.

    Args:
      command: the command (see `replicator.runtime.launch.resolve_command`).
      pid_file: the file this process group is written to, removed at the end.
      log: the local log file.
      log_dir: the directory the log is mirrored to as ``NAME.log`` (local or
        ``gs://``; None: no mirror).
      name: the mirror's name (default: `worker_name`).
      restarts: how many times a failed command is run again.
      restart_delay_s: the pause before a restart (the TPU and ports come free).

    Returns:
      The exit status of the command's last run (128 + N for signal N).
    """
    if os.getpgid(0) != os.getpid():
        os.setsid()  # a group of its own: stopping the job stops nothing else
    _write_atomically(pid_file, f"{os.getpgid(0)}\n")
    job_log = JobLog(log, f"{log_dir.rstrip('/')}/{name or worker_name()}.log" if log_dir else None)
    # A SIGTERM to the job's process group (launch tpu --stop) reaches the command and
    # this process at once: this one then restarts nothing, and passes nothing on (a
    # second SIGTERM could catch the command while it saves its checkpoint).
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda signum, frame: stopping.set())
    argv = resolve_command(command, sys.executable)
    try:
        code = _run(argv, job_log, stopping)
        for attempt in range(1, restarts + 1):
            if code == 0 or stopping.is_set():
                break
            job_log.note(f"the command failed (status {code}); restart {attempt} of {restarts}")
            if stopping.wait(restart_delay_s):
                break
            code = _run(argv, job_log, stopping)
        return code
    finally:
        job_log.close()
        _remove_pid_file(pid_file)


def _run(argv: list[str], job_log: JobLog, stopping: threading.Event) -> int:
    if stopping.is_set():
        return 128 + signal.SIGTERM
    job_log.note(f"running {shlex.join(argv)} in {os.getcwd()}")
    output = dict(stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        proc = subprocess.Popen(argv, env={**os.environ, "PYTHONUNBUFFERED": "1"}, **output)
    except OSError as e:
        job_log.note(f"cannot run {argv[0]}: {e}")
        return 127
    with proc:
        for line in iter(proc.stdout.readline, b""):
            job_log.write(line.decode(errors="replace"))
    code = proc.wait()
    code = 128 - code if code < 0 else code
    job_log.note(f"the command exited with status {code}")
    job_log.sync()
    return code


def _write_atomically(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    partial = f"{path}.{os.getpid()}.part"
    with open(partial, "w") as f:
        f.write(text)
    os.replace(partial, path)


def _remove_pid_file(path: str) -> None:
    try:
        with open(path) as f:
            ours = f.read().strip() == str(os.getpgid(0))
        if ours:
            os.remove(path)
    except OSError:
        pass


def main(argv: Sequence[str]) -> int:
    """``python -m replicator.runtime.worker [options] -- COMMAND...``."""
    argv = list(argv)
    command = argv[argv.index("--") + 1 :] if "--" in argv else []
    options = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(
        prog="python -m replicator.runtime.worker",
        usage="%(prog)s --pid-file FILE --log FILE [options] -- COMMAND [ARGS ...]",
        description="Runs COMMAND as a job: its output to a log mirrored to LOG_DIR, "
        "its process group in a pid file, restarted on failure.",
    )
    parser.add_argument("--pid-file", required=True, help="where the process group goes")
    parser.add_argument("--log", required=True, help="the log file on this machine")
    parser.add_argument("--log-dir", help="mirror the log to LOG_DIR/NAME.log (local or gs://)")
    parser.add_argument("--name", help="the mirror's name (default: worker-N from the TPU VM)")
    parser.add_argument("--restarts", type=int, default=0, help="run a failed command again")
    parser.add_argument(
        "--restart-delay", type=float, default=10.0, help="seconds before a restart"
    )
    args = parser.parse_args(options)
    if not command:
        parser.error("give the command after --")
    return supervise(
        command,
        pid_file=args.pid_file,
        log=args.log,
        log_dir=args.log_dir,
        name=args.name,
        restarts=args.restarts,
        restart_delay_s=args.restart_delay,
    )


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
