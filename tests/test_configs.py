"""Every config in configs/ trains end to end in its smoke mode.

The offline ``digits`` config runs on its real data; configs of datasets that
must be downloaded run on ``tfds.testing.mock_data``, which fakes their
examples with the right shapes and dtypes.
"""

import ast
import importlib.util
import json
import math
import pathlib
import re
import sys
import time

import ml_collections
import pytest
import tensorflow_datasets as tfds
from absl import flags
from ml_collections import config_flags

from replicator import trainer
from replicator.trainer import config as config_lib
from replicator.trainer import data

CONFIG_DIR = pathlib.Path(__file__).resolve().parent.parent / "configs"
CONFIG_PATHS = sorted(CONFIG_DIR.glob("*.py"))
NUM_MOCK_EXAMPLES = 24  # Not a multiple of the smoke batches: eval pads and masks.
DOWNLOADED = ("mnist", "fashion_mnist", "cifar10")  # the rest are built offline, here


def load_config(path: pathlib.Path, mode: str = "") -> ml_collections.ConfigDict:
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(mode)


def read_records(workdir: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def test_configs_exist():
    names = {path.stem for path in CONFIG_PATHS}
    assert {"digits_cnn", "mnist_cnn", "fashion_mnist_cnn", "cifar10_cnn"} <= names
    assert {"cifar10_resnet", "lm_tiny", "lm_gpt2_124m", "lm_1b", "gan_digits"} <= names


@pytest.mark.parametrize("path", CONFIG_PATHS, ids=lambda path: path.stem)
def test_config_is_valid_and_documented(path):
    reference = load_config(CONFIG_DIR / "digits_cnn.py")
    for mode in ("", "smoke"):
        config = load_config(path, mode)
        # Every key of the schema, so every key can be overridden on every config.
        assert set(config.keys()) == set(reference.keys()) == set(config_lib.SCHEMA)
        config_lib.validate(config)
    smoke = load_config(path, "smoke")
    assert smoke.num_train_steps <= 10 and smoke.batch_size <= 64
    module_doc = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(module_doc)
    module_doc.loader.exec_module(module)
    assert f"python -m replicator train --config configs/{path.name}" in module.__doc__
    assert "Expected:" in module.__doc__
    assert re.search(r"\d+ (s|seconds|min|minutes)\b", module.__doc__), "say the runtime"


@pytest.mark.parametrize("path", CONFIG_PATHS, ids=lambda path: path.stem)
def test_config_trains_two_steps(path, tmp_path, digits_data_dir):
    config = load_config(path, "smoke")
    config.num_train_steps = 2
    workdir = tmp_path / "run"
    if config.dataset not in DOWNLOADED:
        config.data_dir = digits_data_dir  # built offline, into the session's data_dir
        result = trainer.train_and_evaluate(config, str(workdir), quiet=True)
    else:
        config.data_dir = str(tmp_path / "tfds")  # Mocked: nothing is read from it.
        with tfds.testing.mock_data(num_examples=NUM_MOCK_EXAMPLES):
            result = trainer.train_and_evaluate(config, str(workdir), quiet=True)
        assert result["num_examples"] == NUM_MOCK_EXAMPLES
    assert result["step"] == 2 and result["num_examples"] > 0
    assert all(math.isfinite(v) for v in result.values() if isinstance(v, float))
    if "accuracy" in result:  # over exactly num_examples predictions: whole hits
        hits = result["accuracy"] * result["num_examples"]
        assert hits == pytest.approx(round(hits), abs=1e-6)
    records = read_records(workdir)
    assert [r["step"] for r in records if "split" not in r] == [2]
    (summary,) = [r for r in records if r.get("split") == "summary"]
    assert summary["state_bytes_per_device"] > 0
    assert (workdir / "checkpoints" / "2").exists()


@pytest.mark.parametrize(
    "path",
    [p for p in CONFIG_PATHS if load_config(p).dataset in DOWNLOADED],
    ids=lambda path: path.stem,
)
def test_config_of_a_dataset_that_is_not_prepared_fails_fast(path, tmp_path):
    config = load_config(path, "smoke")
    config.data_dir = str(tmp_path / "tfds")
    start = time.monotonic()
    with pytest.raises(data.DatasetNotPreparedError) as error:
        trainer.train_and_evaluate(config, str(tmp_path / "run"), quiet=True)
    assert time.monotonic() - start < 30, "must not try to download"  # loaded 2 cores: ~5 s
    assert f"tfds build {config.dataset} " in str(error.value)
    assert not (tmp_path / "run").exists()


# One command-line value per key, each unlike every config's own, valid for validate().
OVERRIDES = {
    "experiment": "experiments.classify",
    "model": "{'anything': 1}",
    "dataset": "digits/other",
    "data_dir": "/tmp/tfds",
    "tokenizer": "/tmp/tokenizer.json",
    "pack_documents": "True",
    "train_split": "train[:50%]",
    "eval_split": "train[50%:]",
    "batch_size": "48",
    "eval_batch_size": "96",
    "num_train_steps": "7",
    "learning_rate": "0.125",
    "optimizer": "sgd",
    "seed": "11",
    "grad_accum_steps": "3",
    "mesh": "{'data': 2, 'tensor': 4}",
    "dcn_mesh": "{'data': 2}",
    "rules": "(('embed', 'fsdp'), ('mlp', 'tensor'))",
    "fsdp_min_size": "0",
    "precision": "fp16",
    "matmul_precision": "highest",
    "remat_policy": "full",
    "pipeline_microbatches": "4",
    "pipeline_repeats": "2",
    "context_strategy": "ring",
    "context_load_balance": "True",
    "offload_optimizer_state": "True",
    "nonfinite": "skip",
    "step_path": "compile",
    "diloco": "{'inner_steps': 5}",
    "log_every_steps": "3",
    "eval_every_steps": "5",
    "checkpoint_every_steps": "6",
    "profile_steps": "2,3",
    "profile_port": "9999",
    "keep_checkpoints": "4",
    "keep_best_checkpoints": "2",
    "best_metric": "loss",
    "best_mode": "min",
    "optimizer_args": "{'momentum': 0.5}",
    "lr_schedule": "cosine",
    "warmup_steps": "2",
    "lr_end_fraction": "0.25",
    "weight_decay": "0.5",
    "weight_decay_mask": "kernel",
    "grad_clip_norm": "2.5",
    "grad_reduce_dtype": "bf16",
    "ema_decay": "0.75",
    "freeze": "Dense_0",
    "init_from": "/tmp/elsewhere:7",
    "init_from_rules": "(('^params/a/', 'params/b/'),)",
    "init_from_skip": "^params/Dense_1/",
    "lr_mults": "(('Dense_0', 0.5), ('kernel', 2))",
    "lr_base_batch_size": "256",
    "lr_batch_scaling": "sqrt",
    "writers": "('tensorboard', 'wandb')",
}


@pytest.mark.parametrize("path", CONFIG_PATHS, ids=lambda path: path.stem)
def test_every_key_can_be_overridden_from_the_command_line(path, monkeypatch):
    assert set(OVERRIDES) == set(config_lib.SCHEMA), "give a new key a value here"
    argv = [f"--config.{key}={value}" for key, value in OVERRIDES.items()]
    saved = json.loads(config_lib.to_json(config_lib.validate(parse(path, argv, monkeypatch))))
    for key, value in OVERRIDES.items():
        expected = value
        if value[0] in "({":
            expected = json.loads(json.dumps(ast.literal_eval(value)))
        elif value in ("True", "False"):
            expected = value == "True"
        elif key != "profile_steps" and re.fullmatch(r"[\d.]+", value):
            expected = float(value) if "." in value else int(value)
        assert saved[key] == expected, key
    # A sub-key of a key the config file sets is overridden alone.
    assert parse(path, ["--config.mesh.data=3"], monkeypatch).mesh.data == 3


def parse(path: pathlib.Path, argv: list[str], monkeypatch) -> ml_collections.ConfigDict:
    """The config as ``python -m replicator train --config PATH:smoke ARGV`` reads it."""
    values = flags.FlagValues()
    config_flags.DEFINE_config_file("config", flag_values=values)
    argv = ["prog", f"--config={path}:smoke", *argv]
    monkeypatch.setattr(sys, "argv", argv)  # ml_collections reads the overrides from there
    values(argv)
    return values.config


@pytest.mark.slow  # 13 s; every config's two steps run on every make test
def test_lm_tiny_learns_within_60_steps(tmp_path, digits_data_dir):
    config = load_config(CONFIG_DIR / "lm_tiny.py")
    config.update(num_train_steps=60, eval_every_steps=60, checkpoint_every_steps=60,
                  data_dir=digits_data_dir)  # fmt: skip
    result = trainer.train_and_evaluate(config, str(tmp_path), quiet=True)
    records = read_records(tmp_path)
    first_loss = next(r["loss"] for r in records if "split" not in r)
    assert result["step"] == 60 and result["loss"] < first_loss
    assert result["perplexity"] == pytest.approx(math.exp(result["loss"]), rel=1e-6)
    (summary,) = [r for r in records if r.get("split") == "summary"]
    assert summary["tokens_per_sec"] > 0 and summary["state_bytes_per_device"] > 0


def test_gan_digits_logs_two_finite_losses(tmp_path, digits_data_dir):
    config = load_config(CONFIG_DIR / "gan_digits.py")
    config.update(num_train_steps=20, log_every_steps=5, eval_every_steps=20,
                  checkpoint_every_steps=20, data_dir=digits_data_dir)  # fmt: skip
    trainer.train_and_evaluate(config, str(tmp_path), quiet=True)
    records = read_records(tmp_path)
    train = [r for r in records if "split" not in r]
    assert [r["step"] for r in train] == [5, 10, 15, 20]
    assert all(math.isfinite(r["g_loss"]) and math.isfinite(r["d_loss"]) for r in train)
    assert records[-1]["split"] == "summary"
    assert (tmp_path / "samples" / "step_20.png").exists()
