"""Cloud TPU pods: the bundle a job ships and the gcloud commands that start, follow
and stop it.

``launch tpu`` runs a command on every worker of a TPU VM pod (or, with
``--slices N``, of every slice of a queued resource) with three gcloud commands,
each printed before it runs (``--dry-run`` prints them and runs nothing):

1. ``scp`` of one tarball, the *bundle* (`plan_bundle`), to every worker. It holds
   the project's files (`project_files`: git's view of the source tree the
   ``replicator`` package comes from, whatever the working directory) and the
   experiment files the command names (`experiment_files`: a config or a script
   and the Python files beside it) at their paths relative to the working
   directory, so that the command runs unchanged. Its name is its content hash.
2. ``ssh`` to every worker: unpack the bundle into ``~/.replicator/bundles/HASH``
   and, once per bundle (a stamp file), install the project with its ``tpu``
   extra into a uv virtualenv of this machine's Python version: the TPU VM
   images ship an older Python than the project needs.
3. ``ssh`` to every worker: free the TPU (kill the processes holding it, remove
   libtpu's lock file) and start the command detached under the worker
   supervisor, `replicator.runtime.worker`, which outlives the ssh session, logs
   to ``~/.replicator/job/worker.log`` and mirrors that log to
   ``WORKDIR/launch/worker-N.log``.

Before any of it, ``launch tpu`` compiles a ``train`` command's config for the
pod here and refuses a run that does not fit (`replicator.runtime.preflight`).

`logs_command` follows a worker's log; `stop_command` stops the job on every
worker (SIGTERM, which the trainer turns into a checkpoint; SIGKILL after a
grace period) and frees the TPU.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import io
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable, Iterator, Sequence

from replicator.errors import LaunchError as LaunchError

# On every worker ($HOME is the worker's): the unpacked bundles, and the job's pid and log.
BUNDLES = "$HOME/.replicator/bundles"
JOB = "$HOME/.replicator/job"
# What holds a TPU (v4 and older: /dev/accel*; v5 and v6: /dev/vfio/*) and libtpu's lock.
TPU_DEVICES = "/dev/accel* /dev/vfio/*"
TPU_LOCKFILE = "/tmp/libtpu_lockfile"
# The workers' Python: the version of the one running the launcher, where the project
# was tried (the TPU VM images ship 3.10; the project needs 3.11 or newer).
DEFAULT_PYTHON = f"{sys.version_info.major}.{sys.version_info.minor}"
# Directories that hold no code of the project: never shipped unless a Python package.
NON_CODE_DIRS = frozenset(
    {".venv", "venv", "env", "runs", "data", "datasets", "tensorflow_datasets",
     "checkpoints", "wandb", "build", "dist", "node_modules"}
)  # fmt: skip
_BUNDLE_MTIME = 1_577_836_800  # 2020-01-01: the same contents give the same tarball


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


@dataclasses.dataclass(frozen=True)
class Bundle:
    """What a job ships to the workers: one tarball, named by the hash of its contents.

    Attributes:
      files: name in the tarball -> the file here. The project's files are under
        ``project/``; the working directory is ``project/...`` when it is inside
        the project, else ``work/``.
      run_dir: the directory of the tarball the command runs in (the working
        directory's image).
      extras: the experiment files that are not the project's, relative to the
        working directory.
      digest: the hash of the names, modes and contents, and of ``run_dir``.
    """

    files: dict[str, pathlib.Path]
    run_dir: str
    extras: tuple[str, ...]
    digest: str

    @property
    def name(self) -> str:
        """The tarball's file name."""
        return f"replicator-{self.digest}.tar.gz"

    @property
    def remote_dir(self) -> str:
        """Where the bundle is unpacked on every worker."""
        return f"{BUNDLES}/{self.digest}"


# ---------------------------------------------------------------- the bundle


def project_root() -> pathlib.Path:
    """The source tree the ``replicator`` package is imported from (its pyproject.toml)."""
    root = pathlib.Path(__file__).resolve().parents[2]
    if not (root / "pyproject.toml").is_file():
        raise LaunchError(
            f"launch tpu ships the project's source tree, but replicator is imported from "
            f"{root}, which has no pyproject.toml: install it from a checkout (pip install -e)."
        )
    return root


def project_files(root: pathlib.Path) -> list[str]:
    """The files of the project at ``root`` to ship, as sorted paths relative to it.

    Git's view of the tree where there is one: tracked files and new files that
    are not ignored (``git ls-files --cached --others --exclude-standard``);
    otherwise every file under ``root`` outside hidden directories. Either way
    never ``__pycache__``, a virtualenv or a directory of runs, data or build
    outputs (`NON_CODE_DIRS`) that is not a Python package.
    """
    names = _git_files(root)
    if names is None:
        names = _walk_files(root)
    return sorted(n for n in set(names) if (root / n).is_file() and not _excluded(root, n))


def _git_files(root: pathlib.Path) -> list[str] | None:
    listing = ["git", "-C", str(root), "ls-files", "-z", "--cached", "--others"]
    listing.append("--exclude-standard")
    try:
        done = subprocess.run(listing, capture_output=True, check=True, timeout=60)
    except (OSError, subprocess.SubprocessError):  # no git, or not a repository
        return None
    return [n for n in done.stdout.decode().split("\0") if n]


def _walk_files(root: pathlib.Path) -> list[str]:
    found = []
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if not d.startswith("."))
        found += [os.path.relpath(os.path.join(directory, f), root) for f in files]
    return found


