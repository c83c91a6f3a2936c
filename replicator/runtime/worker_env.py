"""The workers' Python environment: installed once per dependency spec, not per code edit.

``launch tpu`` runs a job with the interpreter of a uv virtualenv on every worker,
``~/.replicator/envs/NAME``, that holds the project's dependencies and its ``tpu``
extra (``uv pip install -r pyproject.toml --extra tpu``), not the project: the job
imports the bundle's code through ``PYTHONPATH``. NAME ends in the hash of the
dependency spec (`Environment.digest`: the requirements and the Python), so a code
edit makes a new bundle and reuses the environment; only a change of the
dependencies, or of ``--python``, installs anew. The environment pins the jax, jaxlib
and libtpu of ``launch tpu``'s pre-flight compile (`replicator.runtime.compiler_env`:
the workers' Python's, made here; `compiler_pins`: this machine's): the pods run the
compiler that checked their program, and a new compiler here is a new environment
there. A bundle records the environment
it ran with, and `prune_script` keeps the newest few bundles and the environments
they use.

What installing takes, three ways:

* by default, the internet: uv (from PyPI), a managed CPython (`DEFAULT_PYTHON`,
  uv's download, from github.com) and the packages (PyPI);
* ``--python PATH``: an interpreter installed on every worker, instead of a
  managed CPython;
* ``--wheels``: the packages as wheels downloaded here for the TPU VMs' platform
  (`download_commands`: ``pip download --platform``), uv among them, shipped beside
  the bundle as a tarball named by the environment.

With ``--python PATH`` and ``--wheels`` a worker needs no internet at all (TPU VMs
with internal IP addresses only, no Cloud NAT). Before anything is copied,
`probe_script` asks every worker whether it has the environment and, if not,
whether it reaches what installing it needs; `check_answers` turns a worker that
cannot into one line naming what is missing.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import os
import pathlib
import re
import shlex
import subprocess
import sys
import tarfile
import tempfile
import tomllib
from collections.abc import Sequence

from replicator.errors import LaunchError
from replicator.runtime.bundle import BUNDLES, Bundle

# On every worker: the environments, and the wheels shipped for one while it installs.
ENVS = "$HOME/.replicator/envs"
WHEELS = "$HOME/.replicator/wheels"
EXTRA = "tpu"  # the project's extra for a TPU VM (jax[tpu], libtpu)
COMPILER = ("jax", "jaxlib", "libtpu")  # what the workers pin (`compiler_pins`)
# The workers' Python by default: 3.12, for the newest JAX (0.11 and newer need it; the
# TPU VM images ship 3.10, the project needs 3.11 or newer). JAX 0.10.2, the last for 3.11,
# brings libtpu 0.0.42.1, whose programs need 8-35% more HBM per chip; the pre-flight
# compiles with the workers' JAX (`replicator.runtime.compiler_env`).
DEFAULT_PYTHON = "3.12"
MIN_PYTHON = (3, 11)
# The TPU VMs' platform for `pip download`: x86-64 Linux with glibc 2.35 (Ubuntu 22.04),
# which runs every older manylinux wheel (pip expands manylinux2014 itself).
TPU_VM_PLATFORMS = (
    *(f"manylinux_2_{minor}_x86_64" for minor in range(35, 16, -1)),
    "manylinux2014_x86_64",
)
# What installing fetches, by host: the packages and uv; a managed CPython.
PYPI_HOSTS = ("pypi.org", "files.pythonhosted.org")
PYTHON_HOSTS = ("github.com",)
KEEP_BUNDLES = 3
_PROBE = "replicator-probe"  # the first word of each worker's answer


@dataclasses.dataclass(frozen=True)
class Environment:
    """The workers' environment: a Python and the project's dependencies.

    Attributes:
      python: a version uv brings (``"3.11"``), or the absolute path of an
        interpreter installed on every worker.
      requirements: the dependency spec, as pyproject.toml states it: the
        project's dependencies, then its ``tpu`` extra.
      wheels: install from wheels shipped with the bundle instead of PyPI.
      pins: exact versions installed on top (`compiler_pins`: the compiler of the
        pre-flight compile here, so that the workers run the program it checked).
    """

    python: str
    requirements: tuple[str, ...]
    wheels: bool = False
    pins: tuple[str, ...] = ()

    @property
    def digest(self) -> str:
        """The hash of the Python, the requirements and the pins: what keys the environment."""
        spec = "\0".join([f"python={self.python}", *self.requirements, *self.pins])
        return hashlib.sha256(spec.encode()).hexdigest()[:12]

    @property
    def preinstalled(self) -> bool:
        """Whether ``python`` is an interpreter on the workers rather than a version."""
        return self.python.startswith("/")

    @property
    def name(self) -> str:
        """The environment's directory name: ``py3.11-HASH`` or ``python-HASH``."""
        return f"python-{self.digest}" if self.preinstalled else f"py{self.python}-{self.digest}"

    @property
    def remote_dir(self) -> str:
        """Where the environment is on every worker."""
        return f"{ENVS}/{self.name}"

    @property
    def wheelhouse(self) -> str:
        """The name of the tarball of wheels shipped for it (``--wheels``)."""
        return f"replicator-wheels-{self.name}.tar"


