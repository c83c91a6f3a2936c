"""Checkpoints: exact resume after SIGKILL/SIGTERM, restore anywhere, faults are loud."""

import errno
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
import optax
import orbax.checkpoint as ocp
import pytest

import replicator as rp
from replicator import checkpoint as ckpt
from replicator import train
from replicator.state import TrainState
from tests.test_train import read_records

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# 2 fake devices keep the subprocesses quick; 300 steps take a few seconds.
RUN_FLAGS = [
    "--config.num_train_steps=300",
    "--config.batch_size=32",
    "--config.checkpoint_every_steps=50",
    "--config.eval_every_steps=100",
    "--config.log_every_steps=25",
    "--quiet",
]


def start_train(workdir, data_dir, *extra):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2")
    cmd = [
        sys.executable,
        "-m",
        "replicator",
        "train",
        "--config",
        "configs/digits_cnn.py",
        "--workdir",
        str(workdir),
        f"--config.data_dir={data_dir}",
        *RUN_FLAGS,
        *extra,
    ]
    return subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def finish(proc, timeout=240):
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def wait_for(predicate, proc, timeout=120):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def final_params(workdir):
    """The last checkpoint's parameters, read with plain Orbax (no replicator)."""
    directory = os.path.join(workdir, "checkpoints")
    step = max(int(d) for d in os.listdir(directory) if d.isdigit())
    restored = ocp.PyTreeCheckpointer().restore(os.path.join(directory, str(step), "state"))
    return step, restored["params"]


def eval_records(workdir):
    records = read_records(workdir)
    return [r for r in records if r.get("split") == "test"], records


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, digits_data_dir):
    workdir = tmp_path_factory.mktemp("uninterrupted")
    code, out, err = finish(start_train(workdir, digits_data_dir))
    assert code == 0, err[-3000:]
    return workdir


def assert_same_run(workdir, reference):
    step, params = final_params(workdir)
    ref_step, ref_params = final_params(reference)
    assert step == ref_step == 300
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), params, ref_params)
    evals, records = eval_records(workdir)
    ref_evals, ref_records = eval_records(reference)
    assert evals == ref_evals  # bitwise: same loss, accuracy, count at every eval
    losses = [(r["step"], r["loss"]) for r in records if "split" not in r]
    assert losses == [(r["step"], r["loss"]) for r in ref_records if "split" not in r]