def _excluded(root: pathlib.Path, name: str) -> bool:
    parts = pathlib.PurePath(name).parts
    if parts[-1].endswith((".pyc", ".pyo")):
        return True
    return any(_skipped_dir(root.joinpath(*parts[: i + 1])) for i in range(len(parts) - 1))


def _skipped_dir(directory: pathlib.Path) -> bool:
    name = directory.name
    if name == "__pycache__" or name.endswith(".egg-info") or (directory / "pyvenv.cfg").exists():
        return True
    return name in NON_CODE_DIRS and not (directory / "__init__.py").is_file()


def experiment_files(command: Sequence[str], cwd: pathlib.Path) -> list[str]:
    """The files of ``command`` to ship besides the project, relative to ``cwd``.

    Every Python file the command names (``--config my_config.py[:mode]``,
    ``python my_script.py``, ``--flag=file.py``; ``python -m my_module``), with
    the Python files and packages beside it, which a config or a script may
    import.

    Raises:
      LaunchError: a named Python file outside ``cwd``: on the workers the
        command runs in the image of ``cwd``.
    """
    named = set(_named_python_files(command, cwd))
    beside = set()
    for name in named:
        beside.update(os.path.relpath(p, cwd) for p in _python_beside((cwd / name).parent))
    return sorted(named | {n for n in beside if not _excluded(cwd, n)})


def _named_python_files(command: Sequence[str], cwd: pathlib.Path) -> Iterator[str]:
    for word in _words_and_values(command):
        path = word.split(":", 1)[0] if ".py:" in word else word  # a config's :mode
        if not path.endswith(".py"):
            continue
        if os.path.isabs(path):
            if os.path.isfile(path):
                raise LaunchError(
                    f"{path}: give the files of the command relative to the working directory "
                    "(they are shipped to the same relative place on every worker)."
                )
            continue
        if (cwd / path).is_file():
            relative = os.path.normpath(path)
            if relative == ".." or relative.startswith(f"..{os.sep}"):
                raise LaunchError(
                    f"{path} is outside the working directory; run launch from a directory "
                    "that contains it (it is shipped to the same relative place)."
                )
            yield relative
    yield from _named_module_files(command, cwd)


def _words_and_values(command: Sequence[str]) -> Iterator[str]:
    for word in command:
        yield word
        if word.startswith("-") and "=" in word:
            yield word.split("=", 1)[1]


def _named_module_files(command: Sequence[str], cwd: pathlib.Path) -> Iterator[str]:
    """The files of ``python -m MODULE`` when MODULE lives in ``cwd``."""
    words = list(command)
    if words[:1] not in (["python"], ["python3"]) or "-m" not in words[:-1]:
        return
    top = words[words.index("-m") + 1].split(".")[0]
    if (cwd / top / "__init__.py").is_file():
        yield from (os.path.relpath(p, cwd) for p in _package_files(cwd / top))
    elif (cwd / f"{top}.py").is_file():
        yield f"{top}.py"


def _python_beside(directory: pathlib.Path) -> list[pathlib.Path]:
    found = [p for p in directory.glob("*.py") if p.is_file()]
    for sub in sorted(directory.iterdir()):
        if sub.is_dir() and (sub / "__init__.py").is_file() and not _skipped_dir(sub):
            found += _package_files(sub)
    return found