def dependency_spec(pyproject: str | os.PathLike) -> tuple[str, ...]:
    """The project's dependencies and its ``tpu`` extra, as ``pyproject`` lists them."""
    with open(pyproject, "rb") as f:
        project = tomllib.load(f)["project"]
    extra = project.get("optional-dependencies", {}).get(EXTRA, [])
    return (*project.get("dependencies", []), *extra)


def compiler_pins() -> tuple[str, ...]:
    """``jax==V``, ``jaxlib==V`` and ``libtpu==V`` as installed here, where libtpu is:
    the workers then run the compiler that compiled the pre-flight here (libtpu
    versions differ by 8-35% in a program's HBM). () without libtpu here (no
    pre-flight to agree with: the ``tpu`` extra's range decides), and for a version
    that is no release (a local build PyPI does not have).
    """
    versions = {}
    for package in COMPILER:
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    return release_pins(versions)


def release_pins(versions: dict[str, str | None]) -> tuple[str, ...]:
    """``("jax==V", ...)`` for `COMPILER`'s ``versions``; () where one is missing (None)
    or no release.

    >>> release_pins({"jax": "0.12.0.1", "jaxlib": "0.12.0.1", "libtpu": "0.0.52"})[2]
    'libtpu==0.0.52'
    >>> release_pins({"jax": "0.12.0.1", "jaxlib": "0.12.0.1", "libtpu": None})
    ()
    """
    pins = []
    for package in COMPILER:
        version = versions.get(package)
        if version is None or not re.fullmatch(r"\d+(\.\d+)*", version):
            return ()
        pins.append(f"{package}=={version}")
    return tuple(pins)


def plan_environment(
    root: str | os.PathLike,
    python: str = DEFAULT_PYTHON,
    wheels: bool = False,
    pins: tuple[str, ...] | None = None,
) -> Environment:
    """The environment the project at ``root`` runs in on the workers: its
    dependencies and ``tpu`` extra, with the pre-flight's compiler pinned: ``pins``
    (`replicator.runtime.compiler_env.pins`), by default this machine's (`compiler_pins`).

    Raises:
      LaunchError: ``python`` is neither a version ``X.Y`` nor an absolute path.
    """
    if not (re.fullmatch(r"3\.\d+", python) or python.startswith("/")):
        raise LaunchError(
            f"--python {python}: give a version uv brings (e.g. {DEFAULT_PYTHON}) or the "
            "absolute path of an interpreter installed on every worker"
        )
    requirements = dependency_spec(pathlib.Path(root, "pyproject.toml"))
    return Environment(python, requirements, wheels, compiler_pins() if pins is None else pins)


def describe_environment(env: Environment) -> str:
    """One line on the environment, for the launcher's output."""
    python = f"the workers' {env.python}" if env.preinstalled else f"Python {env.python} (uv)"
    source = "wheels shipped from here" if env.wheels else "PyPI"
    pinned = ", ".join(p.replace("==", " ") for p in env.pins)
    pinned = f" (pinned to the compiler that checks it here: {pinned})" if pinned else ""
    return (
        f"environment {env.name}: {python}, the project's dependencies and its {EXTRA} extra"
        f"{pinned} from {source}; installed where it is missing, kept until they change"
    )


# ---------------------------------------------------------------- before anything is copied


