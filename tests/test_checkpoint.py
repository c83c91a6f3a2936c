"""Checkpoints: exact resume after SIGKILL/SIGTERM, restore anywhere, faults are loud."""

import errno
import inspect
import json
import os
import re
import shutil
import signal
import struct
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
from replicator import storage, trainer
from replicator.checkpoints import checkpoint as ckpt_lib
from replicator.step.state import TrainState
from replicator.trainer import config as config_lib
from tests.helpers.configs import read_records

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
    """The last checkpoint's parameters, read with plain Orbax (no replicator), as numpy;
    ``workdir`` a local path or an epath in a bucket."""
    directory = workdir / "checkpoints"
    step = max(int(d.name) for d in directory.iterdir() if d.name.isdigit())
    path = storage.path(directory / str(step) / "state")  # absolute; a gs:// URL unmangled
    handler = ocp.PyTreeCheckpointHandler()
    target = {"params": handler.metadata(path).tree["params"]}
    as_numpy = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), target)
    restored = ocp.Checkpointer(handler).restore(
        path, args=ocp.args.PyTreeRestore(target, restore_args=as_numpy, partial_restore=True)
    )
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


@pytest.mark.slow  # make test-slow: a faster test holds its invariant
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
    # Each step once in TensorBoard, with or without its restart rule, as if never killed.
    want = tensorboard_scalars(uninterrupted / "tensorboard")["train/loss"]
    assert [s for s, _ in want] == list(range(25, 301, 25))
    for purge in (True, False):
        assert tensorboard_scalars(workdir / "tensorboard", purge=purge)["train/loss"] == want


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


# ---- The Checkpoints class, as a custom loop uses it.


def small_state(width=3):
    params = {"dense": {"kernel": jnp.ones((4, width)), "bias": jnp.zeros(width)}}
    tx = optax.adam(1e-3)
    return TrainState(
        step=jnp.int32(7), params=params, opt_state=tx.init(params), rng=jax.random.key(1)
    )


def save_steps(directory, steps, **kwargs):
    manager = rp.Checkpoints(directory, rp.Replicator(), **kwargs)
    state = small_state()
    for step, metrics in steps:
        manager.save(step, state, {"iterator": "{}"}, config={"a": 1}, metrics=metrics)
    manager.close()
    return state


def reader(directory, devices=None):
    return rp.Checkpoints(directory, rp.Replicator(devices=devices), read_only=True)


def make_state():
    """A TrainState after one Adam step: params, Adam moments, a typed key, model state."""
    k1, k2 = jax.random.split(jax.random.key(0))
    params = {
        "dense": {"kernel": jax.random.normal(k1, (5, 3)), "bias": jnp.arange(3.0)},
        "embed": jax.random.normal(k2, (8, 6)),
    }
    tx = optax.adam(1e-2)
    state = rp.TrainState.create(
        params, tx, jax.random.key(7), model_state={"mean": jnp.linspace(0.0, 1.0, 4)}
    )
    grads = jax.tree.map(lambda p: jnp.cos(p) + 0.1, params)
    return state.apply_gradients(grads, tx).replace(step=jnp.int32(1))


def host_leaves(tree):
    """``{path: numpy array}``, typed keys as their key data: comparable bit for bit."""

    def host(x):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        return np.asarray(x)

    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {jax.tree_util.keystr(p): host(x) for p, x in flat}


RESTORE_SCRIPT = """
directory, out = sys.argv[1:]
repl = rp.Replicator(devices=jax.devices()[:3])  # all there are: 1 or 3
ckpt = rp.Checkpoints(directory, repl, read_only=True)
restored = ckpt.restore(like=jax.eval_shape(make_state))
concrete = ckpt.restore(like=make_state(), step=ckpt.latest_step())
leaves = host_leaves(restored)
np.savez(out + ".npz", **leaves)
report = {
    "type": type(restored).__name__,
    "step": ckpt.restored_step,
    "devices": sorted({len(x.sharding.device_set) for x in jax.tree.leaves(restored)}),
    "same_from_concrete_like": all(
        np.array_equal(leaves[k], v, equal_nan=True) for k, v in host_leaves(concrete).items()
    ),
}
json.dump(report, open(out + ".json", "w"))
"""