def _package_files(package: pathlib.Path) -> list[pathlib.Path]:
    found = []
    for directory, subdirs, files in os.walk(package):
        subdirs[:] = [d for d in subdirs if not _skipped_dir(pathlib.Path(directory, d))]
        found += [pathlib.Path(directory, f) for f in files if f.endswith(".py")]
    return found


def plan_bundle(command: Sequence[str], cwd: str | os.PathLike | None = None) -> Bundle:
    """The bundle that runs ``command`` from ``cwd`` (default: the working directory).

    Args:
      command: the words after ``--``.
      cwd: the directory the command's relative paths start from.

    Returns:
      A `Bundle`: the project's files under ``project/`` (`project_files`) and
      the experiment files (`experiment_files`) under the image of ``cwd``:
      ``project/REL`` when ``cwd`` is ``REL`` inside the project, else ``work/``.
    """
    root = project_root()
    cwd = pathlib.Path(cwd or os.getcwd()).resolve()
    files = {f"project/{name}": root / name for name in project_files(root)}
    inside = cwd == root or root in cwd.parents
    run_dir = os.path.normpath(f"project/{cwd.relative_to(root)}") if inside else "work"
    named = experiment_files(command, cwd)
    extras = tuple(n for n in named if os.path.normpath(f"{run_dir}/{n}") not in files)
    for name in extras:
        files[os.path.normpath(f"{run_dir}/{name}")] = cwd / name
    files = dict(sorted(files.items()))
    return Bundle(files, run_dir.replace(os.sep, "/"), extras, _digest(files, run_dir))


def _digest(files: dict[str, pathlib.Path], run_dir: str) -> str:
    digest = hashlib.sha256(f"run_dir={run_dir}\0".encode())
    for name, path in files.items():
        digest.update(f"{name}\0{_mode(path):o}\0".encode())
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()[:12]


def _mode(path: pathlib.Path) -> int:
    return 0o755 if os.access(path, os.X_OK) else 0o644


def write_bundle(bundle: Bundle, path: str | os.PathLike) -> pathlib.Path:
    """Writes ``bundle`` as a gzipped tarball at ``path``; the same bundle, the same bytes."""
    path = pathlib.Path(path)
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        run_dir = tarfile.TarInfo(bundle.run_dir)
        run_dir.type, run_dir.mode, run_dir.mtime = tarfile.DIRTYPE, 0o755, _BUNDLE_MTIME
        tar.addfile(run_dir)
        for name, source in bundle.files.items():
            data = source.read_bytes()
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), _mode(source), _BUNDLE_MTIME
            tar.addfile(info, io.BytesIO(data))
    partial = path.with_name(f".{path.name}.{os.getpid()}.part")
    with open(partial, "wb") as f, gzip.GzipFile("", "wb", fileobj=f, mtime=0) as gz:
        gz.write(buffer.getvalue())
    os.replace(partial, path)
    return path


def describe_bundle(bundle: Bundle) -> str:
    """One line on what ``bundle`` holds, for the launcher's output."""
    size = sum(p.stat().st_size for p in bundle.files.values())
    extras = f" and {', '.join(bundle.extras)} from here" if bundle.extras else ""
    where = f"{bundle.remote_dir}/{bundle.run_dir}".replace("$HOME", "~")
    return (
        f"bundle {bundle.name}: {len(bundle.files)} files ({size / 1e6:.1f} MB) of the project "
        f"{project_root()}{extras}; the command runs in {where}"
    )


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


def _quote(word: str) -> str:
    """``word`` for bash, in double quotes (the scripts go inside gcloud's single-quoted
    ``--command``, which single quotes would break up)."""
    if re.fullmatch(r"[A-Za-z0-9_@%+=:,./-]+", word):
        return word
    return '"' + re.sub(r'([\\"$`])', r"\\\1", word) + '"'


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