def probe_script(env: Environment) -> str:
    """Bash that prints one line on a worker: whether it has ``env``, and if not, its
    Python and the hosts it needs but cannot reach (`read_answers` reads it)."""
    lines = [
        f'env="{env.remote_dir}"',
        'export PATH="$HOME/.local/bin:$PATH"',
        'if [ -f "$env/installed" ]; then',
        f'  echo "{_PROBE} host=$(hostname) env=yes"',
        "  exit 0",
        "fi",
        "reach() {",
        "  if command -v curl >/dev/null; then",
        '    curl -s -o /dev/null --connect-timeout 5 --max-time 15 "https://$1/"',
        "  else",
        '    python3 -c "import sys, urllib.request as u; u.urlopen(sys.argv[1], timeout=15)" '
        '"https://$1/" 2>/dev/null',
        "  fi",
        "}",
        "need=",
        "uv=no; command -v uv >/dev/null && uv=yes",
    ]
    if not env.wheels:
        lines.append(f'need="{" ".join(PYPI_HOSTS)}"')
    if env.preinstalled:
        version = '"import sys; print(*sys.version_info[:2], sep=chr(46))"'
        lines.append(f"python=$({quote(env.python)} -c {version} 2>/dev/null || echo none)")
    else:
        lines += [
            f"if command -v python{env.python} >/dev/null || {{ [ $uv = yes ] && uv python find "
            f"{env.python} >/dev/null 2>&1; }}; then",
            f"  python={env.python}",
            "else",
            f'  python=download; need="$need {" ".join(PYTHON_HOSTS)}"',
            "fi",
        ]
    if not env.wheels:  # else uv is among the wheels
        lines.append('[ $uv = yes ] || need="$need pypi.org"')
    lines += [
        "unreachable=",
        'for host in $(printf "%s\\n" $need | sort -u); do',
        '  reach "$host" || unreachable="$unreachable,$host"',
        "done",
        f'echo "{_PROBE} host=$(hostname) env=no python=$python uv=$uv '
        'unreachable=${unreachable#,}"',
    ]
    return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class Answer:
    """One worker's answer to `probe_script`.

    Attributes:
      host: the worker's host name.
      has_env: the environment is installed there.
      python: the version of its interpreter (``--python PATH``), ``none`` when it
        has none, ``download`` when uv must fetch one; empty when it has the env.
      unreachable: the hosts installing needs that it cannot reach.
    """

    host: str
    has_env: bool
    python: str = ""
    unreachable: tuple[str, ...] = ()


def read_answers(output: str) -> list[Answer]:
    """The workers' answers in the output of the probe (other lines are ignored).

    >>> read_answers("noise\\nreplicator-probe host=w-0 env=yes\\nreplicator-probe "
    ...              "host=w-1 env=no python=download uv=no unreachable=github.com")
    ... # doctest: +NORMALIZE_WHITESPACE
    [Answer(host='w-0', has_env=True, python='', unreachable=()),
     Answer(host='w-1', has_env=False, python='download', unreachable=('github.com',))]
    """
    answers = []
    for line in output.splitlines():
        words = line.strip().split()
        if words[:1] != [_PROBE]:
            continue
        fields = dict(word.partition("=")[::2] for word in words[1:])
        unreachable = tuple(h for h in fields.get("unreachable", "").split(",") if h)
        has_env = fields.get("env") == "yes"
        python = fields.get("python", "")
        answers.append(Answer(fields.get("host", "?"), has_env, python, unreachable))
    return answers


def check_answers(answers: Sequence[Answer], env: Environment, pod: str) -> str | None:
    """Whether every worker can have ``env``: the Python version the workers without
    it install for (None when every worker has it).

    Raises:
      LaunchError: one line: a worker that did not answer, has no such interpreter,
        one too old, or cannot reach what installing needs (and the ways out).
    """
    if not answers:
        raise LaunchError(f"the workers of {pod} did not answer the probe above")
    missing = [a for a in answers if not a.has_env]
    if not missing:
        return None
    if env.preinstalled:
        _check_interpreters(missing, len(answers), env, pod)
    cut_off = [a for a in missing if a.unreachable]
    if cut_off:
        raise LaunchError(_unreachable_message(cut_off, len(answers), env, pod))
    version = missing[0].python
    return version if env.preinstalled else env.python


def _check_interpreters(missing: Sequence[Answer], total: int, env: Environment, pod: str):
    """``--python PATH``: the same Python, new enough, on every worker that installs."""
    bad = [a for a in missing if not _new_enough(a.python)] or (
        [a for a in missing if a.python != missing[0].python]
    )
    if not bad:
        return
    found = "no such interpreter" if bad[0].python == "none" else f"Python {bad[0].python}"
    raise LaunchError(
        f"--python {env.python}: {_hosts(bad, total)} {found} there (replicator needs "
        f"{'.'.join(map(str, MIN_PYTHON))} or newer, the same on every worker of {pod}): "
        f"install it, or give a version for uv to bring, e.g. --python {DEFAULT_PYTHON}"
    )


def _new_enough(version: str) -> bool:
    return bool(re.fullmatch(r"\d+\.\d+", version)) and (
        tuple(map(int, version.split("."))) >= MIN_PYTHON
    )