@pytest.mark.slow  # make test-slow: the fast suite holds its invariant elsewhere
def test_restores_bitwise_onto_1_and_3_devices_in_fresh_processes(tmp_path):
    repl = rp.Replicator()  # 8 devices
    state = repl.replicate(make_state())
    # One leaf split over the 8 devices, as a sharded parameter is.
    embed = jax.device_put(state.params["embed"], repl.batch_sharding)
    state = state.replace(params={**state.params, "embed": embed})
    with rp.Checkpoints(tmp_path / "ckpt", repl) as ckpt:
        ckpt.save(1, state)
    expected = host_leaves(state)
    source = "\n".join(
        [
            "import json, sys\nimport jax, jax.numpy as jnp, numpy as np, optax",
            "import replicator as rp",
            inspect.getsource(host_leaves),
            inspect.getsource(make_state),
            RESTORE_SCRIPT,
        ]
    )
    procs = {}
    for n in (1, 3):
        env = dict(
            os.environ,
            XLA_FLAGS=f"--xla_force_host_platform_device_count={n}",
            JAX_PLATFORMS="cpu",
        )
        cmd = [sys.executable, "-c", source]
        cmd += [str(tmp_path / "ckpt"), str(tmp_path / f"out{n}")]
        procs[n] = subprocess.Popen(cmd, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    for n, proc in procs.items():
        _, err = proc.communicate(timeout=240)
        assert proc.returncode == 0, err[-3000:]
        report = json.loads((tmp_path / f"out{n}.json").read_text())
        assert report == {
            "type": "TrainState",
            "step": 1,
            "devices": [n],
            "same_from_concrete_like": True,
        }
        got = dict(np.load(tmp_path / f"out{n}.npz"))
        assert got.keys() == expected.keys()
        for key, value in expected.items():
            assert got[key].dtype == value.dtype and np.array_equal(got[key], value), key


def test_restore_places_leaves_on_the_replicator(tmp_path):
    save_steps(tmp_path, [(1, None)])
    for n in (1, 3, 8):
        ckpt = reader(tmp_path, jax.devices()[:n])
        restored = ckpt.restore(like=jax.eval_shape(small_state))
        assert restored.params["dense"]["kernel"].sharding == ckpt.repl.mirrored_sharding
        assert ckpt.saved_data_state(1) == {"iterator": "{}"}
        assert ckpt.saved_config(1) == {"a": 1}
        # Only the fields eval needs: the optimizer state is not read.
        like = jax.eval_shape(lambda: {"params": small_state().params, "model_state": None})
        part = ckpt.restore(like, partial=True)
        assert part["model_state"] is None and part["params"]["dense"]["bias"].shape == (3,)
        np.testing.assert_array_equal(restored.params["dense"]["kernel"], 1.0)
        assert (
            jax.random.key_data(restored.rng).tolist()
            == jax.random.key_data(small_state().rng).tolist()
        )
    # A leaf whose sharding is on the Replicator's devices keeps it.
    repl = rp.Replicator()
    split = jax.sharding.NamedSharding(repl.mesh, jax.sharding.PartitionSpec(None, "data"))
    like = jax.eval_shape(lambda: small_state(width=8))
    kernel = like.params["dense"]["kernel"]
    like.params["dense"]["kernel"] = jax.ShapeDtypeStruct(
        kernel.shape, kernel.dtype, sharding=split
    )
    with rp.Checkpoints(tmp_path / "wide", repl) as ckpt:
        ckpt.save(3, small_state(width=8))
        assert ckpt.restore(like).params["dense"]["kernel"].sharding == split
        assert ckpt.saved_data_state(3) is None


def test_keep_is_honoured_and_latest_step(tmp_path):
    ckpt = rp.Checkpoints(tmp_path, rp.Replicator(), keep=2)
    assert ckpt.latest_step() is None
    for step in range(1, 6):
        ckpt.save(step, small_state())
    ckpt.wait()
    assert ckpt.latest_step() == 5
    assert ckpt.all_steps() == [4, 5]
    ckpt.close()
    assert sorted(os.listdir(tmp_path)) == ["4", "5"]


def test_no_checkpoint_is_a_file_not_found_error_naming_the_directory(tmp_path):
    ckpt = rp.Checkpoints(tmp_path / "none", rp.Replicator())
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / "none"))):
        ckpt.restore(like=small_state())
    save_steps(tmp_path / "some", [(2, None)])
    with pytest.raises(FileNotFoundError, match=r"step 5 .*available steps: \[2\]"):
        reader(tmp_path / "some").restore(like=small_state(), step=5)


