"""Multi-process runs on one machine: 2 processes x 4 devices behave like 1 x 8."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import replicator as rp
from replicator.parallel.mesh import build_mesh
from replicator.runtime import launch
from replicator.runtime.processes import ProcessGroup, detect_process_group
from tests.compare import assert_trained_alike
from tests.helpers.configs import read_records

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


def train_2x4(*train_args):
    """``launch local`` of ``train TRAIN_ARGS`` as 2 processes x 4 fake devices."""
    return replicator_cmd(
        "launch", "local", "--processes", "2", "--devices-per-process", "4", "--", "train",
        *train_args,
    )  # fmt: skip


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
    done = run(train_2x4(*TRAIN, "--workdir", workdir, f"--config.data_dir={digits_data_dir}"))
    assert done.returncode == 0, done.stdout[-3000:]
    assert "[0] Final test metrics after 30 steps" in done.stdout
    assert "[1] Final test metrics" not in done.stdout  # only process 0 reports
    assert "Gloo" not in done.stdout  # the C++ libraries' notices go to the logs
    assert "Gloo" in (tmp_path / "2x4" / "log.txt").read_text()
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


@pytest.mark.slow  # make test-slow; keeps make test under 15 minutes on CI
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
    assert "process 1 was killed (SIGKILL), not a failure of the run: rerun the same" in out
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


def test_slurm_is_detected_through_jax(monkeypatch):
    """A SLURM job step's environment (as srun sets it): JAX's detector, via compat."""
    for name, value in {
        "SLURM_JOB_ID": "4242",
        "SLURM_STEP_NODELIST": "node[1-2]",
        "SLURM_NTASKS": "4",
        "SLURM_PROCID": "2",
        "SLURM_LOCALID": "0",
        "SLURM_STEP_NUM_NODES": "2",
    }.items():
        monkeypatch.setenv(name, value)
    port = 4242 % 2**12 + 65535 - 2**12 + 1  # JAX's port for the job
    assert detect_process_group() == ProcessGroup(f"node1:{port}", 4, 2, "SlurmCluster")


@pytest.mark.slow  # 25 s; SIGTERM to one trainer is tested in test_checkpoint, always
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
    assert "Final test metrics after 400 steps" in done.stdout


_ACROSS_PROCESSES = """
import jax, numpy as np
import replicator as rp
group = rp.initialize(timeout_s=60)
assert rp.initialize() is group and group.num_processes == 2  # a second call does nothing
repl = rp.Replicator()
tree = repl.replicate({"key": jax.random.key(3), "w": np.arange(4.0)})
draw = repl.compile(lambda t: jax.random.normal(t["key"], (3,)) + t["w"].sum())(tree)
print("RESULT", np.asarray(draw.addressable_data(0)).tolist())
rows = (repl.process_rows(8), rp.Replicator(mesh={"data": -1, "tensor": 2}).process_rows(6))
print("ROWS", [(r.start, r.stop) for r in rows])
for size in (5, 6):
    try:
        repl.process_rows(size)
    except ValueError as e:
        print("ERROR", e)
"""


@pytest.mark.slow  # make test-slow: a faster test holds its invariant
def test_replicate_and_process_rows_across_processes():
    """2 processes x 2 devices: typed keys placed mirrored, each process's rows."""
    done = run(
        replicator_cmd(
            "launch", "local", "--processes", "2", "--devices-per-process", "2", "--",
            "python", "-c", _ACROSS_PROCESSES,
        ),
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:]
    import jax

    want = (jax.random.normal(jax.random.key(3), (3,)) + 6.0).tolist()
    for i, rows in ((0, [(0, 4), (0, 3)]), (1, [(4, 8), (3, 6)])):
        lines = [
            x.removeprefix(f"[{i}] ") for x in done.stdout.splitlines() if x.startswith(f"[{i}] ")
        ]
        (result,) = [x for x in lines if x.startswith("RESULT")]
        assert eval(result.removeprefix("RESULT")) == pytest.approx(want)
        assert f"ROWS {rows}" in lines
        assert [x for x in lines if x.startswith("ERROR")] == [
            "ERROR A global batch of 5 rows does not split evenly over 2 processes; "
            "use a multiple of 4.",
            "ERROR A global batch of 6 rows does not split evenly over 4 replicas; "
            "use a multiple of 4.",
        ]


CUSTOM_LOOP = ["python", "tests/programs/custom_loop.py"]


