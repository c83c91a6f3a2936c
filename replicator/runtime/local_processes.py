"""`launch local`'s processes: started on this machine, watched, their output relayed.

`replicator.runtime.launch` parses the command line and says what runs;
`run_processes` starts one command as several processes that find each other on
127.0.0.1 (``REPLICATOR_COORDINATOR``, ``REPLICATOR_NUM_PROCESSES``,
``REPLICATOR_PROCESS_ID``, read by ``rp.initialize()``), each with its own fake
CPU devices, prefixes their output lines with ``[i]``, forwards SIGTERM and SIGINT
to them, and stops them all when one fails.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence

from replicator.runtime.processes import ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID


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


def run_processes(
    argv: Sequence[str],
    processes: int,
    devices_per_process: int,
    *,
    grace_s: float = 30.0,
    elastic: bool = False,
    env_of: Callable[[int], Mapping[str, str]] | None = None,
) -> int:
    """Runs ``argv`` as ``processes`` processes of one run, once.

    Args:
      argv: the command every process runs, as given to `subprocess.Popen`.
      processes: how many (1 or more).
      devices_per_process: the fake CPU devices of each.
      grace_s: how long processes stopped after a failure have to exit before SIGKILL.
      elastic: a process other than 0 killed by a signal does not stop the others.
      env_of: process ``i``'s own environment variables.

    Returns:
      0 if every process succeeded, else the first failure's exit code (or 1).

    Raises:
      FileNotFoundError: ``argv[0]`` is no program on PATH.
    """
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
            list(argv),
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
