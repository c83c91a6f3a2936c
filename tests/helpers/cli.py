"""``python -m replicator ...`` as a user runs it: a subprocess on fake CPU devices, from
the repository's root, and what a refused command must leave behind (nothing)."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


SMOKE = ["--config", "configs/digits_cnn.py:smoke"]  # the default example, a few steps


def run_cli(
    *args: str, devices: int = 2, env: dict | None = None, stdout=subprocess.PIPE,
    timeout: int = 600,
) -> subprocess.CompletedProcess:  # fmt: skip
    """The command's exit status, stdout and stderr (text), on ``devices`` CPU devices,
    with ``env`` added to this process's environment (less ``REPLICATOR_DEBUG``)."""
    full = {k: v for k, v in os.environ.items() if k != "REPLICATOR_DEBUG"}
    full["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    full.update(env or {})
    argv = [sys.executable, "-m", "replicator", *args]
    return subprocess.run(
        argv, cwd=ROOT, env=full, stdout=stdout, stderr=subprocess.PIPE, text=True, timeout=timeout
    )


def lines(text: str) -> list[str]:
    """The lines of ``text`` that are not blank."""
    return [line for line in text.splitlines() if line.strip()]


def assert_one_line_error(done: subprocess.CompletedProcess, *expected: str) -> None:
    """Exit status 2 and stderr exactly one line, ``error: ...``, holding each of ``expected``."""
    assert done.returncode == 2, done.stderr[-3000:]
    (line,) = lines(done.stderr)  # nothing else: no traceback, no library noise
    assert line.startswith("error: ")
    for text in expected:
        assert text in line, line


def snapshot(directory: str) -> dict[str, int]:
    """Every file under ``directory`` -> its modification time (empty if none)."""
    return {
        os.path.join(where, name): os.stat(os.path.join(where, name)).st_mtime_ns
        for where, _, names in os.walk(directory) for name in names
    }  # fmt: skip


def assert_refused(done: subprocess.CompletedProcess, words: str) -> None:
    """Exit status 2 and one line, ``error: <words>...``, with no traceback."""
    assert done.returncode == 2, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith(f"error: {words}"), done.stderr[-3000:]
    assert "Traceback" not in done.stderr and done.stderr.count("error:") == 1, done.stderr
