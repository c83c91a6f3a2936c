"""The pre-flight of ``launch tpu``: a train command's config compiled here for the pod.

Before a ``train`` command ships, `check_fit` runs ``python -m replicator compile``
on this machine for the pod's accelerator type (given with ``--accelerator-type``,
or asked of gcloud: `accelerator_type`) and its slices: libtpu compiles the run's
steps, no TPU needed, and a run that does not fit a chip's HBM is refused in one
line, before anything is copied. The compile's report stays in `workdir_for`.
A subprocess, so the launcher imports no JAX and the run's config resolves as
``train`` resolves it; other commands have no config to compile and go ahead.

It needs the config and the topology only: the compile reads the example's shapes
from the dataset's metadata (`replicator.trainer.data.metadata`), never the data, so
a ``gs://`` data_dir is not opened and a laptop without the bucket's credentials
checks the run all the same. It compiles with the workers' JAX: their Python's
newest (`replicator.runtime.compiler_env`, an environment made here once), or this
machine's where the workers' Python is this one's or a path on the workers; and the
workers install what it compiled with (jax, jaxlib, libtpu: `pins`).
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import shlex
import shutil
import subprocess
import sys
from collections.abc import Sequence

from replicator.errors import LaunchError
from replicator.runtime import compiler_env, worker_env
from replicator.runtime.tpu import Pod


def compile_command(
    command: Sequence[str],
    accelerator: str,
    slices: int,
    workdir: str,
    python: str = sys.executable,
) -> list[str] | None:
    """``python -m replicator compile`` of a ``train`` command's config (its ``--config``
    and ``--config.KEY=VALUE`` words) for ``slices`` slices of ``accelerator``; None
    for any other command.

    >>> train = ["train", "--config", "c.py", "--config.batch_size=8", "--workdir", "gs://b/r"]
    >>> shlex.join(compile_command(train, "v4-8", 1, "/w", python="py")[3:8])
    'compile --config c.py --config.batch_size=8 --topology'
    >>> compile_command(train, "v4-8", 1, "/w")[8:]
    ['v4-8', '--slices', '1', '--workdir', '/w', '--steps=train,eval']
    """
    words = list(command)
    if words[:1] != ["train"]:
        return None
    kept, i = [], 1
    while i < len(words):
        name = words[i].split("=", 1)[0]
        if name == "--config" or name.startswith("--config."):
            kept.append(words[i])
            if "=" not in words[i] and i + 1 < len(words):  # --config FILE, --config.KEY VALUE
                kept.append(words[i + 1])
                i += 1
        elif name in ("--debug", "--verbose"):
            kept.append(words[i])
        i += 1
    where = ["--topology", accelerator, "--slices", str(slices), "--workdir", workdir]
    where.append("--steps=train,eval")  # what a training run runs (not the decode step)
    return [python, "-m", "replicator", "compile", *kept, *where]


def describe_command(pod: Pod) -> list[str]:
    """The gcloud command that prints the pod's accelerator type (e.g. ``v5litepod-16``)."""
    if pod.slices > 1:
        base = ["gcloud", "compute", "tpus", "queued-resources", "describe", pod.name]
        field = "value(tpu.nodeSpec[0].node.acceleratorType)"
    else:
        base = ["gcloud", "compute", "tpus", "tpu-vm", "describe", pod.name]
        field = "value(acceleratorType)"
    project = [f"--project={pod.project}"] if pod.project else []
    return [*base, f"--zone={pod.zone}", *project, f"--format={field}"]


def accelerator_type(pod: Pod) -> str:
    """The pod's accelerator type, asked of gcloud.

    Raises:
      LaunchError: gcloud cannot say (no such TPU, no permission).
    """
    describe = describe_command(pod)
    print(shlex.join(describe), flush=True)
    try:
        done = subprocess.run(describe, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.SubprocessError) as e:
        raise LaunchError(f"`{shlex.join(describe[:6])}` failed: {e}") from e
    name = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    if done.returncode != 0 or not name:
        reason = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "no answer"
        raise LaunchError(
            f"cannot read the accelerator type of {pod.name} ({reason}); give it with "
            "--accelerator-type, or skip the pre-flight compile with --no-preflight"
        )
    return name


def compiler_for(python: str, *, make: bool = True) -> str | None:
    """The interpreter that compiles the pre-flight for workers running ``python``: the
    one of its environment here (`compiler_env.interpreter`: made if missing and
    ``make``, else None), or this one where ``python`` is this one's version or an
    interpreter's path on the workers (its version unknown here).

    Raises:
      LaunchError: ``python`` is no version; the environment cannot be made.
    """
    if python.startswith("/"):
        return sys.executable
    advice = f"--python {compiler_env.THIS_PYTHON} (the workers too), or --no-preflight"
    return compiler_env.interpreter(python, make=make, advice=advice)


