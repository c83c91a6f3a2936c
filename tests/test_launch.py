"""`launch tpu` and `launch slurm` as their users see them: the exact commands, the
bundle a pod receives, one-line errors, and the worker supervisor run for real."""

import os
import pathlib
import shlex
import signal
import subprocess
import sys
import tarfile
import tempfile
import time

import pytest

from replicator import storage
from replicator.runtime import bundle as bundles
from replicator.runtime import (
    compiler_env,
    launch,
    launch_args,
    preflight,
    tpu,
    worker,
    worker_env,
)

ROOT = pathlib.Path(__file__).resolve().parent.parent
TRAIN = ["train", "--config", "configs/digits_cnn.py", "--workdir", "gs://bucket/run"]
THIS_PYTHON = f"{sys.version_info.major}.{sys.version_info.minor}"


def printed_commands(out: str) -> list[list[str]]:
    """The commands in launch's output, read as a shell reads them (comments dropped)."""
    commands = []
    for word in shlex.split(out, comments=True):
        if word == "gcloud":
            commands.append([])
        commands[-1].append(word)
    return commands


def script_of(command: list[str]) -> list[str]:
    """The lines of the bash script an ``ssh --command=...`` runs on the workers."""
    assert command[-1].startswith("--command=")
    script = command[-1].removeprefix("--command=")
    subprocess.run(["bash", "-n", "-c", script], check=True)  # valid bash
    return [line.strip() for line in script.splitlines()]


