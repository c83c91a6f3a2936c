"""The training driver and the command line, end to end on the offline digits."""

import json
import os

import jax
import ml_collections
import numpy as np
import pytest

from replicator import trainer
from replicator.trainer.setup import setup
from tests.helpers.cli import run_cli
from tests.helpers.configs import digits_config, read_records

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def trained(tmp_path_factory, digits_data_dir):
    workdir = str(tmp_path_factory.mktemp("run"))
    config = digits_config(
        data_dir=digits_data_dir,
        num_train_steps=6,
        eval_every_steps=3,
        checkpoint_every_steps=3,
        log_every_steps=3,
    )
    result = trainer.train_and_evaluate(config, workdir, quiet=True)
    return config, workdir, result


def test_train_writes_metrics_events_and_checkpoints(trained):
    config, workdir, result = trained
    records = read_records(workdir)
    train_records = [r for r in records if "split" not in r]
    assert [r["step"] for r in train_records] == [3, 6]
    for r in train_records:
        assert np.isfinite(r["loss"]) and r["examples_per_sec"] > 0
    evals = [r for r in records if r.get("split") == "test"]
    assert [r["step"] for r in evals] == [3, 6]
    assert all(r["num_examples"] == 360 for r in evals)
    assert evals[-1]["accuracy"] == result["accuracy"]
    assert sorted(os.listdir(os.path.join(workdir, "checkpoints")))[-2:] == ["3", "6"]
    assert any(f.startswith("events") for f in os.listdir(os.path.join(workdir, "tensorboard")))
    (summary,) = [r for r in records if r.get("split") == "summary"]
    phases = summary["wall_time_s"]
    assert {"setup", "compile", "compute", "input", "eval", "checkpoint"} <= set(phases)
    assert sum(v for k, v in phases.items() if k != "total") == pytest.approx(phases["total"], 0.01)
    assert summary["flops_per_step"] > 1e6  # the CNN's forward and backward on 64 digits
    # Mirrored on every device: the parameters, and Adam's two moments of the same size.
    params = jax.tree.leaves(setup(config).abstract_state.params)
    param_bytes = sum(x.size * x.dtype.itemsize for x in params)
    assert 3 * param_bytes <= summary["state_bytes_per_device"] <= 3 * param_bytes + 64
    assert 0 < summary["mfu"] < 1 and summary["peak_source"] == "measured f32 matmul"


@pytest.mark.parametrize("num_devices", [1, 3, 8])
def test_eval_restores_onto_any_device_count(trained, num_devices):
    config, workdir, result = trained
    got = trainer.evaluate(config, workdir, devices=jax.devices()[:num_devices])
    assert got["step"] == 6 and got["num_examples"] == 360
    assert got["accuracy"] == pytest.approx(result["accuracy"], abs=1e-9)
    assert got["loss"] == pytest.approx(result["loss"], rel=1e-5)


@pytest.mark.slow  # make test-slow: a faster test holds its invariant
def test_compile_path_trains_like_the_run_path(tmp_path, digits_data_dir):
    results = {}
    for path in ("run", "compile"):
        config = digits_config(data_dir=digits_data_dir, step_path=path)
        results[path] = trainer.train_and_evaluate(config, str(tmp_path / path), quiet=True)
    assert results["run"]["loss"] == pytest.approx(results["compile"]["loss"], rel=1e-4)
    assert results["run"]["accuracy"] == pytest.approx(results["compile"]["accuracy"], abs=0.01)


def test_eval_without_checkpoint_is_a_clear_error(tmp_path, digits_data_dir):
    with pytest.raises(FileNotFoundError, match="No readable checkpoint.*available steps: none"):
        trainer.evaluate(digits_config(data_dir=digits_data_dir), str(tmp_path / "empty"))


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"learning_rat": 0.1}, "unknown key 'learning_rat' \\(did you mean 'learning_rate'"),
        ({"batch_size": "64"}, "'batch_size'='64' has type str"),
        ({"batch_size": 60}, "batch_size=60 does not split evenly over 8 replicas"),
        ({"grad_accum_steps": 3}, "grad_accum_steps=3 does not divide the per-replica batch"),
        ({"step_path": "pmap"}, "'step_path'='pmap' is not one of"),
        ({"mesh": {"data": 3}}, "3 devices but 8"),
        ({"model": {"num_clases": 10}}, r"'model.num_clases' \(did you mean 'model.num_classes'"),
        ({"experiment": "experiments.nope"}, "experiments.nope' cannot be imported"),
        ({"experiment": "experiments.datasets"}, "has no make_experiment"),
        ({"best_metric": "perplexity"}, r"'perplexity' is not a metric .* \['accuracy'"),
    ],
)
def test_bad_config_fails_before_the_workdir_is_touched(
    tmp_path, digits_data_dir, overrides, match
):
    # As a config file would write it (ConfigDict's own type checks apply only to overrides).
    config = ml_collections.ConfigDict(
        {**digits_config(data_dir=digits_data_dir).to_dict(), **overrides}
    )
    workdir = tmp_path / "run"
    with pytest.raises(ValueError, match=match):
        trainer.train_and_evaluate(config, str(workdir), quiet=True)
    assert not workdir.exists()