@pytest.mark.slow  # make test-slow: a faster test holds its invariant
def test_custom_loop_on_two_processes_equals_one(tmp_path):
    """The user's own script under `launch local` (2 x 4) equals it on 1 x 8.

    The all-reduce runs over gloo between processes and in-process otherwise,
    which may add the replicas' gradients in another order: observed differences
    are at most 1.2e-7 (one float32 ulp of the values), hence 1e-6.
    """
    one = subprocess.Popen(
        [sys.executable, *CUSTOM_LOOP[1:], str(tmp_path / "1x8.json")],
        cwd=ROOT,
        env={**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    launched = run(
        replicator_cmd(
            "launch", "local", "--processes", "2", "--devices-per-process", "4", "--",
            *CUSTOM_LOOP, str(tmp_path / "2x4.json"),
        ),
        timeout=180,
    )  # fmt: skip
    out = one.communicate(timeout=180)[0]
    assert one.returncode == 0, out[-3000:]
    assert launched.returncode == 0, launched.stdout[-3000:]
    assert "[0] process 0 of 2 fed rows 0:16 of 32" in launched.stdout
    assert "[1] process 1 of 2 fed rows 16:32 of 32" in launched.stdout
    ours, reference = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("2x4", "1x8"))
    assert sorted(ours) == ["adam", "sgd"]
    for name in ours:
        losses = ours[name]["losses"]
        assert len(losses) == 10 and losses[-1] < 0.7 * losses[0]  # it trains
        np.testing.assert_allclose(losses, reference[name]["losses"], rtol=0, atol=1e-6)
        if name == "adam":  # its rare amplified rounding, up to its rate (tests/compare.py)
            assert_trained_alike(ours[name]["params"], reference[name]["params"], atol=1e-6,
                                 worst=1e-2)  # fmt: skip
            continue
        for key, value in ours[name]["params"].items():
            np.testing.assert_allclose(
                value, reference[name]["params"][key], rtol=0, atol=1e-6, err_msg=key
            )


def test_launch_runs_any_command():
    done = run(
        replicator_cmd(
            "launch", "local", "--processes", "2", "--",
            "sh", "-c", "echo process $REPLICATOR_PROCESS_ID of $REPLICATOR_NUM_PROCESSES",
        )
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.splitlines()) == ["[0] process 0 of 2", "[1] process 1 of 2"]
    missing = run(replicator_cmd("launch", "local", "--processes", "2", "--", "no-such-program"))
    assert missing.returncode == 2
    assert "cannot run 'no-such-program': no such program on PATH" in missing.stderr


def test_launch_restarts_a_failed_run(tmp_path):
    """--restarts: the first run fails (process 1 exits 3), the second finds what the
    first left behind (a checkpoint, here a file) and succeeds."""
    marker = tmp_path / "first_attempt_done"
    script = (
        f"if [ $REPLICATOR_PROCESS_ID = 1 ] && [ ! -e {marker} ]; then touch {marker}; "
        "exit 3; fi; echo attempt ok"
    )
    done = run(replicator_cmd("launch", "local", "--processes", "2", "--restarts", "1", "--",
                              "sh", "-c", script))  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "the run failed (exit code 3); restart 1 of 1" in done.stderr
    assert done.stdout.count("attempt ok") >= 2
    never = run(replicator_cmd("launch", "local", "--processes", "2", "--restarts", "2", "--",
                               "sh", "-c", "exit 4"))  # fmt: skip
    assert never.returncode == 4
    assert "restart 2 of 2" in never.stderr


def test_resolve_command():
    assert launch.resolve_command(["eval", "--step", "3"], "py") == [
        "py", "-m", "replicator", "eval", "--step", "3"
    ]  # fmt: skip
    assert launch.resolve_command(["python3", "-m", "mypkg"], "py") == ["py", "-m", "mypkg"]
    with pytest.raises(ValueError, match="No command to launch"):
        launch.resolve_command([], "py")


def test_initialize_is_a_no_op_for_one_process(monkeypatch):
    for name in (launch.ENV_COORDINATOR, launch.ENV_NUM_PROCESSES, launch.ENV_PROCESS_ID):
        monkeypatch.delenv(name, raising=False)
    if detect_process_group() is not None:
        pytest.skip("the test runner is itself one process of several (e.g. under SLURM)")
    assert rp.initialize() is None
    assert rp.initialize() is None


def test_initialize_after_jax_started_says_to_call_it_first(monkeypatch):
    """The test process has started JAX's backends: joining now must fail at once,
    with what to do, before any roll call (which would wait for the others)."""
    import jax

    jax.devices()
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"process 0 of 2 \(explicit\).*top of the script"):
        rp.initialize(coordinator_address="127.0.0.1:1", num_processes=2, process_id=0)
    monkeypatch.setenv(launch.ENV_COORDINATOR, "127.0.0.1:1")
    monkeypatch.setenv(launch.ENV_NUM_PROCESSES, "2")
    monkeypatch.setenv(launch.ENV_PROCESS_ID, "1")
    with pytest.raises(RuntimeError, match=r"process 1 of 2 \(environment\)"):
        rp.initialize()
    assert time.monotonic() - start < 5
    # A script that never called rp.initialize() would train alone: the mesh says so.
    with pytest.raises(RuntimeError, match="process 1 of 2, but it has not joined"):
        build_mesh()