def pins(compiler: str | None, python: str) -> tuple[str, ...]:
    """What workers running ``python`` pin: the jax, jaxlib and libtpu of the pre-flight's
    interpreter; () with none made (no pre-flight), or for an interpreter's path on the
    workers, whose version is unknown here (the ``tpu`` extra's versions decide)."""
    if compiler is None or python.startswith("/"):
        return ()
    return compiler_env.pins(compiler)


def have_libtpu() -> bool:
    """Whether libtpu, the TPU compiler the pre-flight needs, is installed here."""
    return importlib.util.find_spec("libtpu") is not None


def workdir_for(pod: Pod) -> str:
    """Where the pre-flight compile for ``pod`` keeps its report and HLO:
    ``$XDG_CACHE_HOME/replicator/preflight/NAME`` (``~/.cache`` by default)."""
    return str(worker_env.cache_dir("preflight", pod.name))


def check_fit(
    command: Sequence[str],
    pod: Pod,
    accelerator: str | None = None,
    *,
    python: str | None = sys.executable,
    asked: str | None = None,
    dry_run: bool = False,
) -> None:
    """Compiles a ``train`` command's config here for the pod (`compile_command`) and
    refuses a run that does not fit; other commands go ahead unchecked.

    Args:
      command: the job's command (`replicator.runtime.tpu.job_command`'s).
      pod: the TPU VM or queued resource; its slices are compiled for.
      accelerator: its accelerator type; None asks gcloud (`accelerator_type`), except
        in a dry run, which then says how to compile here and goes on.
      python: the interpreter that compiles (`compiler_for`); None in a dry run whose
        environment is not made yet, which says so and goes on.
      asked: the workers' ``--python`` it compiles for (said in the printed command).
      dry_run: no gcloud.

    Raises:
      LaunchError: the run does not fit, the compile failed, or libtpu is not here.
    """
    if list(command[:1]) != ["train"]:
        return
    if accelerator is None:
        if dry_run:
            describe = shlex.join(describe_command(pod))
            print(
                f"# pre-flight: launching reads the accelerator type ({describe}) and compiles "
                "the config for it; give --accelerator-type to compile now",
                flush=True,
            )
            return
        accelerator = accelerator_type(pod)
    if python is None:
        print(
            f"# pre-flight: compiling for {accelerator} with the workers' JAX makes its "
            "environment here first (uv, once); launching does, or `python -m replicator "
            f"compile --config C --topology {accelerator} --python {asked or 'X.Y'}` "
            "(then a dry run compiles too)",
            flush=True,
        )
        return
    here = python == sys.executable
    if not (have_libtpu() if here else compiler_env.pins(python)):
        raise LaunchError(
            f"the pre-flight compile for {accelerator} needs libtpu here, which is not "
            "installed: pip install -e '.[tpu]', or skip the check with --no-preflight"
        )
    workdir = workdir_for(pod)
    shutil.rmtree(workdir, ignore_errors=True)  # an earlier pre-flight's report says nothing now
    compile_words = compile_command(command, accelerator, pod.slices, workdir, python)
    shown = ["python", *compile_words[1:], *([] if here else ["--python", asked or python])]
    print(f"# pre-flight: {shlex.join(shown)}", flush=True)
    code = compiler_env.run(python, compile_words[3:], asked=asked or python)
    reports = sorted(pathlib.Path(workdir).glob("compile*/report.json"))  # keyed by overrides
    fits = json.loads(reports[0].read_text())["fits"] if reports else None
    if code == 0:
        print(f"# pre-flight: {_checked(reports)}", flush=True)
        return
    if fits is False:
        raise LaunchError(
            f"the run does not fit {accelerator} (the pre-flight compile above): shrink what a "
            "chip holds (docs/pods.md), or skip the check with --no-preflight"
        )
    raise LaunchError(
        f"the pre-flight compile for {accelerator} failed (exit status {code}, above); fix "
        "it, or skip the check with --no-preflight"
    )


def _checked(reports: list[pathlib.Path]) -> str:
    """What the pre-flight checked: the steps' fit, from what shapes, by which compiler
    (the workers install the same: `replicator.runtime.worker_env.compiler_pins`)."""
    if not reports:
        return "the run fits"
    report = json.loads(reports[0].read_text())
    versions = ", ".join(f"{k} {v}" for k, v in report.get("versions", {}).items())
    shapes = report.get("shapes") or "shapes from the data"
    size, unit = report["memory_per_chip_bytes"] / 2**30, "GiB"
    if size < 0.1:
        size, unit = size * 1024, "MiB"
    return f"fits ({size:.3g} {unit} per chip); {shapes}; compiled by {versions}"