@pytest.mark.parametrize(
    "change, match",
    [
        ("eval_step=None", "Experiment has no eval_step"),
        ("metric_names=()", "has metric_names=\\(\\); it needs a tuple"),
        ("metric_names=('accuracy', 'f1')", r"summarize reported .* without \['f1'\]"),
    ],
)
def test_an_experiment_that_breaks_the_protocol_is_named(
    tmp_path, monkeypatch, digits_data_dir, change, match
):
    name = f"broken_experiment_{len(change)}"  # a module per case: imports are cached
    (tmp_path / f"{name}.py").write_text(
        "import dataclasses\n"
        "from experiments.classify import make_experiment as classify\n"
        "def make_experiment(settings):\n"
        f"    return dataclasses.replace(classify(settings), {change})\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    config = digits_config(data_dir=digits_data_dir, experiment=name)
    config.update(num_train_steps=2, eval_every_steps=2)
    with pytest.raises(trainer.ConfigError, match=match):
        trainer.train_and_evaluate(config, str(tmp_path / "run"), quiet=True)


def test_missing_key_is_named(digits_data_dir):
    config = digits_config(data_dir=digits_data_dir)
    del config["batch_size"]
    with pytest.raises(ValueError, match="missing required key 'batch_size'"):
        setup(config)


def test_cli_train_then_eval(tmp_path, digits_data_dir):
    workdir = str(tmp_path / "run")
    common = [
        "--config",
        "configs/digits_cnn.py:smoke",
        "--workdir",
        workdir,
        f"--config.data_dir={digits_data_dir}",
    ]
    done = run_cli("train", *common, "--config.batch_size=32", "--quiet")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Final test metrics after 4 steps: loss" in done.stdout
    assert json.loads(open(f"{workdir}/config.json").read())["batch_size"] == 32

    done = run_cli("eval", *common, "--json", devices=3)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["step"] == 4 and result["num_examples"] == 360


def test_cli_rejects_unknown_override(tmp_path):
    done = run_cli(
        "train",
        "--config",
        "configs/digits_cnn.py:smoke",
        "--workdir",
        str(tmp_path / "run"),
        "--config.learning_rat=0.1",
    )
    assert done.returncode != 0
    assert "learning_rat" in done.stderr
    assert not (tmp_path / "run").exists()


def test_a_finished_run_rerun_only_evaluates_and_keeps_its_records(tmp_path, digits_data_dir):
    config = digits_config(data_dir=digits_data_dir, num_train_steps=4, eval_every_steps=2)
    first = trainer.train_and_evaluate(config, str(tmp_path), quiet=True)
    records = read_records(tmp_path)
    events = sorted(os.listdir(tmp_path / "tensorboard"))
    sizes = [os.path.getsize(tmp_path / "tensorboard" / name) for name in events]
    for _ in range(3):
        again = trainer.train_and_evaluate(config, str(tmp_path), quiet=True)
        assert again["accuracy"] == first["accuracy"] and again["step"] == 4
    assert read_records(tmp_path) == records  # one summary of training, no step repeated
    assert [r["steps"] for r in records if r.get("split") == "summary"] == [4]
    assert sorted(os.listdir(tmp_path / "tensorboard")) == events
    assert [os.path.getsize(tmp_path / "tensorboard" / name) for name in events] == sizes


def test_fsdp_min_size_zero_shards_every_parameter_from_the_config(digits_data_dir):
    config = digits_config(data_dir=digits_data_dir, mesh={"data": 4, "fsdp": 2}, fsdp_min_size=0)
    run = setup(config)
    assert run.repl.min_size == 0
    params = jax.tree.leaves(run.abstract_state.params)
    assert all("fsdp" in x.sharding.spec for x in params), [x.sharding.spec for x in params]
    default = setup(digits_config(data_dir=digits_data_dir, mesh={"data": 4, "fsdp": 2}))
    assert any(
        "fsdp" not in x.sharding.spec for x in jax.tree.leaves(default.abstract_state.params)
    )
