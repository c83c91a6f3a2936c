"""Multi-process runs on one machine: 2 processes x 4 devices behave like 1 x 8."""

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from replicator import launch
from replicator.mesh import ProcessGroup, detect_process_group
from tests.test_train import read_records

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = [
    "--config",
    "configs/digits_cnn.py",
    "--config.num_train_steps=30",
    "--config.batch_size=64",
    "--config.eval_every_steps=15",
    "--config.checkpoint_every_steps=15",
    "--config.log_every_steps=5",
    "--quiet",
]


def replicator_cmd(*args):
    return [sys.executable, "-m", "replicator", *args]


def run(cmd, env=None, timeout=300):
    env = {**os.environ, **(env or {})}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def start_until_training(cmd, workdir):
    """Starts ``cmd`` and returns once it has written its first metrics."""
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    deadline = time.monotonic() + 120
    while not (workdir / "metrics.jsonl").exists():
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.1)
    return proc


@pytest.fixture(scope="module")
def one_by_eight(tmp_path_factory, digits_data_dir):
    workdir = str(tmp_path_factory.mktemp("1x8"))
    done = run(
        replicator_cmd(
            "train", *TRAIN, "--workdir", workdir, f"--config.data_dir={digits_data_dir}"
        ),
        env={"XLA_FLAGS": "--xla_force_host_platform_device_count=8"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return workdir


def test_two_processes_train_like_one(tmp_path, digits_data_dir, one_by_eight):
    workdir = str(tmp_path / "2x4")
    done = run(
        replicator_cmd(
            "launch",
            "local",
            "--processes",
            "2",
            "--devices-per-process",
            "4",
            "--",
            "train",
            *TRAIN,
            "--workdir",
            workdir,
            f"--config.data_dir={digits_data_dir}",
        )
    )
    assert done.returncode == 0, done.stdout[-3000:]
    assert "[0] Final test accuracy after 30 steps" in done.stdout
    assert "[1] Final test accuracy" not in done.stdout  # only process 0 reports
    ours, reference = read_records(workdir), read_records(one_by_eight)
    train_losses = [(r["step"], r["loss"]) for r in ours if "split" not in r]
    expected = [(r["step"], r["loss"]) for r in reference if "split" not in r]
    assert [s for s, _ in train_losses] == [s for s, _ in expected]
    for (_, a), (_, b) in zip(train_losses, expected):
        assert a == pytest.approx(b, abs=1e-6)
    evals = [r for r in ours if r.get("split") == "test"]
    ref_evals = [r for r in reference if r.get("split") == "test"]
    assert [r["accuracy"] for r in evals] == [r["accuracy"] for r in ref_evals]
    assert all(r["num_examples"] == 360 for r in evals)
    assert sorted(os.listdir(os.path.join(workdir, "checkpoints")))[-1] == "30"


def children_of(pid):
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        kids.append(int(entry))
            except (OSError, IndexError, ValueError):
                pass
    return sorted(kids)


def test_a_dead_worker_stops_the_launch(tmp_path, digits_data_dir):
    cmd = replicator_cmd(
        "launch",
        "local",
        "--processes",
        "2",
        "--devices-per-process",
        "2",
        "--",
        "train",
        *TRAIN,
        "--config.num_train_steps=100000",
        "--workdir",
        str(tmp_path),
        f"--config.data_dir={digits_data_dir}",
    )
    proc = start_until_training(cmd, tmp_path)
    workers = children_of(proc.pid)
    assert len(workers) == 2
    os.kill(workers[1], signal.SIGKILL)
    killed_at = time.monotonic()
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0
    assert "process 1 failed with exit code -9" in out
    assert time.monotonic() - killed_at < 60


def test_missing_process_fails_with_names(tmp_path):
    port = launch.free_port_pair()
    env = {
        "REPLICATOR_COORDINATOR": f"127.0.0.1:{port}",
        "REPLICATOR_NUM_PROCESSES": "3",
        "REPLICATOR_PROCESS_ID": "0",
        "JAX_PLATFORMS": "cpu",
    }
    start = time.monotonic()
    done = run(
        replicator_cmd(
            "train",
            "--config",
            "configs/digits_cnn.py:smoke",
            "--workdir",
            str(tmp_path / "w"),
            "--init_timeout=3",
        ),
        env=env,
    )
    assert done.returncode != 0
    assert "Processes [1, 2] of 3 did not arrive within 3 s" in done.stderr
    assert time.monotonic() - start < 60
    assert not (tmp_path / "w").exists()


def test_process_group_detection():
    env = {
        "REPLICATOR_COORDINATOR": "10.0.0.1:1234",
        "REPLICATOR_NUM_PROCESSES": "4",
        "REPLICATOR_PROCESS_ID": "2",
    }
    assert detect_process_group(environ=env) == ProcessGroup("10.0.0.1:1234", 4, 2, "environment")
    assert detect_process_group(environ={}) is None or os.environ.get("SLURM_JOB_ID")
    with pytest.raises(ValueError, match="process_id=5 is not in"):
        detect_process_group("127.0.0.1:1", 2, 5)


def test_tpu_dry_run_prints_the_commands():
    done = run(
        replicator_cmd(
            "launch",
            "tpu",
            "--tpu",
            "my-pod",
            "--zone",
            "us-east5-a",
            "--project",
            "proj",
            "--dry-run",
            "--",
            "train",
            "--config",
            "configs/digits_cnn.py",
            "--workdir",
            "gs://bucket/run",
        )
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert lines[0].startswith("gcloud compute tpus tpu-vm scp --recurse --worker=all")
    assert "--worker=all" in lines[2] and "ssh my-pod" in lines[2]
    assert "--zone us-east5-a --project proj" in lines[2]
    assert (
        "-m replicator train --config configs/digits_cnn.py --workdir gs://bucket/run" in lines[2]
    )


def test_slurm_dry_run_prints_the_script():
    done = run(
        replicator_cmd(
            "launch",
            "slurm",
            "--nodes",
            "2",
            "--gpus-per-node",
            "8",
            "--dry-run",
            "--",
            "train",
            "--config",
            "configs/digits_cnn.py",
            "--workdir",
            "runs/x",
        )
    )
    assert done.returncode == 0, done.stderr
    script = done.stdout
    for line in (
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=8",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --signal=TERM@120",
    ):
        assert line in script
    assert "srun --kill-on-bad-exit=1 .venv/bin/python -m replicator train --config" in script


def test_sigterm_to_the_launcher_checkpoints_and_resumes(tmp_path, digits_data_dir):
    args = [
        "--",
        "train",
        *TRAIN,
        "--config.num_train_steps=400",
        "--config.checkpoint_every_steps=1000",
        "--workdir",
        str(tmp_path),
        f"--config.data_dir={digits_data_dir}",
    ]
    cmd = replicator_cmd("launch", "local", "--processes", "2", "--devices-per-process", "2", *args)
    proc = start_until_training(cmd, tmp_path)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 0, out[-3000:]
    assert "Preempted: saved a checkpoint at step" in out
    saved = int(re.search(r"saved a checkpoint at step (\d+)", out).group(1))
    assert (tmp_path / "checkpoints" / str(saved)).exists()
    done = run(cmd)
    assert done.returncode == 0, done.stdout[-3000:]
    assert f"Resumed from step {saved}" in done.stdout
    assert "Final test accuracy after 400 steps" in done.stdout


_REPLICATE = """
import jax, numpy as np
import replicator as rp
from replicator import mesh
mesh.initialize_distributed(mesh.detect_process_group(), timeout_s=60)
repl = rp.Replicator()
tree = repl.replicate({"key": jax.random.key(3), "w": np.arange(4.0)})
draw = repl.compile(lambda t: jax.random.normal(t["key"], (3,)) + t["w"].sum())(tree)
print("RESULT", np.asarray(draw.addressable_data(0)).tolist())
"""


def test_replicate_places_typed_keys_across_processes():
    port = launch.free_port_pair()
    env = {
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
        launch.ENV_COORDINATOR: f"127.0.0.1:{port}",
        launch.ENV_NUM_PROCESSES: "2",
    }
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _REPLICATE],
            cwd=ROOT,
            env={**os.environ, **env, launch.ENV_PROCESS_ID: str(i)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    import jax

    want = (jax.random.normal(jax.random.key(3), (3,)) + 6.0).tolist()
    for out in outputs:
        (line,) = [x for x in out.splitlines() if x.startswith("RESULT")]
        assert eval(line.removeprefix("RESULT")) == pytest.approx(want)