def setup_script(bundle: Bundle, python: str = DEFAULT_PYTHON) -> str:
    """Bash that unpacks ``bundle`` (copied to the worker's home directory) into
    `Bundle.remote_dir` and installs the project with its ``tpu`` extra into a uv
    virtualenv of Python ``python``; both only once per bundle."""
    return "\n".join(
        [
            "set -eu",
            f'bundle="{bundle.remote_dir}"',
            f'venv="$bundle/venv-py{python}"',
            'if [ ! -d "$bundle" ]; then',
            '  rm -rf "$bundle.part" && mkdir -p "$bundle.part"',
            f'  tar -xzf "$HOME/{bundle.name}" -C "$bundle.part"',
            '  mv "$bundle.part" "$bundle"',
            "fi",
            f'rm -f "$HOME/{bundle.name}"',
            'if [ ! -f "$venv/installed" ]; then',
            '  export PATH="$HOME/.local/bin:$PATH"',
            "  command -v uv >/dev/null || python3 -m pip install --user --quiet uv "
            "|| curl -LsSf https://astral.sh/uv/install.sh | sh",
            '  rm -rf "$venv"',
            f'  uv venv --quiet --python {python} "$venv"',
            '  uv pip install --quiet --python "$venv/bin/python" -e "$bundle/project[tpu]"',
            '  touch "$venv/installed"',
            "fi",
        ]
    )


def start_script(
    bundle: Bundle,
    command: Sequence[str],
    *,
    python: str = DEFAULT_PYTHON,
    restarts: int = 0,
    log_dir: str | None = None,
) -> str:
    """Bash that starts ``command`` detached on a worker, under the worker supervisor.

    It refuses while a job runs there (its process group, from ``JOB/pid``, is
    alive), frees the TPU (`free_tpu_script`) and starts ``python -m
    replicator.runtime.worker`` with ``setsid nohup ... &`` in the bundle's
    image of the working directory, then waits until the supervisor has written
    its pid file.
    """
    worker = [
        '"$bundle/venv-py' + python + '/bin/python"',
        "-m",
        "replicator.runtime.worker",
        "--pid-file",
        '"$job/pid"',
        "--log",
        '"$job/worker.log"',
        *(["--log-dir", _quote(log_dir)] if log_dir else []),
        *(["--restarts", str(restarts)] if restarts else []),
        "--",
        *(_quote(w) for w in command),
    ]
    return "\n".join(
        [
            "set -eu",
            f'bundle="{bundle.remote_dir}"',
            f'job="{JOB}"',
            'mkdir -p "$job"',
            'if [ -f "$job/pid" ] && kill -0 -- "-$(cat "$job/pid")" 2>/dev/null; then',
            '  echo "error: $(hostname) runs a job (process group $(cat "$job/pid")); '
            'stop it first: launch tpu ... --stop" >&2',
            "  exit 1",
            "fi",
            'rm -f "$job/pid"',
            free_tpu_script(),
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


def local_bundle_path(bundle: Bundle) -> str:
    """Where the launcher writes the tarball before copying it (and removes it after)."""
    return os.path.join(tempfile.gettempdir(), bundle.name)


def start_commands(
    pod: Pod,
    bundle: Bundle,
    command: Sequence[str],
    *,
    python: str = DEFAULT_PYTHON,
    restarts: int = 0,
    log_dir: str | None = None,
) -> list[list[str]]:
    """The gcloud commands that copy ``bundle`` to every worker of ``pod``, set it up
    (`setup_script`) and start ``command`` there (`start_script`)."""
    start = start_script(bundle, command, python=python, restarts=restarts, log_dir=log_dir)
    return [
        pod.gcloud("scp", local_bundle_path(bundle), f"{pod.name}:{bundle.name}"),
        [*pod.gcloud("ssh", pod.name), f"--command={setup_script(bundle, python)}"],
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


def launch(
    command: Sequence[str],
    pod: Pod,
    *,
    python: str = DEFAULT_PYTHON,
    restarts: int = 0,
    log_dir: str | None = None,
    dry_run: bool = False,
    before_shipping: Callable[[list[str]], None] | None = None,
) -> None:
    """Starts ``command`` on every worker of ``pod`` (see the module's docstring).

    Args:
      command: the words after ``--``, run in the image of the working directory.
      pod: the TPU VM or queued resource.
      python: the workers' Python version.
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
        directory, a gcloud command that failed, or ``before_shipping``'s refusal.
    """
    if not dry_run:
        check_gcloud()
    command = job_command(command, pod.slices)
    if before_shipping is not None:
        before_shipping(command)
    bundle = plan_bundle(command)
    log_dir = log_dir or default_log_dir(command)
    commands = start_commands(
        pod, bundle, command, python=python, restarts=restarts, log_dir=log_dir
    )
    print(f"# {describe_bundle(bundle)}", flush=True)
    if dry_run:
        print("\n".join(shlex.join(c) for c in commands), flush=True)
        return
    path = write_bundle(bundle, local_bundle_path(bundle))
    try:
        run_commands(commands)
    finally:
        path.unlink(missing_ok=True)