def _hosts(answers: Sequence[Answer], total: int) -> str:
    names = ", ".join(a.host for a in answers[:2]) + (" ..." if len(answers) > 2 else "")
    return f"{len(answers)} of {total} workers ({names}) have"


def _unreachable_message(cut_off: Sequence[Answer], total: int, env: Environment, pod: str):
    hosts = sorted({h for a in cut_off for h in a.unreachable})
    pypi = [h for h in hosts if h in PYPI_HOSTS]
    python = [h for h in hosts if h in PYTHON_HOSTS]
    what, ways = [], []
    if pypi:
        what.append(f"{', '.join(pypi)} (PyPI: the packages, uv)")
        ways.append("--wheels (the packages, downloaded here and shipped)")
    if python:
        what.append(f"{', '.join(python)} (uv's CPython {env.python})")
        ways.append("--python PATH (an interpreter installed on every worker)")
    reach = _hosts(cut_off, total).removesuffix(" have")
    return (
        f"{reach} of {pod} cannot reach {' and '.join(what)} to install the environment: give "
        f"their network a way out (Cloud NAT), or bring what they need: {' with '.join(ways)}"
    )


# ---------------------------------------------------------------- on the workers


def quote(word: str) -> str:
    """``word`` for bash, in double quotes where it needs quotes (the scripts go inside
    gcloud's single-quoted ``--command``, which single quotes would break up)."""
    if re.fullmatch(r"[A-Za-z0-9_@%+=:,./-]+", word):
        return word
    return '"' + re.sub(r'([\\"$`])', r"\\\1", word) + '"'


def setup_script(bundle: Bundle, env: Environment) -> str:
    """Bash that unpacks ``bundle`` (copied to the worker's home directory) into
    `Bundle.remote_dir` once, installs ``env`` where it is missing (from the wheels
    shipped beside the bundle with ``--wheels``) and records it as the bundle's."""
    lines = [
        "set -eu",
        f'bundle="{bundle.remote_dir}"',
        f'env="{env.remote_dir}"',
        'if [ ! -d "$bundle" ]; then',
        '  rm -rf "$bundle.part" && mkdir -p "$bundle.part"',
        f'  tar -xzf "$HOME/{bundle.name}" -C "$bundle.part"',
        '  mv "$bundle.part" "$bundle"',
        "fi",
        f'rm -f "$HOME/{bundle.name}"',
        'if [ ! -f "$env/installed" ]; then',
        '  export PATH="$HOME/.local/bin:$PATH"',
        *(f"  {line}" for line in _install_lines(env)),
        "fi",
        'echo "$env" > "$bundle/env"',  # what `prune_script` keeps while the bundle stays
    ]
    if env.wheels:
        lines.append(f'rm -rf "$HOME/{env.wheelhouse}" "{WHEELS}/{env.name}"')
    return "\n".join(lines)


def _pin_lines(env: Environment) -> list[str]:
    """The pins as uv's constraints (``UV_CONSTRAINT``), written into the new environment."""
    if not env.pins:
        return []
    return [
        f'printf "%s\\n" {" ".join(env.pins)} > "$env/pins.txt"',
        'export UV_CONSTRAINT="$env/pins.txt"',
    ]


def _install_lines(env: Environment) -> list[str]:
    source = '-r "$bundle/project/pyproject.toml" --extra ' + EXTRA
    if not env.wheels:
        return [
            "command -v uv >/dev/null || python3 -m pip install --user --quiet uv "
            "|| curl -LsSf https://astral.sh/uv/install.sh | sh",
            'rm -rf "$env"',
            f'uv venv --quiet --python {quote(env.python)} "$env"',
            *_pin_lines(env),
            f'uv pip install --quiet --python "$env/bin/python" {source}',
            'touch "$env/installed"',
        ]
    return [
        f'wheels="{WHEELS}/{env.name}"',
        'rm -rf "$wheels" && mkdir -p "$wheels"',
        f'tar -xf "$HOME/{env.wheelhouse}" -C "$wheels"',
        "if ! command -v uv >/dev/null; then",  # uv from its own wheel, which holds the binary
        '  set -- "$wheels"/uv-*.whl',
        '  python3 -m zipfile -e "$1" "$wheels/.uv"',
        '  mkdir -p "$HOME/.local/bin"',
        '  install -m 755 "$wheels"/.uv/uv-*.data/scripts/uv "$HOME/.local/bin/uv"',
        "fi",
        'rm -rf "$env"',
        f'uv venv --quiet --python {quote(env.python)} "$env"',
        *_pin_lines(env),
        'uv pip install --quiet --offline --no-index --find-links "$wheels" '
        f'--python "$env/bin/python" {source}',
        'touch "$env/installed"',
    ]