def test_torn_tmp_checkpoint_is_ignored(tmp_path):
    save_steps(tmp_path, [(1, None)])
    torn = tmp_path / "2.orbax-checkpoint-tmp-1234"
    (torn / "state").mkdir(parents=True)
    (torn / "state" / "garbage").write_bytes(b"\0" * 10)
    assert reader(tmp_path).all_steps() == [1]


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
    ckpt = reader(tmp_path)
    restored = ckpt.restore(like=state)
    assert ckpt.restored_step == 1
    np.testing.assert_array_equal(restored.params["dense"]["kernel"], 1.0)
    (warning,) = [r.getMessage() for r in caplog.records if r.name == "replicator"]
    assert "step 2" in warning and "restored step 1 instead" in warning
    assert "\n" not in warning
    with pytest.raises(ckpt_lib.CorruptCheckpointError, match="step 2"):
        ckpt.restore(like=state, strict=True)


def garble(directory):
    """Overwrites every file under ``directory`` with random bytes; returns what it wrote."""
    written = {}
    for path in sorted(directory.rglob("*")):
        if path.is_file():
            written[path.relative_to(directory)] = os.urandom(max(path.stat().st_size, 16))
            path.write_bytes(written[path.relative_to(directory)])
    return written


DAMAGE = {
    "garbage state": lambda step: garble(step / "state"),
    "garbage everything": garble,
    "garbage iterator state": lambda step: garble(step / "data"),
    "no state": lambda step: shutil.rmtree(step / "state"),
    "empty": lambda step: [shutil.rmtree(step), step.mkdir()],
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_unreadable_newest_checkpoint_is_set_aside_and_its_step_saved_again(
    tmp_path, caplog, damage
):
    directory = tmp_path / "checkpoints"
    state = save_steps(directory, [(1, None), (2, None)])
    DAMAGE[damage](directory / "2")
    damaged = {p.relative_to(directory / "2"): p.read_bytes()
               for p in (directory / "2").rglob("*") if p.is_file()}  # fmt: skip

    ckpt = reader(directory)  # read-only (eval): skips it, moves nothing
    ckpt.restore(like=state)
    assert ckpt.restored_step == 1 and (directory / "2").is_dir()

    caplog.clear()
    ckpt = rp.Checkpoints(directory, rp.Replicator())
    restored = ckpt.restore(like=state)
    assert ckpt.restored_step == 1 and ckpt.saved_data_state(1) == {"iterator": "{}"}
    (warning,) = [r.getMessage() for r in caplog.records if r.name == "replicator"]
    assert "step 2" in warning and "\n" not in warning
    assert f"moved it to {tmp_path}/checkpoints.corrupt/2 and restored step 1" in warning
    moved = tmp_path / "checkpoints.corrupt" / "2"
    assert {p: (moved / p).read_bytes() for p in damaged} == damaged  # kept as it was
    assert ckpt.all_steps() == [1]

    ckpt.save(2, restored, {"iterator": "{}"})  # the redone step: no StepAlreadyExistsError
    ckpt.wait()
    assert ckpt.all_steps() == [1, 2]
    ckpt.restore(like=state)
    assert ckpt.restored_step == 2
    ckpt.close()


def test_saving_a_step_that_exists_moves_the_old_one_aside(tmp_path, caplog):
    directory = tmp_path / "checkpoints"
    state = save_steps(directory, [(1, None), (2, None)])
    ckpt = rp.Checkpoints(directory, rp.Replicator())
    restarted = ckpt.restore(like=state, step=1)  # a custom loop going back to step 1
    restarted = restarted.replace(params=jax.tree.map(lambda x: x + 5, restarted.params))
    ckpt.save(2, restarted)
    ckpt.wait()
    np.testing.assert_array_equal(ckpt.restore(like=state).params["dense"]["kernel"], 6.0)
    assert any("moved it to" in r.getMessage() for r in caplog.records)
    old = reader(tmp_path / "checkpoints.replaced")
    np.testing.assert_array_equal(old.restore(like=state).params["dense"]["kernel"], 1.0)
    ckpt.close()


def tensorboard_scalars(directory, *, purge=True):
    """``{tag: [(step, value), ...]}`` as TensorBoard's Python loader reads an event
    directory: files in name order, and a ``SessionLog.START`` event at step s (a
    restart) purges every event of steps >= s read before it. ``purge=False`` reads
    the records as they are (a loader that knows no restarts)."""
    from tensorboardX.proto.event_pb2 import Event, SessionLog

    scalars = {}
    for path in sorted(directory.iterdir()):
        data, pos = path.read_bytes(), 0
        while pos + 12 <= len(data):
            (length,) = struct.unpack("<Q", data[pos : pos + 8])
            event = Event.FromString(data[pos + 12 : pos + 12 + length])
            pos += 12 + length + 4
            if purge and event.session_log.status == SessionLog.START:
                for tag, points in scalars.items():
                    scalars[tag] = [(s, v) for s, v in points if s < event.step]
            for value in event.summary.value:
                scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return scalars


def test_tensorboard_shows_each_step_once_after_restarts(tmp_path):
    from replicator.trainer.writers import MetricWriter

    def run(resume_step, steps, value):
        writer = MetricWriter(str(tmp_path), resume_step=resume_step)
        for step in steps:
            writer.write(step, {"loss": value + step})
        # Killed: nothing closed; what was written is flushed record by record.

    run(0, range(1, 7), 100)  # killed before the first checkpoint...
    run(0, range(1, 5), 200)  # ...so started afresh, and killed after checkpoint 2
    run(2, range(3, 9), 300)  # resumed from step 2, to the end
    want = [(1, 201), (2, 202), *((s, 300 + s) for s in range(3, 9))]
    assert tensorboard_scalars(tmp_path / "tensorboard") == {"train/loss": want}
    assert tensorboard_scalars(tmp_path / "tensorboard", purge=False) == {"train/loss": want}
    assert [r["step"] for r in read_records(tmp_path)] == list(range(1, 9))


def test_mismatched_like_lists_paths_and_both_shapes(tmp_path):
    save_steps(tmp_path, [(1, None)])
    ckpt = reader(tmp_path)
    other = jax.eval_shape(lambda: small_state(width=5))
    with pytest.raises(
        ckpt_lib.CheckpointMismatchError,
        match=r"params/dense/bias: saved shape \(3,\), expected \(5,\)",
    ) as error:
        ckpt.restore(like=other)
    assert "params/dense/kernel: saved shape (4, 3), expected (4, 5)" in str(error.value)
    with pytest.raises(ckpt_lib.CheckpointMismatchError, match="params/dense/kernel"):
        ckpt.restore(like={"params": other.params}, partial=True)
    # Another structure: a parameter the checkpoint lacks, one it has that is not asked for.
    renamed = small_state()
    renamed = renamed.replace(params={"dense": renamed.params["dense"], "head": jnp.ones(2)})
    with pytest.raises(ckpt_lib.CheckpointMismatchError) as error:
        ckpt.restore(like=renamed.replace(opt_state=()))
    message = str(error.value)
    assert "params/head: missing from the checkpoint, expected shape (2,)" in message
    assert "opt_state/0/mu/dense/kernel: in the checkpoint (shape (4, 3))" in message


def test_per_replica_values_round_trip_through_a_checkpoint(tmp_path):
    repl = rp.Replicator()
    batch = repl.shard_batch(np.arange(16.0, dtype=np.float32))
    # Per-replica state as a pmap program keeps it: a different value on each replica.
    stats = repl.run(lambda b: b.sum(), batch)
    assert stats.shape == (8,)
    state = {
        "stats": stats,
        "w": repl.replicate(jnp.ones(3)),
        "host": rp.PerReplica(np.ones(8, np.float32)),
    }
    with rp.Checkpoints(tmp_path, repl) as ckpt:
        ckpt.save(1, state)
    restored = reader(tmp_path).restore(like=state)
    assert isinstance(restored["host"], rp.PerReplica)
    np.testing.assert_array_equal(restored["stats"], stats)

    def step(stats, host, batch):
        assert stats.shape == () and host.shape == ()  # each replica: its own row
        return stats + batch.sum(), host + rp.get_replica_context().replica_id

    stats, host = repl.run(step, restored["stats"], restored["host"], batch)
    np.testing.assert_array_equal(stats, 2 * np.arange(16.0).reshape(8, 2).sum(1))
    np.testing.assert_array_equal(host, 1 + np.arange(8))
    # Onto another number of replicas: an error that names both numbers.
    with pytest.raises(ckpt_lib.CheckpointMismatchError, match="8 rows.* 4 replicas"):
        reader(tmp_path, jax.devices()[:4]).restore(like=state)


def test_best_n_retention_keeps_latest_and_best(tmp_path):
    accuracies = {1: 0.5, 2: 0.9, 3: 0.6, 4: 0.95, 5: 0.7, 6: 0.4, 7: 0.3}
    save_steps(
        tmp_path,
        [(s, {"accuracy": a}) for s, a in accuracies.items()],
        keep=2,
        keep_best=2,
        best_metric="accuracy",
    )
    assert reader(tmp_path).all_steps() == [2, 4, 6, 7]
    with pytest.raises(ValueError, match="keep_best needs best_metric"):
        rp.Checkpoints(tmp_path / "other", rp.Replicator(), keep_best=1)


def test_sidecar_metrics_feed_best_n(tmp_path):
    save_steps(tmp_path, [(1, None), (2, None)], keep=2, keep_best=1, best_metric="accuracy")
    manager = rp.Checkpoints(tmp_path, rp.Replicator(), keep=2, keep_best=1, best_metric="accuracy")
    manager.write_metrics(1, {"accuracy": 0.99})  # as `eval --follow` does, later
    manager.write_metrics(2, {"accuracy": 0.10})
    for step, accuracy in ((3, 0.2), (4, 0.3)):
        manager.save(step, small_state(), metrics={"accuracy": accuracy})
    manager.close()
    # Latest 2 are {3, 4}; the best is step 1, known only from the sidecar's metrics.
    assert reader(tmp_path).all_steps() == [1, 3, 4]


def test_failed_async_save_is_raised_and_keeps_previous(tmp_path, monkeypatch):
    from orbax.checkpoint._src.path import async_path

    state = save_steps(tmp_path, [(1, None)])
    real_rename = async_path.rename

    async def full_disk(src, dst):
        if str(dst).endswith("/2"):
            raise OSError(errno.ENOSPC, "No space left on device", str(dst))
        return await real_rename(src, dst)

    monkeypatch.setattr(async_path, "rename", full_disk)
    manager = rp.Checkpoints(tmp_path, rp.Replicator())
    manager.save(2, state)
    with pytest.raises(Exception, match="No space left"):
        manager.wait()
    monkeypatch.setattr(async_path, "rename", real_rename)
    ckpt = reader(tmp_path)
    assert ckpt.all_steps() == [1]
    restored = ckpt.restore(like=state)
    np.testing.assert_array_equal(restored.params["dense"]["kernel"], 1.0)


def test_a_save_is_committed_only_after_its_before_commit_returned(tmp_path):
    state = small_state()
    manager = rp.Checkpoints(tmp_path, rp.Replicator())
    listed_during = []

    def upload_records():
        time.sleep(0.2)  # slower than the arrays: the commit has to wait for it
        listed_during.append(sorted(os.listdir(tmp_path)))

    manager.save(1, state, before_commit=upload_records)
    assert listed_during == []  # save returned without waiting for it
    manager.wait()
    assert listed_during and "1" not in listed_during[0]
    assert manager.all_steps() == [1]

    def fails():
        raise OSError("the bucket refused the records")

    manager.save(2, state, before_commit=fails)
    with pytest.raises(OSError, match="refused the records"):
        manager.wait()
    assert reader(tmp_path).all_steps() == [1]  # never listed without its records

    blocking = rp.Checkpoints(tmp_path / "sync", rp.Replicator(), async_save=False)
    blocking.save(1, state, before_commit=upload_records)  # runs it before it returns
    assert len(listed_during) == 2 and blocking.all_steps() == [1]


def guide_orbax_recipe():
    """The first python block of the guide's "Reading a checkpoint with Orbax alone"."""
    with open(os.path.join(ROOT, "docs", "guide.md")) as f:
        section = f.read().split("### Reading a checkpoint with Orbax alone\n", 1)[1]
    section = re.split(r"\n##+ ", section, maxsplit=1)[0]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.mark.slow  # make test-slow: a faster test holds its invariant
def test_guide_orbax_recipe_runs_as_written(tmp_path, digits_data_dir):
    recipe = guide_orbax_recipe()
    assert "replicator" not in recipe and recipe.count("runs/digits_cnn") == 1
    workdir = tmp_path / "digits_cnn"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    train_cmd = [sys.executable, "-m", "replicator", "train", "--config"]
    train_cmd += ["configs/digits_cnn.py:smoke", "--workdir", str(workdir)]
    train_cmd += [f"--config.data_dir={digits_data_dir}", "--quiet"]
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    done = subprocess.run(train_cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    check = (
        "\nimport sys\n"
        "assert 'replicator' not in sys.modules\n"
        "flat = jax.tree_util.tree_flatten_with_path(params)[0]\n"
        "np.savez(sys.argv[1], **{jax.tree_util.keystr(p): x for p, x in flat})\n"
        "print(step)\n"
    )
    script = recipe.replace("runs/digits_cnn", str(workdir)) + check
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"  # trained on 8
    out = tmp_path / "params.npz"
    done = subprocess.run(
        [sys.executable, "-c", script, str(out)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["4"]  # the smoke run's last step
    got = dict(np.load(out))
    reference = rp.Checkpoints(workdir / "checkpoints", rp.Replicator(), read_only=True)
    saved = ocp.PyTreeCheckpointHandler().metadata(workdir / "checkpoints" / "4" / "state")
    like = {"params": saved.tree["params"]}  # shapes, dtypes
    params = reference.restore(like, partial=True)["params"]
    expected = {
        jax.tree_util.keystr(p): np.asarray(x)
        for p, x in jax.tree_util.tree_flatten_with_path(params)[0]
    }
    assert got.keys() == expected.keys() and "['Conv_0']['kernel']" in got
    for key, value in expected.items():
        np.testing.assert_array_equal(got[key], value)


def test_config_differences_are_listed():
    diffs = config_lib.config_differences(
        {"lr": 0.1, "model": {"w": 64}, "mesh": {"data": -1}},
        {"lr": 0.2, "model": {"w": 64}, "mesh": {"data": -1}},
    )
    assert diffs == ["lr: 0.1 -> 0.2"]


def test_sidecar_follow_evaluates_every_checkpoint(tmp_path, digits_data_dir):
    from tests.helpers.configs import digits_config

    config = digits_config(
        data_dir=digits_data_dir,
        num_train_steps=6,
        checkpoint_every_steps=2,
        eval_every_steps=6,
        keep_best_checkpoints=1,
        best_metric="accuracy",
    )
    final = trainer.train_and_evaluate(config, str(tmp_path), quiet=True)
    results = trainer.follow(config, str(tmp_path), devices=jax.devices()[:3], timeout_s=2)
    assert [r["step"] for r in results] == [2, 4, 6]
    assert all(r["num_examples"] == 360 for r in results)
    assert results[-1]["accuracy"] == pytest.approx(final["accuracy"])
    sidecar = [r for r in eval_records(tmp_path)[1] if r.get("sidecar")]
    assert [r["step"] for r in sidecar] == [2, 4, 6]
    metrics = json.loads((tmp_path / "checkpoints" / "4" / "metrics" / "metrics").read_text())
    assert metrics["accuracy"] == results[1]["accuracy"]


GENERIC_RESTORE = """
import json, sys
import orbax.checkpoint as ocp
from etils import epath
manager = ocp.CheckpointManager(sys.argv[1])
step = manager.latest_step()
items = manager.restore(step)  # no args, no registry: Orbax alone
assert not [m for m in sys.modules if m.split(".")[0] in ("replicator", "experiments")]
on_disk = [p.name for p in (epath.Path(sys.argv[1]) / str(step)).iterdir() if p.is_dir()]
print(json.dumps({"step": step, "items": sorted(items.keys()), "on_disk": sorted(on_disk),
                  "before_commit": dict(items["before_commit"]), "metrics": dict(items["metrics"]),
                  "params": sorted(items["state"]["params"]),
                  "iterator": "iterator" in items["data"]}))
"""


@pytest.mark.parametrize("where", ["local", pytest.param("bucket", marks=pytest.mark.slow)])
def test_every_item_of_a_step_restores_with_orbax_alone(where, tmp_path, request, digits_data_dir):
    """A generic ``CheckpointManager(...).restore(step)`` in a process that never imports
    replicator reads every item the trainer saves (the guide's list of items)."""
    from tests.helpers.configs import digits_config

    workdir = request.getfixturevalue("bucket") + "/run" if where == "bucket" else str(tmp_path)
    config = digits_config(data_dir=digits_data_dir, num_train_steps=2, checkpoint_every_steps=2)
    config.update(eval_every_steps=2, keep_best_checkpoints=1, best_metric="accuracy")
    trainer.train_and_evaluate(config, workdir, quiet=True)
    done = subprocess.run(
        [sys.executable, "-c", GENERIC_RESTORE, f"{workdir}/checkpoints"],
        cwd=tmp_path,  # not the repository: replicator cannot be imported by accident
        env=dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=""),
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.splitlines()[-1])
    assert got["step"] == 2 and got["iterator"] and "Conv_0" in got["params"]
    assert got["items"] == got["on_disk"] == ["before_commit", "config", "data", "metrics", "state"]
    assert "accuracy" in got["metrics"]
    assert got["before_commit"] == {"before_commit": None}  # the trainer's upload returns nothing
    with open(os.path.join(ROOT, "docs", "guide.md")) as f:
        listed = f.read().split("Each checkpoint is a plain Orbax step directory:", 1)[1]
    listed = re.findall(r"^  (\w+)/", listed.split("```")[1], re.M)
    assert sorted(listed) == got["on_disk"]  # the guide lists what is on disk