def test_sigkill_then_resume_equals_uninterrupted(tmp_path, digits_data_dir, uninterrupted):
    workdir = tmp_path / "killed"
    proc = start_train(workdir, digits_data_dir)
    wait_for(lambda: (workdir / "checkpoints" / "100").exists(), proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    code, out, err = finish(start_train(workdir, digits_data_dir))
    assert code == 0, err[-3000:]
    assert "Resumed from step" in err
    assert_same_run(workdir, uninterrupted)


def test_sigterm_saves_exits_zero_and_resumes(tmp_path, digits_data_dir, uninterrupted):
    workdir = tmp_path / "preempted"
    proc = start_train(workdir, digits_data_dir)
    wait_for(lambda: (workdir / "metrics.jsonl").exists(), proc)
    proc.send_signal(signal.SIGTERM)
    code, out, err = finish(proc)
    assert code == 0, err[-3000:]
    assert "Preempted: saved a checkpoint at step" in out
    saved = int(re.search(r"saved a checkpoint at step (\d+)", out).group(1))
    assert (workdir / "checkpoints" / str(saved)).exists()
    code, out, err = finish(start_train(workdir, digits_data_dir))
    assert code == 0, err[-3000:]
    assert f"Resumed from step {saved}" in err
    assert_same_run(workdir, uninterrupted)


# ---- In-process tests of the Checkpoints class.


def small_state(width=3):
    params = {"dense": {"kernel": jnp.ones((4, width)), "bias": jnp.zeros(width)}}
    tx = optax.adam(1e-3)
    return TrainState(
        step=jnp.int32(7), params=params, opt_state=tx.init(params), rng=jax.random.key(1)
    )


def save_steps(directory, steps, **kwargs):
    manager = ckpt.Checkpoints(str(directory), **kwargs)
    state = small_state()
    for step, metrics in steps:
        manager.save(
            step, state, data_state={"iterator": "{}"}, config_json='{"a": 1}', metrics=metrics
        )
    manager.close()
    return state


def test_restore_onto_other_device_counts(tmp_path):
    state = save_steps(tmp_path, [(1, None)])
    manager = ckpt.Checkpoints(str(tmp_path), read_only=True)
    for n in (1, 3, 8):
        repl = rp.Replicator(devices=jax.devices()[:n])
        restored, data_state = manager.restore(1, ckpt.abstract_like(state, repl.mirrored_sharding))
        assert restored.params["dense"]["kernel"].sharding.num_devices == n
        assert data_state == {"iterator": "{}"}
        np.testing.assert_array_equal(restored.params["dense"]["kernel"], 1.0)
        assert jax.random.key_data(restored.rng).tolist() == jax.random.key_data(state.rng).tolist()


def test_torn_tmp_checkpoint_is_ignored(tmp_path):
    save_steps(tmp_path, [(1, None)])
    torn = tmp_path / "2.orbax-checkpoint-tmp-1234"
    (torn / "state").mkdir(parents=True)
    (torn / "state" / "garbage").write_bytes(b"\0" * 10)
    manager = ckpt.Checkpoints(str(tmp_path), read_only=True)
    assert manager.all_steps() == [1]


def test_truncated_checkpoint_falls_back_or_fails_strictly(tmp_path, caplog):
    state = save_steps(tmp_path, [(1, None), (2, None)])
    data_files = [
        os.path.join(d, f)
        for d, _, fs in os.walk(tmp_path / "2" / "state")
        for f in fs
        if "d" in d.split(os.sep)[-1] or f.startswith("ocdbt")
    ]
    for path in data_files or [str(tmp_path / "2" / "state" / "manifest.ocdbt")]:
        os.truncate(path, 0)
    manager = ckpt.Checkpoints(str(tmp_path), read_only=True)
    target = ckpt.abstract_like(state, rp.Replicator().mirrored_sharding)
    step, _ = manager.restore_latest_good(lambda s: manager.restore(s, target))
    assert step == 1
    assert "step 2" in caplog.text and "falling back" in caplog.text
    with pytest.raises(ckpt.CorruptCheckpointError, match="step 2"):
        manager.restore_latest_good(lambda s: manager.restore(s, target), strict=True)


def test_shape_mismatch_names_the_parameters(tmp_path):
    save_steps(tmp_path, [(1, None)])
    manager = ckpt.Checkpoints(str(tmp_path), read_only=True)
    other = ckpt.abstract_like(small_state(width=5), rp.Replicator().mirrored_sharding)
    with pytest.raises(
        ckpt.CheckpointMismatchError,
        match=r"params/dense/bias: saved shape \(3,\), expected \(5,\)",
    ):
        manager.restore(1, other)
    with pytest.raises(ckpt.CheckpointMismatchError, match="params/dense/kernel"):
        manager.restore_params(1, other.params)


def test_best_n_retention_keeps_latest_and_best(tmp_path):
    accuracies = {1: 0.5, 2: 0.9, 3: 0.6, 4: 0.95, 5: 0.7, 6: 0.4, 7: 0.3}
    save_steps(
        tmp_path, [(s, {"accuracy": a}) for s, a in accuracies.items()], max_to_keep=2, keep_best=2
    )
    assert ckpt.Checkpoints(str(tmp_path), read_only=True).all_steps() == [2, 4, 6, 7]


def test_sidecar_metrics_feed_best_n(tmp_path):
    save_steps(tmp_path, [(1, None), (2, None)], max_to_keep=2, keep_best=1)
    manager = ckpt.Checkpoints(str(tmp_path), max_to_keep=2, keep_best=1)
    manager.write_metrics(1, {"accuracy": 0.99})  # as `eval --follow` does, later
    manager.write_metrics(2, {"accuracy": 0.10})
    for step, accuracy in ((3, 0.2), (4, 0.3)):
        manager.save(
            step, small_state(), data_state={}, config_json="{}", metrics={"accuracy": accuracy}
        )
    manager.close()
    # Latest 2 are {3, 4}; the best is step 1, known only from the sidecar's metrics.
    assert ckpt.Checkpoints(str(tmp_path), read_only=True).all_steps() == [1, 3, 4]


def test_failed_async_save_is_raised_and_keeps_previous(tmp_path, monkeypatch):
    from orbax.checkpoint._src.path import async_path

    state = save_steps(tmp_path, [(1, None)])
    real_rename = async_path.rename

    async def full_disk(src, dst):
        if str(dst).endswith("/2"):
            raise OSError(errno.ENOSPC, "No space left on device", str(dst))
        return await real_rename(src, dst)

    monkeypatch.setattr(async_path, "rename", full_disk)
    manager = ckpt.Checkpoints(str(tmp_path))
    manager.save(2, state, data_state={}, config_json="{}")
    with pytest.raises(Exception, match="No space left"):
        manager.wait()
    monkeypatch.setattr(async_path, "rename", real_rename)
    reader = ckpt.Checkpoints(str(tmp_path), read_only=True)
    assert reader.all_steps() == [1]
    restored, _ = reader.restore(1, ckpt.abstract_like(state, rp.Replicator().mirrored_sharding))
    np.testing.assert_array_equal(restored.params["dense"]["kernel"], 1.0)


def test_config_differences_are_listed():
    diffs = ckpt.config_differences(
        {"lr": 0.1, "model": {"w": 64}, "mesh": {"data": -1}},
        {"lr": 0.2, "model": {"w": 64}, "mesh": {"data": -1}},
    )
    assert diffs == ["lr: 0.1 -> 0.2"]


def test_sidecar_follow_evaluates_every_checkpoint(tmp_path, digits_data_dir):
    from tests.test_train import load_config

    config = load_config(
        data_dir=digits_data_dir,
        num_train_steps=6,
        checkpoint_every_steps=2,
        eval_every_steps=6,
        keep_best_checkpoints=1,
    )
    final = train.train_and_evaluate(config, str(tmp_path), quiet=True)
    results = train.follow(config, str(tmp_path), devices=jax.devices()[:3], timeout_s=2)
    assert [r["step"] for r in results] == [2, 4, 6]
    assert all(r["num_examples"] == 360 for r in results)
    assert results[-1]["accuracy"] == pytest.approx(final["accuracy"])
    sidecar = [r for r in eval_records(tmp_path)[1] if r.get("sidecar")]
    assert [r["step"] for r in sidecar] == [2, 4, 6]
    metrics = json.loads((tmp_path / "checkpoints" / "4" / "metrics" / "metrics").read_text())
    assert metrics["accuracy"] == results[1]["accuracy"]
