"""The pods' JAX on this machine: the compile that checks a pod's program runs the
compiler the pod will run.

JAX 0.11 and newer need Python 3.12, so a machine on Python 3.11 has JAX 0.10.2 and
libtpu 0.0.42.1, whose TPU programs need 8-35% more HBM per chip than the current
libtpu's (docs/benchmarks.md, "TPU programs"). ``launch tpu``'s workers run Python
3.12 by default (`replicator.runtime.worker_env.DEFAULT_PYTHON`) with the newest JAX
the project allows; its pre-flight compiles here with the same: in a uv virtualenv of
that Python, ``$XDG_CACHE_HOME/replicator/envs/pyX.Y-HASH``, holding what a worker's
holds (the project's dependencies and its ``tpu`` extra, `worker_env.dependency_spec`)
and running this project's code through ``PYTHONPATH``. It is made once (a minute or
two: uv, its CPython where this machine has none, the packages from PyPI) and kept
until the dependencies change. ``python -m replicator compile --python 3.12`` compiles
the same way by hand. Where the Python asked for is this one, nothing is made.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
from collections.abc import Sequence

from replicator.errors import LaunchError
from replicator.runtime.worker_env import (
    COMPILER,
    Environment,
    cache_dir,
    compiler_pins,
    dependency_spec,
    release_pins,
)

ROOT = pathlib.Path(__file__).resolve().parents[2]  # the project: pyproject.toml, replicator/
THIS_PYTHON = f"{sys.version_info.major}.{sys.version_info.minor}"
# The environment variable with the ``--python`` a compile was run for (`run`): what
# `replicator.trainer.fit` adds to the winner's command, to compile it the same way.
ASKED_PYTHON = "REPLICATOR_COMPILE_PYTHON"
_VERSIONS = (  # what `pins` reads in the environment (no replicator import: that is seconds)
    "import importlib.metadata as m, json, sys\n"
    "def version(p):\n"
    "    try:\n"
    "        return m.version(p)\n"
    "    except m.PackageNotFoundError:\n"
    "        return None\n"
    "print(json.dumps({p: version(p) for p in sys.argv[1:]}))"
)


def envs_dir() -> pathlib.Path:
    """Where the environments are kept: ``$XDG_CACHE_HOME/replicator/envs`` (``~/.cache``)."""
    return cache_dir("envs")


def is_here(python: str) -> bool:
    """Whether ``python`` (a version ``X.Y``, or an interpreter's path) is this Python:
    its version, or the interpreter this one is (a virtualenv's is its base's). Then
    this interpreter compiles, and no environment is made.

    >>> is_here(THIS_PYTHON), is_here(sys.executable), is_here("2.7")
    (True, True, False)
    """
    if os.sep in python:
        return os.path.realpath(python) == os.path.realpath(sys.executable)
    return python == THIS_PYTHON


def check_python(python: str) -> str:
    """``python`` as `interpreter` takes it: a version ``X.Y``, or an interpreter's path
    (made absolute).

    Raises:
      LaunchError: neither.
    """
    if os.sep in python:
        return os.path.abspath(python)
    if not re.fullmatch(r"3\.\d+", python):
        raise LaunchError(
            f"--python {python}: give a version (e.g. 3.12) or the path of an interpreter"
        )
    return python


def environment(python: str, root: str | os.PathLike = ROOT) -> Environment:
    """The environment of ``python`` for the project at ``root``: keyed, as a worker's,
    by the Python and the dependency spec (`Environment.digest`)."""
    return Environment(python, dependency_spec(pathlib.Path(root, "pyproject.toml")))


def interpreter(
    python: str, root: str | os.PathLike = ROOT, *, make: bool = True, advice: str = ""
) -> str | None:
    """The interpreter that compiles for ``python``'s JAX: this one where ``python`` is
    this Python (`is_here`), else the one of its environment here, made first if
    missing or broken (`make_environment`).

    Args:
      python: a version uv brings or finds (``"3.12"``), or an interpreter's path.
      root: the project (its pyproject.toml says what to install).
      make: make a missing environment; False returns None for it (a dry run).
      advice: the caller's way out, ending the error of an environment not made (by
        default ``--python`` with this Python's version).

    Raises:
      LaunchError: ``python`` is no version or path; the environment cannot be made
        (no uv, no such Python, no PyPI).
    """
    python = check_python(python)
    if is_here(python):
        return sys.executable
    env = environment(python, root)
    path = envs_dir() / env.name
    if _complete(path):
        return str(path / "bin" / "python")
    if not make:
        return None
    advice = advice or f"--python {THIS_PYTHON} to compile with this machine's JAX"
    return str(make_environment(env, path, root, advice) / "bin" / "python")


def _complete(path: pathlib.Path) -> bool:
    """Made to the end, and its interpreter still there (uv's CPython may be removed)."""
    return (path / "installed").is_file() and (path / "bin" / "python").exists()


def make_environment(
    env: Environment, path: pathlib.Path, root: str | os.PathLike, advice: str = ""
) -> pathlib.Path:
    """``uv venv`` and ``uv pip install -r pyproject.toml --extra tpu`` at ``path``, under
    a lock (two compiles started at once make it once); ``installed`` marks it complete.

    Raises:
      LaunchError: uv is missing or failed (its error is in the message, then the ways
        out and ``advice``).
    """
    uv = uv_binary()
    path.parent.mkdir(parents=True, exist_ok=True)
    what = f"the Python at {env.python}" if env.preinstalled else f"Python {env.python}"
    with _locked(path.with_name(path.name + ".lock")):
        if _complete(path):  # made meanwhile by another compile
            return path
        shutil.rmtree(path, ignore_errors=True)  # a half-made one from an interrupted install
        print(f"# making {what}'s environment for the compile (once, a minute or two): {path}",
              flush=True)  # fmt: skip
        python, pyproject = str(path / "bin" / "python"), str(pathlib.Path(root, "pyproject.toml"))
        for words in (
            [uv, "venv", "--quiet", "--python", find_interpreter(env.python), str(path)],
            [uv, "pip", "install", "--quiet", "--python", python, "-r", pyproject,
             "--extra", "tpu"],
        ):  # fmt: skip
            done = subprocess.run(words, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                shutil.rmtree(path, ignore_errors=True)
                ways = (
                    f"install Python {env.python} or let uv download one (from github.com), "
                    f"or give an interpreter's path (--python /path/to/python{env.python})"
                    if not env.preinstalled
                    else "check that interpreter"
                )
                raise LaunchError(
                    f"cannot make {what}'s environment for the compile (`uv {words[1]}`: "
                    f"{uv_error(done.stderr)}); {ways}; or {advice}"
                )
        (path / "installed").write_text("")
    return path


def find_interpreter(python: str) -> str:
    """An interpreter of version ``python`` (``"3.12"``) that runs, for ``uv venv``: the
    first ``pythonX.Y`` on ``PATH`` that answers with that version, else pyenv's
    (``$PYENV_ROOT/versions/X.Y*``, where a pyenv shim of an inactive version exits
    127 and uv, stopping at that shim, would look for a download instead); ``python``
    itself where none is found (a path, or for uv to find or download).

    >>> find_interpreter(THIS_PYTHON).endswith(f"python{THIS_PYTHON}") or THIS_PYTHON
    True
    """
    if os.sep in python:
        return python
    name = f"python{python}"
    pyenv = os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))
    candidates = [found for found in [shutil.which(name)] if found]
    candidates += sorted(glob.glob(os.path.join(pyenv, "versions", f"{python}*", "bin", name)))
    for candidate in candidates:
        try:
            done = subprocess.run(
                [candidate, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                capture_output=True, text=True, timeout=30, check=False,
            )  # fmt: skip
        except OSError:
            continue
        if done.returncode == 0 and done.stdout.strip() == python:
            return candidate
    return python


def uv_error(stderr: str) -> str:
    """uv's error in one line: its first, and the last cause under it.

    >>> uv_error("error: Request failed\\n  cause: dns error\\n  cause: no such host\\n")
    'Request failed: no such host'
    """
    lines = [line.strip() for line in stderr.strip().splitlines() if line.strip()]
    first = next((line for line in lines if line.startswith("error:")), None)
    if first is None:
        return lines[-1] if lines else "no message"
    causes = [line.removeprefix("cause:").strip() for line in lines if line.startswith("cause:")]
    return first.removeprefix("error:").strip() + (f": {causes[-1]}" if causes else "")


def uv_binary() -> str:
    """uv: on ``PATH``, or the one the ``uv`` package installed beside this interpreter.

    Raises:
      LaunchError: neither.
    """
    found = shutil.which("uv") or shutil.which("uv", path=os.path.dirname(sys.executable))
    if found is None:
        raise LaunchError(
            "compiling with another Python's JAX needs uv here: pip install uv (the tpu "
            "extra has it), or give --python " + THIS_PYTHON
        )
    return found


@contextlib.contextmanager
def _locked(lock: pathlib.Path):
    with open(lock, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def pins(python: str) -> tuple[str, ...]:
    """``jax==V``, ``jaxlib==V``, ``libtpu==V`` as installed for the interpreter ``python``
    (`worker_env.compiler_pins` for this one); () where one is missing or no release."""
    if python == sys.executable:
        return compiler_pins()
    done = subprocess.run([python, "-c", _VERSIONS, *COMPILER], capture_output=True, text=True)
    return release_pins(json.loads(done.stdout)) if done.returncode == 0 else ()


def run(
    python: str, argv: Sequence[str], root: str | os.PathLike = ROOT, asked: str | None = None
) -> int:
    """``python -m replicator ARGV`` with this project's code (``PYTHONPATH``); its exit
    status. Its output is this process's. ``asked``: the ``--python`` it stands for."""
    env = child_environment()
    if asked:
        env[ASKED_PYTHON] = asked
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    return subprocess.run([python, "-m", "replicator", *argv], env=env, check=False).returncode


def child_environment() -> dict[str, str]:
    """This process's environment less what its own libraries put there for this
    interpreter: libtpu's ``TPU_LIBRARY_PATH`` (set on import; another environment's JAX
    would load this one's libtpu: "no such field" in its backend config) and the library
    folders under this interpreter's prefix in ``LD_LIBRARY_PATH`` (OpenCV's)."""
    env = {k: v for k, v in os.environ.items() if k != "TPU_LIBRARY_PATH"}
    prefix = os.path.realpath(sys.prefix)
    folders = env.get("LD_LIBRARY_PATH", "").split(os.pathsep)
    kept = [f for f in folders if f and not os.path.realpath(f).startswith(prefix + os.sep)]
    if kept:
        env["LD_LIBRARY_PATH"] = os.pathsep.join(kept)
    else:
        env.pop("LD_LIBRARY_PATH", None)
    return env