@pytest.fixture
def own_tmp(tmp_path, monkeypatch):
    """A temporary directory of the launcher's own, to see that a dry run writes nothing."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "launcher_tmp"))
    (tmp_path / "launcher_tmp").mkdir()
    return tmp_path / "launcher_tmp"


# ---------------------------------------------------------------- dry runs: the exact commands


def test_tpu_dry_run_on_one_slice(monkeypatch, capsys, own_tmp):
    monkeypatch.chdir(ROOT)
    where = [
        "--tpu",
        "my-pod",
        "--zone",
        "us-east5-a",
        "--project",
        "proj",
        "--python",
        THIS_PYTHON,
    ]
    assert launch.main(["tpu", *where, "--dry-run", "--", *TRAIN]) == 0
    out = capsys.readouterr().out
    digest = bundles.plan_bundle(TRAIN).digest
    bundle = f"replicator-{digest}.tar.gz"
    preflight, out = out.split("\n", 1)  # without --accelerator-type a dry run says how
    assert preflight.startswith(
        "# pre-flight: launching reads the accelerator type (gcloud compute tpus tpu-vm "
        "describe my-pod --zone=us-east5-a --project=proj '--format=value(acceleratorType)')"
    ), preflight
    assert out.startswith(f"# bundle {bundle}: ")
    env = worker_env.plan_environment(ROOT, THIS_PYTHON)
    assert f"\n# environment py{THIS_PYTHON}-{env.digest}: Python {THIS_PYTHON} (uv), " in out
    probe, scp, setup, start = printed_commands(out)
    assert scp == [
        "gcloud", "compute", "tpus", "tpu-vm", "scp", f"{own_tmp}/{bundle}", f"my-pod:{bundle}",
        "--worker=all", "--zone=us-east5-a", "--project=proj",
    ]  # fmt: skip
    ssh = ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "my-pod", "--worker=all"]
    assert probe[:-1] == setup[:-1] == start[:-1] == [*ssh, "--zone=us-east5-a", "--project=proj"]
    probe = script_of(probe)  # asked first: is the environment there, and if not, reachable?
    assert f'env="$HOME/.replicator/envs/py{THIS_PYTHON}-{env.digest}"' in probe
    assert 'need="pypi.org files.pythonhosted.org"' in probe
    setup = script_of(setup)
    for line in (
        f'bundle="$HOME/.replicator/bundles/{digest}"',
        f'env="$HOME/.replicator/envs/py{THIS_PYTHON}-{env.digest}"',  # keyed by the dependencies
        'if [ ! -d "$bundle" ]; then',  # unpacked once per bundle
        f'tar -xzf "$HOME/{bundle}" -C "$bundle.part"',
        'if [ ! -f "$env/installed" ]; then',  # installed once per dependency spec
        f'uv venv --quiet --python {THIS_PYTHON} "$env"',
        'uv pip install --quiet --python "$env/bin/python" -r "$bundle/project/pyproject.toml" '
        "--extra tpu",
        'touch "$env/installed"',
        'echo "$env" > "$bundle/env"',
    ):
        assert line in setup, line
    start = script_of(start)
    for line in (
        'if [ -f "$job/pid" ] && kill -0 -- "-$(cat "$job/pid")" 2>/dev/null; then',
        'old=$(cd "$HOME/.replicator/bundles" && ls -1t | grep -v "[.]part$" | tail -n +4)',
        "held=$(ls -d /dev/accel* /dev/vfio/* 2>/dev/null || true)",
        "sudo -n rm -f /tmp/libtpu_lockfile 2>/dev/null || rm -f /tmp/libtpu_lockfile || true",
        'export PYTHONPATH="$bundle/project"',
        'cd "$bundle/project"',  # run from the project root: configs/digits_cnn.py is there
        'setsid nohup "$env/bin/python" -m replicator.runtime.worker '
        '--pid-file "$job/pid" --log "$job/worker.log" --log-dir gs://bucket/run/launch -- '
        "train --config configs/digits_cnn.py --workdir gs://bucket/run "
        '> "$job/supervisor.out" 2>&1 < /dev/null &',
    ):
        assert line in start, line
    assert not list(own_tmp.iterdir())  # nothing written


def test_tpu_dry_run_on_two_slices(monkeypatch, capsys, own_tmp):
    monkeypatch.chdir(ROOT)
    train = ["train", "--config", "configs/lm_tiny.py", "--workdir", "gs://bucket/lm"]
    where = ["--tpu", "my-qr", "--zone", "us-east5-a", "--slices", "2", "--python", THIS_PYTHON]
    assert launch.main(["tpu", *where, "--restarts", "3", "--dry-run", "--", *train]) == 0
    probe, scp, setup, start = printed_commands(capsys.readouterr().out)
    bundle = bundles.plan_bundle(train).name
    qr = ["gcloud", "compute", "tpus", "queued-resources"]
    everywhere = ["--worker=all", "--node=all", "--zone=us-east5-a"]
    assert scp == [*qr, "scp", f"{own_tmp}/{bundle}", f"my-qr:{bundle}", *everywhere]
    assert probe[:-1] == setup[:-1] == start[:-1] == [*qr, "ssh", "my-qr", *everywhere]
    (run_line,) = [line for line in script_of(start) if line.startswith("setsid nohup")]
    job = run_line.split(" -- ", 1)[1].split(" > ", 1)[0]
    assert job == (
        "train --config configs/lm_tiny.py --workdir gs://bucket/lm "
        '"--config.dcn_mesh={\\"data\\": 2}"'
    )
    words = subprocess.run(["bash", "-c", f"printf '%s\\n' {job}"], capture_output=True, text=True)
    assert words.stdout.splitlines()[-1] == '--config.dcn_mesh={"data": 2}'  # as bash reads it
    assert "--log-dir gs://bucket/lm/launch --restarts 3 -- train" in run_line

    # A dcn_mesh of the user's own stays; logs and stop address the queued resource.
    own = [*train, "--config.dcn_mesh={'data': 2, 'fsdp': 1}"]
    assert tpu.job_command(own, slices=2) == own
    logs = ["tpu", *where, "--logs", "--worker", "3", "--slice", "1", "--dry-run"]
    assert launch.main(logs) == 0
    assert printed_commands(capsys.readouterr().out) == [
        [*qr, "ssh", "my-qr", "--worker=3", "--node=1", "--zone=us-east5-a",
         '--command=tail -n 100 -F "$HOME/.replicator/job/worker.log"'],
    ]  # fmt: skip
    assert launch.main(["tpu", *where, "--stop", "--grace", "60", "--dry-run"]) == 0
    (stop,) = printed_commands(capsys.readouterr().out)
    assert stop[:-1] == [*qr, "ssh", "my-qr", *everywhere]
    stop = script_of(stop)
    assert 'if [ -n "$group" ] && kill -TERM -- "-$group" 2>/dev/null; then' in stop
    assert 'while kill -0 -- "-$group" 2>/dev/null && [ $waited -lt 60 ]; do' in stop
    assert 'if kill -KILL -- "-$group" 2>/dev/null; then' in stop
    assert not list(own_tmp.iterdir())


def test_tpu_dry_run_runs_a_python_script(monkeypatch, capsys, own_tmp):
    monkeypatch.chdir(ROOT)
    script = ["python", "my_script.py", "--out", "gs://bucket/x y"]
    assert (
        launch.main(["tpu", "--tpu", "my-pod", "--zone", "us-east5-a", "--dry-run", "--", *script])
        == 0
    )
    (run_line,) = [
        line for line in script_of(printed_commands(capsys.readouterr().out)[3])
        if line.startswith("setsid nohup")
    ]  # fmt: skip
    # No --workdir: the log stays on each worker; the worker runs python as its own.
    assert '"$job/worker.log" -- python my_script.py --out "gs://bucket/x y" >' in run_line


# ---------------------------------------------------------------- paths a pod's workers share


def test_a_local_workdir_on_a_pod_of_several_workers_is_one_line(monkeypatch, capsys, own_tmp):
    monkeypatch.chdir(ROOT)
    local = ["train", "--config", "configs/digits_cnn.py", "--workdir", "runs/x"]
    where = ["tpu", "--tpu", "my-pod", "--zone", "us-east5-a", "--dry-run", "--no-preflight"]
    for options, command, said in [
        (["--accelerator-type", "v4-32"], local, "but the 4 workers of my-pod (v4-32) share no "
         "disk"),
        (["--slices", "2"], local, "but the 2 workers of my-pod share no disk"),
        ([], local, "and how many my-pod has is unknown here"),  # a dry run: say how to tell
        (["--accelerator-type", "v5litepod-16"], [*TRAIN, "--config.data_dir=/data/tfds"],
         "--config.data_dir /data/tfds is a local path, but the 4 workers"),
    ]:  # fmt: skip
        assert launch.main([*where, *options, "--", *command]) == 2
        captured = capsys.readouterr()
        (line,) = captured.err.splitlines()
        assert line.startswith("error: ") and said in line, line
        assert "gs:// path" in line and "--allow-local-workdir" in line, line
        assert "gcloud" not in captured.out  # refused before anything
    # One worker keeps its own disk; --allow-local-workdir runs it anyway.
    for options in (["--accelerator-type", "v4-8"], ["--slices", "2", "--allow-local-workdir"]):
        assert launch.main([*where, *options, "--", *local]) == 0
        assert "gcloud compute tpus" in capsys.readouterr().out
    assert not list(own_tmp.iterdir())


# ---------------------------------------------------------------- the pre-flight compile
# (its compile, with libtpu, is tested in tests/test_tpu_compile.py)


def test_no_preflight_ships_a_train_command_unchecked(monkeypatch, capsys, own_tmp):
    monkeypatch.chdir(ROOT)
    where = ["--tpu", "my-pod", "--zone", "us-east5-a", "--no-preflight", "--dry-run"]
    assert launch.main(["tpu", *where, "--", *TRAIN]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# bundle ") and "pre-flight" not in out


def test_a_preflight_without_libtpu_is_one_line(monkeypatch, capsys, own_tmp):
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(preflight, "have_libtpu", lambda: False)
    where = ["--tpu", "my-pod", "--zone", "us-east5-a", "--python", THIS_PYTHON, "--dry-run"]
    assert launch.main(["tpu", *where, "--accelerator-type", "v5e-16", "--", *TRAIN]) == 2
    captured = capsys.readouterr()
    (line,) = captured.err.splitlines()
    assert line.startswith("error: the pre-flight compile for v5e-16 needs libtpu here"), line
    assert "pip install -e '.[tpu]'" in line and "--no-preflight" in line
    assert "gcloud" not in captured.out  # refused before anything was shipped
    # Commands other than train have no config to compile: they go ahead.
    script = ["python", "my_script.py"]
    assert launch.main(["tpu", *where, "--accelerator-type", "v5e-16", "--", *script]) == 0


def test_the_preflight_compiles_with_the_workers_python(monkeypatch, capsys, own_tmp, tmp_path):
    """Workers on Python 3.12 (the default) run its JAX; the pre-flight compiles with the
    same, in an environment made here once. A dry run makes none and says so; the
    workers are then pinned to nothing here (the tpu extra's versions decide)."""
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert worker_env.DEFAULT_PYTHON == "3.12"
    where = ["--tpu", "my-pod", "--zone", "us-east5-a", "--accelerator-type", "v5e-16"]
    python = [] if THIS_PYTHON != "3.12" else ["--python", "3.13"]  # another Python than this
    assert launch.main(["tpu", *where, *python, "--dry-run", "--", *TRAIN]) == 0
    out = capsys.readouterr().out
    said = ("# pre-flight: compiling for v5e-16 with the workers' JAX makes its environment "
            "here first (uv, once); launching does, or `python -m replicator compile --config "
            "C --topology v5e-16 --python ")  # fmt: skip
    assert out.startswith(said), out
    assert "pinned" not in out and not (tmp_path / "cache").exists()
    # Where the workers' Python is this one's, this interpreter compiles and is pinned.
    assert preflight.compiler_for(THIS_PYTHON, make=False) == sys.executable
    # An interpreter's path on the workers: compiled here, pinned to nothing (its version,
    # and so what the tpu extra gives it, is unknown here).
    workers = "/opt/python3.12/bin/python3"
    assert preflight.compiler_for(workers, make=False) == sys.executable
    assert preflight.pins(sys.executable, workers) == () and preflight.pins(None, "3.12") == ()
    # A --python that is neither is refused before any environment is made.
    with pytest.raises(tpu.LaunchError, match="give a version"):
        preflight.compiler_for("3.12.1")
    assert not (tmp_path / "cache").exists()


def test_an_environment_that_cannot_be_made_is_one_line(monkeypatch, tmp_path):
    """A Python uv cannot find (and may not download): one line from `compile --python`,
    naming the way out; nothing is left half-made."""
    if not _has_uv():
        pytest.skip("uv is not installed (the tpu extra has it)")
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "UV_PYTHON_DOWNLOADS": "never"}
    args = [
        "compile",
        "--config",
        "configs/digits_cnn.py",
        "--topology",
        "v5e-4",
        "--python",
        "3.99",
    ]
    done = subprocess.run([sys.executable, "-m", "replicator", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.splitlines()
    assert line.startswith(
        "error: cannot make Python 3.99's environment for the compile (`uv venv"
    ), line
    assert f"or --python {THIS_PYTHON} to compile with this machine's JAX" in line, line
    assert not [p for p in (tmp_path / "cache" / "replicator" / "envs").glob("*") if p.is_dir()]


def test_another_environment_gets_no_path_into_this_one(monkeypatch):
    """What this process's libraries set for this interpreter stays here: libtpu's
    TPU_LIBRARY_PATH (another JAX would load this libtpu) and OpenCV's library folder."""
    own = os.path.join(sys.prefix, "lib", "python3", "site-packages", "cv2", "lib64")
    monkeypatch.setenv("TPU_LIBRARY_PATH", os.path.join(sys.prefix, "libtpu.so"))
    monkeypatch.setenv("LD_LIBRARY_PATH", os.pathsep.join([own, "/opt/cuda/lib64"]))
    env = compiler_env.child_environment()
    assert "TPU_LIBRARY_PATH" not in env and env["LD_LIBRARY_PATH"] == "/opt/cuda/lib64"
    monkeypatch.setenv("LD_LIBRARY_PATH", own)
    assert "LD_LIBRARY_PATH" not in compiler_env.child_environment()
    assert compiler_env.child_environment()["PATH"] == os.environ["PATH"]


def _has_uv() -> bool:
    try:
        compiler_env.uv_binary()
    except tpu.LaunchError:
        return False
    return True


def test_the_pods_accelerator_type_is_asked_of_gcloud(tmp_path, monkeypatch, fake_cloud):
    pod, queued = tpu.Pod("my-pod", "z", "proj"), tpu.Pod("my-qr", "z", slices=2)
    assert preflight.describe_command(queued) == [
        "gcloud", "compute", "tpus", "queued-resources", "describe", "my-qr", "--zone=z",
        "--format=value(tpu.nodeSpec[0].node.acceleratorType)",
    ]  # fmt: skip
    monkeypatch.setenv("FAKE_ACCELERATOR", "v5litepod-16")
    assert preflight.accelerator_type(pod) == "v5litepod-16"
    assert fake_cloud.read_text() == "compute tpus tpu-vm describe my-pod\n"  # 5 words logged
    monkeypatch.delenv("FAKE_ACCELERATOR")
    with pytest.raises(tpu.LaunchError, match="--accelerator-type, or skip"):
        preflight.accelerator_type(pod)


def test_tpu_dry_run_from_an_experiment_directory(tmp_path, monkeypatch, capsys, own_tmp):
    """A researcher's own directory: a config importing a module beside it, a virtualenv,
    runs and data. The bundle has the project (from wherever replicator is imported),
    the config and its neighbour, and nothing else of the directory."""
    experiment = tmp_path / "my_experiment"
    (experiment / "lib").mkdir(parents=True)
    (experiment / "my_config.py").write_text(
        "from helper import tweak\nfrom replicator.trainer.config import base_config\n\n"
        "def get_config(mode=''):\n    return tweak(base_config(mode))\n"
    )
    (experiment / "helper.py").write_text("def tweak(c):\n    return c\n")
    (experiment / "lib" / "__init__.py").write_text("")
    (experiment / "notes.txt").write_text("not code\n")
    for junk in (".venv/lib/site.py", "runs/a/metrics.jsonl", "data/train.py", "__pycache__/x.pyc"):
        (experiment / junk).parent.mkdir(parents=True, exist_ok=True)
        (experiment / junk).write_text("junk\n")
    before = sorted(p for p in tmp_path.rglob("*"))
    monkeypatch.chdir(experiment)
    command = ["train", "--config", "my_config.py:smoke", "--workdir", "gs://b/r"]
    assert launch.main(["tpu", "--tpu", "p", "--zone", "z", "--dry-run", "--", *command]) == 0
    out = capsys.readouterr().out
    assert sorted(p for p in tmp_path.rglob("*")) == before  # the dry run wrote nothing

    bundle = bundles.plan_bundle(command)
    assert f"# bundle {bundle.name}: " in out and "helper.py, lib/__init__.py, my_config.py" in out
    assert 'cd "$bundle/work"' in out  # the command runs in the image of this directory
    path = bundles.write_bundle(bundle, tmp_path / bundle.name)
    with tarfile.open(path) as tar:
        names = set(tar.getnames())
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    tracked = [n for n in tracked.stdout.splitlines() if (ROOT / n).is_file()]
    assert len(tracked) > 100
    assert {f"project/{n}" for n in tracked} <= names
    work = {n for n in names if not n.startswith("project/")}
    assert work == {"work", "work/my_config.py", "work/helper.py", "work/lib/__init__.py"}
    for name in names:
        assert not any(part in (".venv", "runs", "__pycache__") for part in name.split("/"))
    again = bundles.write_bundle(bundles.plan_bundle(command), tmp_path / "again.tar.gz")
    assert again.read_bytes() == path.read_bytes()  # the same files, the same bundle


def test_files_outside_the_working_directory_are_refused(tmp_path, monkeypatch, capsys):
    (tmp_path / "elsewhere.py").write_text("")
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    for config in ("../elsewhere.py", str(tmp_path / "elsewhere.py")):
        command = [
            "tpu",
            "--tpu",
            "p",
            "--zone",
            "z",
            "--dry-run",
            "--",
            "train",
            "--config",
            config,
        ]
        assert launch.main(command) == 2
        (line,) = capsys.readouterr().err.splitlines()
        assert line.startswith("error: ") and "elsewhere.py" in line


def test_slurm_dry_run_prints_the_script(capsys):
    command = ["train", "--config", "configs/digits_cnn.py", "--workdir", "runs/x"]
    assert (
        launch.main(["slurm", "--nodes", "2", "--gpus-per-node", "8", "--dry-run", "--", *command])
        == 0
    )
    script = capsys.readouterr().out
    for line in (
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=8",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --signal=TERM@120",
        "srun --kill-on-bad-exit=1 .venv/bin/python -m replicator train --config "
        "configs/digits_cnn.py --workdir runs/x",
    ):
        assert line in script.splitlines()
    script = ["python", "my_script.py", "--out", "gs://bucket/x y"]
    assert (
        launch.main(["slurm", "--nodes", "2", "--gpus-per-node", "8", "--dry-run", "--", *script])
        == 0
    )
    assert "srun --kill-on-bad-exit=1 .venv/bin/python my_script.py --out 'gs://bucket/x y'\n" in (
        capsys.readouterr().out
    )


# ---------------------------------------------------------------- one-line errors


def test_missing_programs_are_one_line_errors(tmp_path, monkeypatch, capsys, own_tmp):
    empty = tmp_path / "empty_bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    monkeypatch.chdir(tmp_path)
    where = ["--tpu", "my-pod", "--zone", "us-east5-a"]
    for argv, program in [
        (["tpu", *where, "--", *TRAIN], "gcloud"),
        (["tpu", *where, "--logs"], "gcloud"),
        (["tpu", *where, "--stop"], "gcloud"),
        (["slurm", "--nodes", "2", "--gpus-per-node", "8", "--", *TRAIN], "sbatch"),
    ]:
        assert launch.main(argv) == 2
        captured = capsys.readouterr()
        (line,) = captured.err.splitlines()
        assert line.startswith("error: ") and f"no {program} on PATH" in line, line
        assert "Traceback" not in captured.out
    assert sorted(os.listdir(tmp_path)) == ["empty_bin", "launcher_tmp"]  # no replicator.sbatch
    assert not list(own_tmp.iterdir())  # no bundle


@pytest.mark.parametrize(
    "argv, said",
    [
        (["local", "--processes", "0", "--", "python", "-c", "pass"], "--processes 0: give 1"),
        (["local", "--processes", "2", "--devices-per-process", "0", "--", "sh"],
         "--devices-per-process 0: give 1"),
        (["local", "--processes", "2", "--restarts", "-1", "--", "sh"], "--restarts -1: give 0"),
        (["local", "--processes", "2", "--gcs-dir", "d", "--", "sh"], "go with --gcs"),
        (["local", "--processes", "2"], "give the command after --"),
        (["local", "--processes", "two", "--", "sh"], "invalid int value: 'two'"),
        (["local", "--", "sh"], "the following arguments are required: --processes"),
        (["local", "--processes", "2", "--gcs", "--", "no-such-program"], "no such program"),
        (["tpu", "--tpu", "p", "--zone", "z", "--slices", "0", "--", "sh"], "--slices 0: give 1"),
        (["tpu", "--tpu", "p", "--zone", "z", "--keep-bundles", "0", "--dry-run", "--", "sh"],
         "--keep-bundles 0: give 1"),
        (["tpu", "--tpu", "p", "--zone", "z", "--logs", "--", "sh"], "take no command"),
        (["slurm", "--nodes", "0", "--gpus-per-node", "8", "--dry-run", "--", "sh"],
         "--nodes 0: give 1"),
        (["slurm", "--nodes", "1", "--gpus-per-node", "0", "--dry-run", "--", "sh"],
         "--gpus-per-node 0: give 1"),
    ],
)  # fmt: skip
def test_arguments_that_cannot_launch_are_one_line_before_anything_starts(
    argv, said, tmp_path, monkeypatch, capsys, own_tmp
):
    """Exit status 2 and one line, never a run of nothing (0 processes exited 0) or a
    script for 0 nodes; nothing started or written (no GCS server, no bundle, no sbatch
    file, no process: a process would print)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # --gcs' server would go here
    assert launch.main(argv) == 2
    captured = capsys.readouterr()
    (line,) = captured.err.splitlines()
    assert line.startswith("error: ") and said in line, line
    assert captured.out == ""
    assert sorted(os.listdir(tmp_path)) == ["launcher_tmp"] and not list(own_tmp.iterdir())


def test_launch_local_of_no_processes_is_refused():
    with pytest.raises(tpu.LaunchError, match=r"processes \(0\) .* must be 1 or more"):
        launch.launch_local(["python", "-c", "pass"], processes=0, devices_per_process=1)


FAKE_GCLOUD = """#!{python}
# gcloud for tests: a pod of one worker, this machine, whose home is FAKE_WORKER_HOME.
import os, shutil, subprocess, sys
args = sys.argv[1:]
with open(os.environ["FAKE_CALLS"], "a") as f:
    f.write(" ".join(args[:5]) + "\\n")
if args[:2] == ["auth", "list"]:
    print(os.environ.get("FAKE_ACCOUNT", ""))
    sys.exit(0)
home = os.environ["FAKE_WORKER_HOME"]
if args[3] == "describe":  # the pod's accelerator type, when the test gives one
    print(os.environ.get("FAKE_ACCELERATOR", ""))
    sys.exit(0 if os.environ.get("FAKE_ACCELERATOR") else 1)
if args[3] == "scp":
    shutil.copy(args[4], os.path.join(home, args[5].split(":", 1)[1]))
    sys.exit(0)
(script,) = [a[len("--command="):] for a in args if a.startswith("--command=")]
if "replicator-probe" in script and "FAKE_PROBE_OUTPUT" in os.environ:  # a pod's answers
    print(os.environ["FAKE_PROBE_OUTPUT"])
    sys.exit(0)
sys.exit(subprocess.run(["bash", "-c", script], env={{**os.environ, "HOME": home}}).returncode)
"""

# uv for tests: a "virtualenv" that is this one (no download, no install).
FAKE_UV = """#!/bin/sh
echo "uv $*" >> "$FAKE_CALLS"
if [ "$1 $2" = "python find" ]; then
  [ -z "$FAKE_NO_PYTHON" ]; exit
fi
if [ "$1" = venv ]; then
  for venv; do :; done
  mkdir -p "$venv/bin" && cp "{prefix}/pyvenv.cfg" "$venv/"
  ln -s "{prefix}/bin/python" "$venv/bin/python" && ln -s "{prefix}/lib" "$venv/lib"
fi
"""


# curl for tests: every host answers but those in FAKE_UNREACHABLE (a worker without NAT).
FAKE_CURL = """#!/bin/sh
for url; do :; done
host=${url#https://}; host=${host%%/*}
case " $FAKE_UNREACHABLE " in *" $host "*) exit 7;; esac
"""


@pytest.fixture
def fake_cloud(tmp_path, monkeypatch):
    """gcloud, uv and curl on PATH that run everything on this machine; returns the calls
    file."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (
        ("gcloud", FAKE_GCLOUD.format(python=sys.executable)),
        ("uv", FAKE_UV.format(prefix=sys.prefix)),
        ("curl", FAKE_CURL),
    ):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    (tmp_path / "worker_home").mkdir()
    calls = tmp_path / "calls.txt"
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_CALLS", str(calls))
    monkeypatch.setenv("FAKE_WORKER_HOME", str(tmp_path / "worker_home"))
    return calls


def test_gcloud_without_an_account_is_a_one_line_error(tmp_path, fake_cloud, own_tmp):
    cli = [sys.executable, "-m", "replicator", "launch", "tpu", "--tpu", "p", "--zone", "z"]
    env = {**os.environ, "TMPDIR": str(own_tmp)}
    done = subprocess.run(
        [*cli, "--", *TRAIN], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [
        "error: gcloud has no active account: run `gcloud auth login` (or `gcloud auth "
        "activate-service-account`) first."
    ]
    assert fake_cloud.read_text() == "auth list --filter=status:ACTIVE --format=value(account)\n"
    assert not list(own_tmp.iterdir()) and not list((tmp_path / "worker_home").iterdir())


# ---------------------------------------------------------------- the workers' environment


def test_workers_that_cannot_reach_pypi_are_refused_in_one_line(
    monkeypatch, capsys, fake_cloud, own_tmp
):
    """Internal IP addresses only, no Cloud NAT: the probe's answers (four workers, as
    gcloud prints them) name what is missing, and nothing is copied."""
    monkeypatch.setenv("FAKE_ACCOUNT", "me@example.com")
    monkeypatch.chdir(ROOT)
    cut_off = "env=no python=download uv=no unreachable=files.pythonhosted.org,github.com,pypi.org"
    answers = [f"replicator-probe host=t1v-w-{i} {cut_off}" for i in range(3)]
    answers += ["replicator-probe host=t1v-w-3 env=yes"]
    monkeypatch.setenv("FAKE_PROBE_OUTPUT", "\n".join(["Using ssh batch size of 4.", *answers]))
    where = ["tpu", "--tpu", "my-pod", "--zone", "z", "--python", THIS_PYTHON, "--no-preflight"]
    assert launch.main([*where, "--", *TRAIN]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line == (
        "error: 3 of 4 workers (t1v-w-0, t1v-w-1 ...) of my-pod cannot reach "
        "files.pythonhosted.org, pypi.org (PyPI: the packages, uv) and github.com (uv's "
        f"CPython {THIS_PYTHON}) to install the environment: give their network a way out "
        "(Cloud NAT), "
        "or bring what they need: --wheels (the packages, downloaded here and shipped) with "
        "--python PATH (an interpreter installed on every worker)"
    )
    calls = fake_cloud.read_text().splitlines()
    assert calls[1:] == ["compute tpus tpu-vm ssh my-pod"]  # the probe only: no scp
    assert not list(own_tmp.iterdir())


def test_the_probe_on_a_worker_says_what_it_lacks(tmp_path, monkeypatch, capsys, fake_cloud):
    """The probe itself, on a worker (this machine) whose curl reaches nothing."""
    monkeypatch.setenv("FAKE_ACCOUNT", "me@example.com")
    monkeypatch.setenv("FAKE_UNREACHABLE", "pypi.org files.pythonhosted.org github.com")
    monkeypatch.setenv("FAKE_NO_PYTHON", "1")  # uv finds no CPython 3.42
    monkeypatch.chdir(tmp_path)
    where = ["tpu", "--tpu", "p", "--zone", "z"]
    for options, said in [
        (["--python", "3.42"], "cannot reach files.pythonhosted.org, pypi.org (PyPI: the "
         "packages, uv) and github.com (uv's CPython 3.42)"),
        (["--python", "3.42", "--wheels"], "cannot reach github.com (uv's CPython 3.42) to "
         "install the environment: give their network a way out (Cloud NAT), or bring what "
         "they need: --python PATH"),
        (["--python", "/no/python3"], "--python /no/python3: 1 of 1 workers"),
        (["--python", sys.executable], "cannot reach files.pythonhosted.org, pypi.org"),
    ]:  # fmt: skip
        assert launch.main([*where, *options, "--", "python", "job.py"]) == 2
        (line,) = capsys.readouterr().err.splitlines()
        assert said in line, line
    assert "no such interpreter there" in launch_error([*where, "--python", "/no/python3"])
    assert not list((tmp_path / "worker_home").iterdir())  # nothing copied, nothing installed


def launch_error(argv):
    with pytest.raises(tpu.LaunchError) as e:
        launch._launch_tpu(
            launch_args.parse([*argv, "--", "python", "job.py"])[0], ["python", "job.py"]
        )
    return str(e.value)


def write_hello(directory: pathlib.Path, text: str) -> list[str]:
    directory.mkdir(exist_ok=True)
    (directory / "hello.py").write_text(f"print({text!r}, flush=True)\n")
    return ["python", "hello.py"]


def wait_for_job(home: pathlib.Path, text: str) -> None:
    log = home / ".replicator" / "job" / "worker.log"
    ended = "the command exited with status 0"  # this run's: an old log has another text
    wait_for(lambda: log.is_file() and all(t in log.read_text() for t in (text, ended)))


def test_wheels_and_a_preinstalled_python_need_no_internet(
    tmp_path, monkeypatch, capfd, fake_cloud, own_tmp
):
    """--wheels --python PATH on a worker that reaches nothing: the wheels are downloaded
    here for the workers' Python (the probe's answer), shipped, installed offline, then
    removed; a second launch finds the environment and ships no wheels."""
    monkeypatch.setenv("FAKE_ACCOUNT", "me@example.com")
    monkeypatch.setenv("FAKE_UNREACHABLE", "pypi.org files.pythonhosted.org github.com")
    home = tmp_path / "worker_home"
    downloads = []

    def download_wheels(env, version):
        downloads.append(version)
        (tmp_path / "wheels").mkdir(exist_ok=True)
        for name in ("uv-0.9-py3-none-any.whl", "jax-0.10.2-py3-none-any.whl"):
            (tmp_path / "wheels" / name).write_text("")
        return tmp_path / "wheels"

    monkeypatch.setattr(worker_env, "download_wheels", download_wheels)
    command = write_hello(tmp_path / "experiment", "hello offline")
    monkeypatch.chdir(tmp_path / "experiment")
    where = ["tpu", "--tpu", "p", "--zone", "z", "--wheels", "--python", sys.executable]
    assert launch.main([*where, "--", *command]) == 0
    wait_for_job(home, "hello offline")
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    assert downloads == [version]  # for the Python the workers have
    # (an interpreter's path: its version unknown here, so nothing of this machine pinned)
    env = worker_env.plan_environment(ROOT, sys.executable, wheels=True, pins=())
    env_dir, wheels = (f"{home}/.replicator/{kind}/{env.name}" for kind in ("envs", "wheels"))
    calls = fake_cloud.read_text().splitlines()
    assert f"uv venv --quiet --python {sys.executable} {env_dir}" in calls
    assert (
        f"uv pip install --quiet --offline --no-index --find-links {wheels} --python "
        f"{env_dir}/bin/python -r {home}/.replicator/bundles/"
    ) in "\n".join(calls)
    assert [c.split()[:4] for c in calls if " scp " in f" {c} "] == [
        ["compute", "tpus", "tpu-vm", "scp"]
    ] * 2  # the bundle and the wheels
    assert not os.path.exists(wheels) and not list(home.glob("*.tar*"))  # installed: gone
    assert not list(own_tmp.iterdir())

    fake_cloud.write_text("")
    capfd.readouterr()
    assert launch.main([*where, "--", *command]) == 0
    assert "# 1 of 1 workers have environment " in capfd.readouterr().out
    calls = fake_cloud.read_text().splitlines()
    assert sum(" scp " in f" {c} " for c in calls) == 1 and not any("uv" in c for c in calls)
    assert downloads == [version]
    wait_for_job(home, "hello offline")


def test_wheels_dry_run_prints_the_download_and_the_offline_install(monkeypatch, capsys, own_tmp):
    monkeypatch.chdir(ROOT)
    where = ["tpu", "--tpu", "my-pod", "--zone", "z", "--python", THIS_PYTHON, "--wheels"]
    assert launch.main([*where, "--dry-run", "--no-preflight", "--", *TRAIN]) == 0
    out = capsys.readouterr().out
    env = worker_env.plan_environment(ROOT, THIS_PYTHON, wheels=True)
    (download,) = [line for line in out.splitlines() if "pip download" in line]
    for word in (
        "--platform=manylinux_2_35_x86_64",
        "--platform=manylinux2014_x86_64",
        f"--python-version={THIS_PYTHON}",
        "--only-binary=:all:",
        "uv",
    ):
        assert word in download.split(), word
    probe, scp, wheels, setup, _ = printed_commands(out)
    assert wheels[5:7] == [f"{own_tmp}/{env.wheelhouse}", f"my-pod:{env.wheelhouse}"]
    assert "pypi.org" not in "\n".join(script_of(probe))  # the wheels bring uv and packages
    setup = script_of(setup)
    for line in (
        f'tar -xf "$HOME/{env.wheelhouse}" -C "$wheels"',
        'python3 -m zipfile -e "$1" "$wheels/.uv"',  # uv from its wheel, where there is none
        'uv pip install --quiet --offline --no-index --find-links "$wheels" --python '
        '"$env/bin/python" -r "$bundle/project/pyproject.toml" --extra tpu',
        f'rm -rf "$HOME/{env.wheelhouse}" "$HOME/.replicator/wheels/{env.name}"',
    ):
        assert line in setup, line
    assert not list(own_tmp.iterdir())


def test_a_code_edit_reuses_the_environment_and_old_bundles_go(
    tmp_path, monkeypatch, capfd, fake_cloud, own_tmp
):
    """The environment is keyed by the dependency spec: two code edits, two bundles, one
    install; each worker keeps the newest --keep-bundles bundles, and an environment no
    kept bundle uses goes with them."""
    monkeypatch.setenv("FAKE_ACCOUNT", "me@example.com")
    home = tmp_path / "worker_home"
    monkeypatch.chdir(tmp_path)
    where = ["tpu", "--tpu", "p", "--zone", "z", "--keep-bundles", "1"]
    digests = []
    for edit in range(2):
        command = write_hello(tmp_path / "experiment", f"edit {edit}")
        monkeypatch.chdir(tmp_path / "experiment")
        assert launch.main([*where, "--", *command]) == 0
        wait_for_job(home, f"edit {edit}")
        digests.append(bundles.plan_bundle(command).digest)
    assert len(set(digests)) == 2
    installs = [c for c in fake_cloud.read_text().splitlines() if c.startswith("uv pip install")]
    assert len(installs) == 1  # one dependency spec, one install
    assert sorted(os.listdir(home / ".replicator" / "bundles")) == sorted(digests[1:])
    assert f"removed bundle {digests[0]}" in capfd.readouterr().out
    (first_env,) = os.listdir(home / ".replicator" / "envs")

    # New dependencies: a new environment; once no kept bundle uses the old one, it goes.
    spec = worker_env.dependency_spec
    monkeypatch.setattr(worker_env, "dependency_spec", lambda p: (*spec(p), "einops"))
    command = write_hello(tmp_path / "experiment", "new dependencies")
    assert launch.main([*where, "--", *command]) == 0
    wait_for_job(home, "new dependencies")
    installs = [c for c in fake_cloud.read_text().splitlines() if c.startswith("uv pip install")]
    assert len(installs) == 2
    (env,) = os.listdir(home / ".replicator" / "envs")
    assert env != first_env and f"removed environment {first_env}" in capfd.readouterr().out
    assert os.listdir(home / ".replicator" / "bundles") == [bundles.plan_bundle(command).digest]


# ---------------------------------------------------------------- the worker supervisor, for real


JOB = """import signal, sys, time
from helper import greeting  # a module beside the script: shipped with it

def stop(signum, frame):
    print("job: SIGTERM, saving a checkpoint", flush=True)
    sys.exit(0)

signal.signal(signal.SIGTERM, stop)
print(greeting(), "in", __import__("os").getcwd(), flush=True)
while True:
    time.sleep(0.1)
"""


def wait_for(predicate, timeout_s=90.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


def test_launch_tpu_starts_a_detached_job_that_stop_ends(
    tmp_path, monkeypatch, capfd, fake_cloud, own_tmp
):
    """The real (not dry) path on a pod of one worker, this machine: the bundle is
    copied, unpacked and installed once, the job outlives the launcher, its output
    reaches the worker's log and the workdir, a second start is refused, and stop
    ends it with SIGTERM and frees the TPU."""
    monkeypatch.setenv("FAKE_ACCOUNT", "me@example.com")
    monkeypatch.setenv("FAKE_ACCELERATOR", "v4-8")  # one worker: a local workdir is its own
    monkeypatch.setattr(tpu, "TPU_DEVICES", str(tmp_path / "accel*"))
    lockfile = tmp_path / "libtpu_lockfile"
    monkeypatch.setattr(tpu, "TPU_LOCKFILE", str(lockfile))
    experiment = tmp_path / "experiment"
    experiment.mkdir()
    (experiment / "job.py").write_text(JOB)
    (experiment / "helper.py").write_text("def greeting():\n    return 'job: hello'\n")
    monkeypatch.chdir(experiment)
    workdir = tmp_path / "workdir"
    command = ["python", "job.py", "--workdir", str(workdir)]
    where = ["tpu", "--tpu", "fake-pod", "--zone", "z", "--python", THIS_PYTHON]
    job_dir = tmp_path / "worker_home" / ".replicator" / "job"
    try:
        lockfile.write_text("")
        assert launch.main([*where, "--", *command]) == 0
        assert "started, process group" in capfd.readouterr().out
        wait_for(lambda: "job: hello" in (job_dir / "worker.log").read_text())
        group = int((job_dir / "pid").read_text())
        os.killpg(group, 0)  # running, after the launcher returned
        assert not lockfile.exists()  # the TPU was freed before the start
        assert not list(own_tmp.iterdir())  # the local tarball is gone

        digest = bundles.plan_bundle(command).digest
        assert f"job: hello in {tmp_path}/worker_home/.replicator/bundles/{digest}/work" in (
            (job_dir / "worker.log").read_text()
        )
        assert launch.main([*where, "--", *command]) == 2  # one job at a time
        assert "runs a job (process group" in capfd.readouterr().err
        installs = [c for c in fake_cloud.read_text().splitlines() if c.startswith("uv pip")]
        assert len(installs) == 1  # the same bundle again installs nothing

        lockfile.write_text("")
        assert launch.main([*where, "--stop", "--grace", "30"]) == 0
        assert "stopped" in capfd.readouterr().out
        with pytest.raises(ProcessLookupError):
            os.killpg(group, 0)
        assert not (job_dir / "pid").exists() and not lockfile.exists()
        log = (job_dir / "worker.log").read_text()
        assert "job: SIGTERM, saving a checkpoint" in log
        assert "the command exited with status 0" in log and "restart" not in log
        (mirrored,) = (workdir / "launch").glob("*.log")
        assert mirrored.read_text() == log
    finally:
        _kill_the_job(job_dir / "pid")


def _kill_the_job(pid_file: pathlib.Path) -> None:
    try:
        os.killpg(int(pid_file.read_text()), signal.SIGKILL)
    except (OSError, ValueError):
        pass


FAIL_TWICE = """import pathlib, sys
runs = pathlib.Path(sys.argv[1])
runs.write_text(runs.read_text() + "x" if runs.exists() else "x")
print("attempt", len(runs.read_text()), flush=True)
sys.exit(0 if len(runs.read_text()) >= 3 else 3)
"""


def test_the_worker_restarts_a_failed_command(tmp_path):
    (tmp_path / "fail_twice.py").write_text(FAIL_TWICE)
    supervisor = [sys.executable, "-m", "replicator.runtime.worker", "--restart-delay", "0"]

    def supervise(restarts, name):
        files = ["--pid-file", str(tmp_path / "pid"), "--log", str(tmp_path / f"{name}.log")]
        mirror = ["--log-dir", str(tmp_path / "workdir" / "launch"), "--name", name]
        counter = str(tmp_path / f"{name}.count")
        argv = [*supervisor, *files, *mirror, "--restarts", str(restarts)]
        argv += ["--", "python", "fail_twice.py", counter]
        return subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=120)

    done = supervise(restarts=2, name="enough")
    assert done.returncode == 0, done.stderr
    log = (tmp_path / "workdir" / "launch" / "enough.log").read_text()
    for line in ("attempt 1", "restart 1 of 2", "attempt 2", "restart 2 of 2", "attempt 3"):
        assert line in log
    assert log.count("running ") == 3 and not (tmp_path / "pid").exists()

    done = supervise(restarts=1, name="too_few")
    assert done.returncode == 3
    log = (tmp_path / "too_few.log").read_text()
    assert "restart 1 of 1" in log and "attempt 2" in log and "attempt 3" not in log


def test_the_worker_mirrors_its_log_to_a_bucket(tmp_path, bucket):
    argv = [sys.executable, "-m", "replicator.runtime.worker", "--pid-file", str(tmp_path / "pid")]
    argv += ["--log", str(tmp_path / "worker.log"), "--log-dir", f"{bucket}/run/launch"]
    argv += ["--name", "worker-0", "--", "python", "-c", "print('to the bucket')"]
    done = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    remote = storage.read_text(f"{bucket}/run/launch/worker-0.log")
    assert "to the bucket" in remote and remote == (tmp_path / "worker.log").read_text()


def test_worker_name_off_a_tpu_vm_is_the_host_name(monkeypatch):
    monkeypatch.delenv("MEGASCALE_NUM_SLICES", raising=False)
    monkeypatch.setattr(worker, "tpu_metadata", lambda key, timeout_s=5.0: None)
    assert worker.worker_name() == __import__("socket").gethostname()
    metadata = {"agent-worker-number": "3", "tpu-env": "MEGASCALE_NUM_SLICES: '2'\nX: 'y'"}
    monkeypatch.setattr(worker, "tpu_metadata", lambda key, timeout_s=5.0: metadata.get(key))
    monkeypatch.setenv("MEGASCALE_SLICE_ID", "1")
    assert worker.worker_name() == "slice-1-worker-3"
    metadata["tpu-env"] = "MEGASCALE_NUM_SLICES: '1'"
    assert worker.worker_name() == "worker-3"


def test_without_git_the_source_tree_is_walked(monkeypatch):
    with_git = bundles.project_files(ROOT)
    monkeypatch.setenv("PATH", "")
    walked = bundles.project_files(ROOT)
    hidden = [n for n in with_git if any(d.startswith(".") for d in n.split("/")[:-1])]
    assert walked == [n for n in with_git if n not in hidden]
    assert "replicator/runtime/tpu.py" in walked and "pyproject.toml" in walked


def test_launch_local_drops_the_libraries_start_up_notices(capsys):
    import io

    from replicator.runtime import local_processes

    out = (
        "[Gloo] Rank 0[Gloo] Rank 1 is connected to 1 peer ranks. Expected number of "
        "connected peer ranks is : 1\n"
        " is connected to 1 peer ranks. Expected number of connected peer ranks is : 1\n"
        "W1124 20:39:19.760211   23914 coordination_service.cc:185] [1161] Using "
        "experimental recoverable task feature. The default shutdown barrier ...\n"
        "step 3 loss 0.5\n"
    )
    local_processes._prefix_lines(io.StringIO(out), "[1] ")
    assert capsys.readouterr().out == "[1] step 3 loss 0.5\n"


def test_python_x_y_is_found_past_a_pyenv_shim_that_does_not_run(tmp_path, monkeypatch):
    """`compile --python 3.12` hands uv an interpreter that runs: a shim of an inactive
    pyenv version first on PATH exits 127 (uv, stopping at it, would look for a download);
    pyenv's own copy of that version is found instead."""
    from replicator.runtime import compiler_env

    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    shims, real = tmp_path / "shims", tmp_path / "pyenv" / "versions" / f"{version}.9" / "bin"
    shims.mkdir()
    real.mkdir(parents=True)
    shim = shims / f"python{version}"
    shim.write_text("#!/bin/sh\necho 'pyenv: python: command not found' >&2\nexit 127\n")
    shim.chmod(0o755)
    (real / f"python{version}").symlink_to(sys.executable)
    monkeypatch.setenv("PATH", str(shims))
    monkeypatch.setenv("PYENV_ROOT", str(tmp_path / "pyenv"))
    assert compiler_env.find_interpreter(version) == str(real / f"python{version}")
    assert compiler_env.find_interpreter("3.1") == "3.1"  # none: uv finds or downloads it
    assert compiler_env.find_interpreter("/opt/py/bin/python3") == "/opt/py/bin/python3"
