"""The bundle ``launch tpu`` ships: the project's files and the experiment's, as one
tarball named by the hash of its contents.

`plan_bundle` decides what goes in: the project's files (`project_files`: git's view
of the source tree the ``replicator`` package comes from, whatever the working
directory) and the experiment files the command names (`experiment_files`: a
config or a script and the Python files beside it) at their paths relative to the
working directory, so that the command runs unchanged on every worker.
`write_bundle` writes it, byte for byte the same for the same files. On a worker
it is unpacked into `Bundle.remote_dir`; which Python environment runs it is
`replicator.runtime.worker_env`'s business, not the bundle's (a code edit makes a
new bundle, never a new environment).
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import io
import os
import pathlib
import subprocess
import tarfile
import tempfile
from collections.abc import Iterator, Sequence

from replicator.errors import LaunchError

# On every worker ($HOME is the worker's): the unpacked bundles, by content hash.
BUNDLES = "$HOME/.replicator/bundles"
# Directories that hold no code of the project: never shipped unless a Python package.
NON_CODE_DIRS = frozenset(
    {".venv", "venv", "env", "runs", "data", "datasets", "tensorflow_datasets",
     "checkpoints", "wandb", "build", "dist", "node_modules"}
)  # fmt: skip
_BUNDLE_MTIME = 1_577_836_800  # 2020-01-01: the same contents give the same tarball


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


def local_bundle_path(bundle: Bundle) -> str:
    """Where the launcher writes the tarball before copying it (and removes it after)."""
    return os.path.join(tempfile.gettempdir(), bundle.name)