@pytest.mark.slow  # make test-slow: a faster test holds its invariant
def test_diloco_islands_on_two_processes_train_like_one(tmp_path, digits_data_dir):
    """configs/digits_cnn_diloco.py (4 islands x 2 replicas): 2 processes x 4 devices
    (the islands spanning both) equal 1 x 8, syncs and all."""
    args = [
        "--config", "configs/digits_cnn_diloco.py",
        "--config.num_train_steps=12", "--config.batch_size=64",
        "--config.eval_every_steps=12", "--config.checkpoint_every_steps=12",
        "--config.log_every_steps=2", "--config.diloco.inner_steps=4", "--quiet",
        f"--config.data_dir={digits_data_dir}",
    ]  # fmt: skip
    one = str(tmp_path / "1x8")
    done = run(
        replicator_cmd("train", *args, "--workdir", one),
        env={"XLA_FLAGS": "--xla_force_host_platform_device_count=8"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    two = str(tmp_path / "2x4")
    done = run(
        replicator_cmd(
            "launch", "local", "--processes", "2", "--devices-per-process", "4", "--",
            "train", *args, "--workdir", two,
        )
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:]
    ours, reference = ([r for r in read_records(w) if "loss" in r] for w in (two, one))
    assert len(ours) == len(reference) == 7  # 6 train records and one eval
    for a, b in zip(ours, reference):
        assert a["step"] == b["step"]
        assert a.get("loss") == pytest.approx(b.get("loss"), abs=1e-6)
    assert ours[-1]["accuracy"] == reference[-1]["accuracy"]


ELASTIC = ["python", "tests/programs/elastic_diloco.py"]


def launch_elastic(out, *args, timeout=240):
    cmd = replicator_cmd(
        "launch", "local", "--elastic", "--processes", "3", "--devices-per-process", "2",
        "--", *ELASTIC, str(out), *args,
    )  # fmt: skip
    return run(cmd, timeout=timeout)


def islands_saved(out):
    return {
        int(name[len("island") : -len(".npz")]): dict(np.load(os.path.join(out, name)))
        for name in sorted(os.listdir(out))
    }


@pytest.mark.slow  # make test-slow: a faster test holds its invariant
def test_elastic_islands_survive_a_killed_island_exactly(tmp_path):
    """Island 2 is SIGKILLed after step 7 (between the syncs of steps 6 and 9): the two
    survivors finish, bitwise equal to one process that drops island 2 from then on."""
    done = launch_elastic(tmp_path / "run", "--die-island", "2", "--die-at-step", "7")
    assert done.returncode == 0, done.stdout[-3000:]
    assert "process 2 died (signal 9)" in done.stderr
    assert "island 0 finished with islands [0, 1]" in done.stdout
    # The guide's example prints its own lines only: no gloo or coordination-service notices.
    assert "[Gloo]" not in done.stdout and "coordination_service" not in done.stdout
    reference = run(
        [sys.executable, *ELASTIC[1:], str(tmp_path / "ref"), "--reference", "3",
         "--die-island", "2", "--die-at-step", "7"],
        env={"XLA_FLAGS": "--xla_force_host_platform_device_count=2"},
    )  # fmt: skip
    assert reference.returncode == 0, reference.stderr[-3000:]
    got, want = islands_saved(tmp_path / "run"), islands_saved(tmp_path / "ref")
    assert sorted(got) == sorted(want) == [0, 1]
    for k in (0, 1):
        for name in want[k]:
            np.testing.assert_array_equal(got[k][name], want[k][name])


@pytest.mark.slow  # make test-slow; keeps make test under 15 minutes on CI
def test_elastic_kill_inside_a_sync_never_hangs_the_others(tmp_path):
    """Island 2 dies in the middle of a sync, after sending its outer gradient: the
    survivors agree on one result (with or without it) and finish."""
    start = time.monotonic()
    done = launch_elastic(tmp_path, "--die-island", "2", "--die-in-sync", "2", "--timeout", "60")
    assert done.returncode == 0, done.stdout[-3000:]
    assert time.monotonic() - start < 120
    got = islands_saved(tmp_path)
    assert sorted(got) == [0, 1]
    for name in got[0]:
        np.testing.assert_array_equal(got[0][name], got[1][name])


@pytest.mark.slow  # make test-slow; keeps make test under 15 minutes on CI
def test_elastic_sync_that_cannot_complete_exits_naming_the_missing(tmp_path):
    """Island 2 is alive but stuck in a sync: the others give up after the timeout with
    the sync-timeout exit code, naming it."""
    from replicator.runtime.elastic import EXIT_SYNC_TIMEOUT

    start = time.monotonic()
    # 20 s: enough for healthy islands to meet at round 0 on a loaded machine.
    done = launch_elastic(tmp_path, "--die-island", "2", "--hang-in-sync", "1", "--timeout", "20")
    assert done.returncode == EXIT_SYNC_TIMEOUT, done.stdout[-3000:]
    assert "processes [2] never reached it" in done.stdout
    assert time.monotonic() - start < 120  # the timeout, the launcher's 30 s grace, startup
