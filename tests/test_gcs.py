"""Runs on a bucket: a real GCS server (gcp-storage-emulator) on 127.0.0.1, reached
through the client libraries' own variables (tests/gcs.py), never a mock.

Pod workers share no disk: everything a run writes must land in the bucket, a
run killed with SIGKILL must resume bitwise from the bucket in another working
directory (a recreated pod), and eval must read it back on any devices.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import replicator as rp
from replicator import storage
from tests import gcs
from tests.helpers.configs import read_records
from tests.test_checkpoint import final_params, tensorboard_scalars
from tests.test_multiprocess import TRAIN as MULTI_TRAIN
from tests.test_multiprocess import (
    one_by_eight,  # noqa: F401  (a fixture)
    train_2x4,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "configs", "digits_cnn.py")
RUN_FLAGS = [
    "--config.num_train_steps=120",
    "--config.batch_size=32",
    "--config.checkpoint_every_steps=40",
    "--config.eval_every_steps=60",
    "--config.log_every_steps=20",
    "--quiet",
]


def replicator_command(*args, cwd, devices=2, **kwargs):
    """``python -m replicator ARGS`` in ``cwd`` with ``devices`` fake CPU devices."""
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    return subprocess.Popen(
        [sys.executable, "-m", "replicator", *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kwargs,
    )


def train(workdir, data_dir, cwd, *extra):
    return replicator_command(
        "train", "--config", CONFIG, "--workdir", str(workdir),
        f"--config.data_dir={data_dir}", *RUN_FLAGS, *extra, cwd=cwd,
    )  # fmt: skip


def finish(proc, timeout=300):
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-3000:]
    return out, err


def absolute(args):
    return [os.path.join(ROOT, a) if a.startswith("configs/") else a for a in args]


def records(workdir):
    text = storage.read_text(storage.join(str(workdir), "metrics.jsonl"))
    return [json.loads(line) for line in text.splitlines()]


def without_timing(rs):
    """The records a rerun must reproduce bitwise: all but the summary and the speeds."""
    return [
        {k: v for k, v in r.items() if not k.endswith("_per_sec")}
        for r in rs
        if r.get("split") != "summary"
    ]


@pytest.fixture(scope="module")
def local_reference(tmp_path_factory, digits_data_dir):
    """The same run, uninterrupted, on a local disk."""
    workdir = tmp_path_factory.mktemp("reference")
    finish(train(workdir, digits_data_dir, ROOT))
    return workdir


@pytest.mark.slow  # make test-slow: the fast suite holds its invariant elsewhere
def test_a_run_on_a_bucket_leaves_nothing_local_and_equals_a_local_run(
    tmp_path, bucket, digits_data_dir, local_reference
):
    cwd = tmp_path / "worker"
    cwd.mkdir()
    workdir = f"{bucket}/runs/d1"
    out, err = finish(train(workdir, digits_data_dir, cwd))
    assert os.listdir(cwd) == []  # no gs:/ folder, nothing else
    objects = gcs.list_objects(workdir)
    for name in ("metrics.jsonl", "config.json", "log.txt"):
        assert name in objects
    assert any(o.startswith("tensorboard/events.out.tfevents.") for o in objects)
    assert any(o.startswith("checkpoints/120/state/") for o in objects)
    assert "python -m replicator train" in storage.read_text(f"{workdir}/log.txt")
    assert without_timing(records(workdir)) == without_timing(records(local_reference))
    step, params = final_params(storage.path(workdir))
    ref_step, ref_params = final_params(local_reference)
    assert step == ref_step == 120
    jax.tree.map(np.testing.assert_array_equal, params, ref_params)


def test_sigkill_then_resume_from_another_directory_is_bitwise(
    tmp_path, bucket, digits_data_dir, local_reference
):
    workdir = f"{bucket}/runs/killed"
    first, second = tmp_path / "pod1", tmp_path / "pod2"
    first.mkdir()
    second.mkdir()
    proc = train(workdir, digits_data_dir, first)
    deadline = time.monotonic() + 240
    while not storage.exists(f"{workdir}/checkpoints/80"):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.1)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    out, err = finish(train(workdir, digits_data_dir, second))
    assert "Resumed from step" in err
    assert os.listdir(first) == [] and os.listdir(second) == []
    assert without_timing(records(workdir)) == without_timing(records(local_reference))
    step, params = final_params(storage.path(workdir))
    _, ref_params = final_params(local_reference)
    assert step == 120
    jax.tree.map(np.testing.assert_array_equal, params, ref_params)
    want = tensorboard_scalars(local_reference / "tensorboard")["train/loss"]
    assert tensorboard_scalars(storage.path(f"{workdir}/tensorboard"))["train/loss"] == want


@pytest.mark.slow  # 12 s; eval on other device counts: test_eval_anywhere, on every make test
def test_eval_from_a_bucket_on_1_and_3_devices(tmp_path, bucket, digits_data_dir):
    workdir = f"{bucket}/runs/e"
    finish(train(workdir, digits_data_dir, tmp_path, "--config.num_train_steps=40"))
    trained = [r for r in records(workdir) if r.get("split") == "test"][-1]
    for devices in (1, 3):
        out, _ = finish(
            replicator_command(
                "eval", "--workdir", workdir, "--json", cwd=tmp_path, devices=devices
            )
        )
        result = json.loads(out.strip().splitlines()[-1])
        assert result["step"] == 40 and result["num_examples"] == trained["num_examples"]
        assert result["accuracy"] == pytest.approx(trained["accuracy"], abs=1e-6)
        assert result["loss"] == pytest.approx(trained["loss"], rel=1e-5)
    assert os.listdir(tmp_path) == []


def test_a_missing_bucket_is_one_line_and_writes_nothing(tmp_path, gcs_server):
    for command in (["train", "--config", CONFIG], ["eval"]):
        proc = replicator_command(
            *command, "--workdir", "gs://no-such-bucket-here/run", cwd=tmp_path
        )
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 2, err[-3000:]
        lines = err.strip().splitlines()
        assert len(lines) == 1 and "no such bucket gs://no-such-bucket-here" in lines[0], err
        assert "Traceback" not in err
    assert os.listdir(tmp_path) == []


@pytest.mark.slow  # make test-slow: the fast suite holds its invariant elsewhere
def test_a_bucket_one_cannot_write_is_one_line_and_writes_nothing(tmp_path, gcs_server):
    import fsspec

    bucket = f"readonly-{os.urandom(6).hex()}"  # the server refuses writes there (403)
    fsspec.filesystem("gcs").mkdir(bucket)
    expected = {"train": "permission denied: .* storage.objects.create", "eval": "does not exist"}
    for command in (["train", "--config", CONFIG], ["eval"]):
        start = time.monotonic()
        proc = replicator_command(*command, "--workdir", f"gs://{bucket}/run", cwd=tmp_path)
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 2, err[-3000:]
        lines = err.strip().splitlines()
        assert len(lines) == 1 and f"gs://{bucket}/run" in lines[0], err
        assert re.search(expected[command[0]], lines[0]), err  # no retrying a refusal
        assert "Traceback" not in err
        assert time.monotonic() - start < 60
    assert gcs.list_objects(f"gs://{bucket}") == []
    assert os.listdir(tmp_path) == []


def test_storage_that_does_not_answer_is_one_line_in_bounded_time(gcs_server, monkeypatch):
    import socket

    import fsspec

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # accepts connections, never answers
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{silent.getsockname()[1]}")
    fsspec.filesystem("gcs").clear_instance_cache()
    try:
        start = time.monotonic()
        with pytest.raises(storage.StorageUnavailableError, match="did not answer") as error:
            storage.check_writable("gs://any/run", deadline_s=3)
        assert time.monotonic() - start < 10
        assert isinstance(error.value, storage.StorageError)  # an outage: exit status 75
        assert "gs://any/run" in str(error.value) and "\n" not in str(error.value)
    finally:
        fsspec.filesystem("gcs").clear_instance_cache()
        silent.close()


def test_checkpoints_on_a_bucket_save_restore_and_keep(bucket):
    repl = rp.Replicator()
    directory = f"{bucket}/custom/checkpoints"
    ckpt = rp.Checkpoints(directory, repl, keep=2)
    state = repl.replicate({"w": jnp.zeros(3), "step": jnp.int32(0)})
    for step in range(1, 4):
        state = {"w": state["w"] + 1, "step": state["step"] + 1}
        ckpt.save(step, state, data_state={"epoch": step})
    ckpt.wait()
    assert ckpt.all_steps() == [2, 3]
    ckpt.write_metrics(3, {"accuracy": 0.5})
    ckpt.close()
    # Another process (another machine) reads it back onto 3 devices.
    reader = rp.Checkpoints(directory, rp.Replicator(devices=jax.devices()[:3]), read_only=True)
    restored = reader.restore(like=jax.eval_shape(lambda: state))
    assert reader.restored_step == 3 and restored["w"].tolist() == [3.0, 3.0, 3.0]
    assert reader.saved_data_state(3) == {"epoch": 3}
    assert json.loads(storage.read_text(f"{directory}/3/metrics/metrics")) == {"accuracy": 0.5}
    assert not os.path.exists("gs:")


def test_checkpoints_in_a_missing_bucket_is_a_storage_error(gcs_server):
    with pytest.raises(storage.StorageError, match="no such bucket gs://nowhere-at-all"):
        rp.Checkpoints("gs://nowhere-at-all/ckpt", rp.Replicator())


def test_mirror_keeps_the_object_equal_to_the_file(bucket):
    target = f"{bucket}/m/log.txt"
    storage.write_text(target, "earlier\n")
    mirror = storage.Mirror(target, interval_s=0.1)
    # Named after its process: a killed process's copy is removed by a later one.
    assert os.path.basename(os.path.dirname(mirror.local_path)).startswith(
        f"replicator-mirror-{os.getpid()}@"
    )
    with open(mirror.local_path, "a") as f:
        f.write("more\n")
    deadline = time.monotonic() + 10
    while storage.read_text(target) != "earlier\nmore\n":  # the background upload
        assert time.monotonic() < deadline
        time.sleep(0.05)
    with open(mirror.local_path, "a") as f:
        f.write("last\n")
    mirror.close()
    assert storage.read_text(target) == "earlier\nmore\nlast\n"
    assert not os.path.exists(mirror.local_path)


@pytest.mark.slow  # two processes plus the 1 x 8 reference: make test-slow
def test_two_processes_share_one_run_on_a_bucket(
    tmp_path,
    bucket,
    digits_data_dir,
    one_by_eight,  # noqa: F811
):
    """2 processes x 4 devices with no shared disk, everything in the bucket, compute the
    1 x 8 run's steps (to float32 rounding: gloo sums in another order)."""
    workdir = f"{bucket}/runs/2x4"
    done = subprocess.run(
        train_2x4(
            *absolute(MULTI_TRAIN), "--workdir", workdir, f"--config.data_dir={digits_data_dir}"
        ),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:]
    assert os.listdir(tmp_path) == []
    objects = gcs.list_objects(workdir)
    assert {"log.txt", "log.process_1.txt", "metrics.jsonl", "config.json"} <= set(objects)
    assert any(o.startswith("checkpoints/30/state/ocdbt.process_1/") for o in objects)
    ours = [r for r in records(workdir) if "split" not in r]
    reference = [r for r in read_records(one_by_eight) if "split" not in r]
    assert [r["step"] for r in ours] == [r["step"] for r in reference]
    for a, b in zip(ours, reference):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-6)


@pytest.mark.slow  # make test-slow: a faster test holds its invariant
def test_init_from_a_run_on_a_bucket(tmp_path, bucket, digits_data_dir):
    """Fine-tuning reads the source run from the bucket: with everything frozen, the
    first eval is the source run's."""
    source = f"{bucket}/runs/pretrained"
    finish(train(source, digits_data_dir, tmp_path, "--config.num_train_steps=40"))
    tuned = tmp_path / "tuned"
    out, err = finish(
        train(tuned, digits_data_dir, tmp_path, "--config.num_train_steps=1",
              f"--config.init_from={source}:40", "--config.freeze=.*")
    )  # fmt: skip
    assert f"init_from {source}/checkpoints step 40: loaded " in err
    want = [r for r in records(source) if r.get("split") == "test"][-1]
    got = [r for r in records(tuned) if r.get("split") == "test"][0]
    assert (got["accuracy"], got["loss"]) == (want["accuracy"], want["loss"])