def prune_script(keep: int = KEEP_BUNDLES) -> str:
    """Bash that keeps the ``keep`` newest bundles on a worker (the one ``$bundle``
    names counts as the newest) and the environments they use; the rest goes."""
    return "\n".join(
        [
            'touch "$bundle"',
            f'old=$(cd "{BUNDLES}" && ls -1t | grep -v "[.]part$" | tail -n +{keep + 1})',
            "for old in $old; do",
            f'  rm -rf "{BUNDLES}/$old" && echo "$(hostname): removed bundle $old"',
            "done",
            f'for old in "{ENVS}"/*; do',
            '  [ -d "$old" ] || continue',
            f'  if ! cat "{BUNDLES}"/*/env 2>/dev/null | grep -qxF "$old"; then',
            '    rm -rf "$old" && echo "$(hostname): removed environment ${old##*/}"',
            "  fi",
            "done",
        ]
    )


# ---------------------------------------------------------------- the wheels, here


def cache_dir(*parts: str) -> pathlib.Path:
    """``$XDG_CACHE_HOME/replicator/PARTS`` (``~/.cache`` by default): where the launcher
    and the compile keep what they make on this machine (wheels, environments, reports)."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(cache, "replicator", *parts)


def wheel_cache(env: Environment, version: str) -> pathlib.Path:
    """Where the wheels for ``env`` on Python ``version`` are kept here, for reuse."""
    return cache_dir("wheels", f"{env.digest}-py{version}")


def download_command(env: Environment, version: str, dest: str | os.PathLike) -> list[str]:
    """The ``pip download`` of ``env``'s requirements (``dest/requirements.txt``) and uv,
    for the TPU VMs' platform and Python ``version``, into ``dest``."""
    pip = [sys.executable, "-m", "pip"]
    target = [f"--platform={p}" for p in TPU_VM_PLATFORMS]
    target += [f"--python-version={version}", "--implementation=cp", "--only-binary=:all:"]
    requirements = os.path.join(dest, "requirements.txt")
    download = [*pip, "download", "--quiet", *target, f"--find-links={dest}", f"--dest={dest}"]
    return [*download, "-r", requirements, "uv"]


def download_wheels(env: Environment, version: str) -> pathlib.Path:
    """Downloads (once) the wheels ``env`` needs on Python ``version`` into `wheel_cache`.

    ``pip download --platform`` takes wheels only; a requirement published only as
    source is built into a wheel here (``pip wheel --no-deps``) and the download
    tried again, up to 10 times.

    Raises:
      LaunchError: pip failed for another reason (its last line is in the message).
    """
    dest = wheel_cache(env, version)
    if (dest / "complete").is_file():
        return dest
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "requirements.txt").write_text("\n".join([*env.requirements, *env.pins]) + "\n")
    download = download_command(env, version, dest)
    for _ in range(10):
        print(f"# {shlex.join(['pip', *download[3:]])}", flush=True)
        done = subprocess.run(download, capture_output=True, text=True, check=False)
        if done.returncode == 0:
            (dest / "complete").write_text("")
            return dest
        source_only = re.search(r"No matching distribution found for (\S+)", done.stderr)
        if source_only is None:
            last = (done.stderr.strip().splitlines() or ["no message"])[-1]
            raise LaunchError(f"pip download of the workers' wheels failed: {last}")
        build = [*download[:3], "wheel", "--quiet", "--no-deps", f"--wheel-dir={dest}"]
        print(f"# {shlex.join(['pip', *build[3:], source_only.group(1)])}", flush=True)
        built = subprocess.run([*build, source_only.group(1)], capture_output=True, text=True)
        if built.returncode != 0:
            raise LaunchError(
                f"{source_only.group(1)} has no wheel for the TPU VMs and cannot be built here: "
                f"{(built.stderr.strip().splitlines() or ['no message'])[-1]}"
            )
    raise LaunchError("pip download of the workers' wheels did not settle after 10 tries")


def local_wheelhouse_path(env: Environment) -> str:
    """Where the launcher writes the tarball of wheels before copying it (and removes it)."""
    return os.path.join(tempfile.gettempdir(), env.wheelhouse)


def write_wheelhouse(env: Environment, wheels: pathlib.Path) -> pathlib.Path:
    """The wheels in ``wheels`` as one tarball at `local_wheelhouse_path`."""
    path = pathlib.Path(local_wheelhouse_path(env))
    with tarfile.open(path, "w") as tar:
        for wheel in sorted(wheels.glob("*.whl")):
            tar.add(wheel, arcname=wheel.name)
    return path
