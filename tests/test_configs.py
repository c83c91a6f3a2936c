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
import shlex
import sys
import time

import ml_collections
import pytest
import tensorflow_datasets as tfds
from absl import flags
from ml_collections import config_flags

from replicator import trainer
from replicator.trainer import config as config_lib
from replicator.trainer import config_files, data
from tests.helpers.configs import CONFIG_DIR, ROOT, load_config, read_records

# Where the post-training configs start: examples/post_training/tiny_llama.py's model,
# and the SFT run's export of it.
POST_TRAINING = ("hf:runs/tiny-llama", "hf:runs/sft_tiny/hf")
CONFIG_PATHS = sorted(CONFIG_DIR.glob("*.py"))
# Configs whose two steps run with make test-slow: the same experiment as a config kept
# fast (digits_cnn, cifar10_resnet, lm_tiny, digits_nnx_cnn), or with tests of its own
# (llama_tiny: tests/test_llama.py; the post-training ones: tests/test_post_training.py
# runs SFT and DPO with LoRA by their documented commands, tests/test_lora.py LoRA steps).
SLOW_CONFIGS = {
    "gan_digits", "cifar10_cnn", "fashion_mnist_cnn", "mnist_cnn", "digits_cnn_diloco",
    "lm_tiny_diloco", "lm_8b", "llama3_8b", "digits_vit", "lm_1b", "lm_gpt2_124m",
    "cifar10_resnet", "llama_tiny", "mixtral_8x7b", "qwen3_30b_a3b",
    "sft_llama_tiny", "dpo_llama_tiny", "lora_llama3_8b",  # tests/test_post_training.py
}  # fmt: skip
NUM_MOCK_EXAMPLES = 24  # Not a multiple of the smoke batches: eval pads and masks.
DOWNLOADED = ("mnist", "fashion_mnist", "cifar10")  # the rest are built offline, here


def from_a_tiny_llama(config, tmp_path) -> ml_collections.ConfigDict:
    """A post-training config (docs/pretrained.md's path) with the tiny Llama it starts
    from written into ``tmp_path``, its data by absolute path (the test's cwd is any)."""
    from tests.helpers import tiny_hf

    model, start = tiny_hf.write_tiny_llama(str(tmp_path / "tiny-llama")), config.init_from[3:]
    with config.unlocked():
        config.init_from = f"hf:{model}"
        config.tokenizer = f"{model}/tokenizer.json"
        config.dataset = config.dataset.replace(f"tokenizer={start}", f"tokenizer={model}")
        config.dataset = config.dataset.replace("files=examples/", f"files={ROOT}/examples/")
        config.data_dir = str(tmp_path / "tfds")
    return config


def test_configs_exist():
    names = {path.stem for path in CONFIG_PATHS}
    assert SLOW_CONFIGS <= names, SLOW_CONFIGS - names  # a renamed config stays slow
    assert {"digits_cnn", "mnist_cnn", "fashion_mnist_cnn", "cifar10_cnn"} <= names
    assert {"cifar10_resnet", "lm_tiny", "lm_gpt2_124m", "lm_1b", "gan_digits"} <= names


@pytest.mark.parametrize("path", CONFIG_PATHS, ids=lambda path: path.stem)
def test_config_is_valid_and_documented(path):
    for mode in ("", "smoke"):
        config = config_files.read_config_file(str(path), *([mode] if mode else []))
        # Every key of the schema and of its experiment's, so every key can be overridden
        # on every config (the config as the command line reads it: `config_lib.complete`).
        declared = config_lib.experiment_keys(config.experiment)
        assert set(config.keys()) == set(config_lib.SCHEMA) | set(declared.options)
        assert set(config.model.keys()) == set(declared.model)
        assert set(config.mesh.keys()) >= set(declared.mesh_axes)
        config_lib.validate(config)
        config_lib.validate(load_config(path, mode))  # as a file gives it: defaults filled in
    smoke = load_config(path, "smoke")
    assert smoke.num_train_steps <= 10 and smoke.batch_size <= 64
    module_doc = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(module_doc)
    module_doc.loader.exec_module(module)
    assert f"python -m replicator train --config configs/{path.name}" in module.__doc__
    assert "Expected:" in module.__doc__
    assert re.search(r"\d+ (s|seconds|min|minutes)\b", module.__doc__), "say the runtime"


@pytest.mark.parametrize(
    "path",
    [
        pytest.param(p, marks=pytest.mark.slow) if p.stem in SLOW_CONFIGS else p
        for p in CONFIG_PATHS
    ],
    ids=lambda path: path.stem,
)
def test_config_trains_two_steps(path, tmp_path, digits_data_dir):
    config = load_config(path, "smoke")
    config.num_train_steps = 2
    workdir = tmp_path / "run"
    if config.init_from in POST_TRAINING:  # the post-training configs: a tiny Llama's
        config = from_a_tiny_llama(config, tmp_path)
        result = trainer.train_and_evaluate(config, str(workdir), quiet=True)
    elif config.dataset not in DOWNLOADED:
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
    [p for p in CONFIG_PATHS if load_config(p, "").dataset in DOWNLOADED],
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
    "experiment": "experiments.classify",  # (an LM config: experiments.lm, its own keys kept)
    "model": "{'num_classes': 3}",
    "dataset": "digits/other",
    "data_dir": "/tmp/tfds",
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
    overrides = dict(OVERRIDES)
    if path.stem in LM_CONFIGS:  # another experiment would not know the LM's keys
        overrides.update(experiment="experiments.lm", model="{'num_layers': 3}")
        overrides["objective"] = "lm"  # (a preference objective wants preference data)
    argv = [f"--config.{key}={value}" for key, value in overrides.items()]
    saved = json.loads(config_lib.to_json(config_lib.validate(parse(path, argv, monkeypatch))))
    for key, value in overrides.items():
        expected = value
        if value[0] in "({":
            expected = json.loads(json.dumps(ast.literal_eval(value)))
        elif value in ("True", "False"):
            expected = value == "True"
        elif key != "profile_steps" and re.fullmatch(r"[\d.]+", value):
            expected = float(value) if "." in value else int(value)
        if key == "model":  # the model keys the override left out: at their defaults
            assert saved[key] == {**saved[key], **expected}, key
            continue
        assert saved[key] == expected, key
    # A sub-key of a key the config file sets is overridden alone.
    assert parse(path, ["--config.mesh.data=3"], monkeypatch).mesh.data == 3


def parse(path: pathlib.Path, argv: list[str], monkeypatch) -> ml_collections.ConfigDict:
    """The config as ``python -m replicator train --config PATH:smoke ARGV`` reads it (the
    file's config with its experiment's keys, `config_files.read_config_file`)."""
    values = flags.FlagValues()
    config = config_files.read_config_file(str(path), "smoke")
    argv = ["prog", *config_files.write_overrides_as_literals(argv)]
    config_flags.DEFINE_config_dict("config", config, flag_values=values, sys_argv=argv)
    values(argv)
    return values.config


LM_CONFIGS = [p.stem for p in CONFIG_PATHS if load_config(p, "").experiment == "experiments.lm"]
# A command-line value for each of the LM's own keys (`experiments.lm.config`), the model's
# included, and its mesh axes.
LM_OVERRIDES = {
    "tokenizer": "/tmp/tokenizer.json", "pack_documents": "True", "remat_policy": "minimal",
    "pipeline_microbatches": "4", "pipeline_repeats": "2", "context_strategy": "ring",
    "context_load_balance": "True", "model.vocab_size": "300", "model.num_layers": "3",
    "model.num_heads": "3", "model.embed_dim": "48", "model.mlp_dim": "96",
    "model.max_len": "96", "model.positions": "rotary", "model.tie_embeddings": "False",
    "model.use_bias": "False", "model.dropout_rate": "0.125", "model.attention": "xla",
    "model.scan_layers": "False", "model.loss_chunk": "32", "model.num_experts": "6",
    "model.experts_per_token": "3", "model.expert_capacity_factor": "1.5",
    "model.moe_every": "3", "model.expert_routing": "gshard", "model.norm": "rmsnorm",
    "model.norm_eps": "0.125", "model.mlp_activation": "swiglu", "model.num_kv_heads": "1",
    "model.head_dim": "24", "model.rope_theta": "1234.5", "model.qkv_bias": "True",
    "model.rope_scaling": "{'factor': 2.0, 'low_freq_factor': 1.0, 'high_freq_factor': 4.0, "
    "'original_max_position_embeddings': 48}",
    "objective": "ipo", "dpo_beta": "0.25", "dpo_label_smoothing": "0.125",
    "simpo_gamma": "0.75", "model.lora_rank": "4", "model.lora_alpha": "8.5",
    "model.lora_dropout": "0.25", "model.lora_targets": "attention/q_kernel",
    "model.lora_quantize": "int8", "model.qk_norm": "True", "model.moe_balance_weight": "0.25",
    "model.moe_z_loss_weight": "0.125", "model.moe_balance_pooled": "True",
    "model.embed_scale": "True", "model.post_norms": "True", "model.attn_logit_softcap": "50.5",
    "model.final_logit_softcap": "30.5", "model.query_pre_attn_scalar": "144.5",
    "model.sliding_window": "40", "model.sliding_window_pattern": "6",
    "model.rope_local_theta": "10001.5",
    "mesh.stage": "3", "mesh.context": "5", "mesh.expert": "7",
}  # fmt: skip


@pytest.mark.parametrize("path", [CONFIG_DIR / f"{n}.py" for n in LM_CONFIGS], ids=str)
def test_every_lm_key_can_be_overridden_on_every_lm_config(path, monkeypatch):
    from experiments.lm import CONFIG_KEYS

    declared = {*CONFIG_KEYS.options, *(f"model.{k}" for k in CONFIG_KEYS.model)}
    declared |= {f"mesh.{axis}" for axis in CONFIG_KEYS.mesh_axes}
    assert set(LM_OVERRIDES) == declared, "give a new key a value here"
    config = parse(path, [f"--config.{k}={v}" for k, v in LM_OVERRIDES.items()], monkeypatch)
    for key, value in LM_OVERRIDES.items():
        got = config
        for part in key.split("."):
            got = got[part]
        got = got.to_dict() if isinstance(got, ml_collections.ConfigDict) else got
        assert got == ast.literal_eval(value if value[0] in "{TF0123456789" else repr(value))


# ---------------------------------------------------------------- what the docstrings say


def documented_commands(doc: str) -> list[list[str]]:
    """The ``python -m replicator ...`` commands a docstring shows (continued lines
    joined; a ``launch``'s command after its ``--``), and its inline
    ``--config.KEY=VALUE`` overrides, each as argv."""
    joined = re.sub(r"\\\n\s*", " ", doc)
    commands = [shlex.split(m) for m in re.findall(r"^\s*(python -m replicator .+)$", joined, re.M)]
    launched = [
        ["python", "-m", "replicator", *argv[argv.index("--") + 1 :]]
        for argv in commands
        if argv[3] == "launch"
        and "--" in argv
        and not argv[argv.index("--") + 1].startswith("python")
    ]
    inline = [shlex.split(m) for m in re.findall(r"``(--config\.[^`]+)``", joined)]
    return [c for c in commands if c[3] != "launch"] + launched + inline


def is_placeholder(value: str) -> bool:
    """A value a docstring leaves to the reader: ``N``, ``$((64 * N))``, ``...``."""
    return bool(re.fullmatch(r"[A-Z]+", value)) or "$" in value or "..." in value


def check_documented(argv: list[str], path: pathlib.Path, monkeypatch) -> None:
    """A documented command line parses as the CLI reads it: a known command and
    flags, a config file that exists, overrides of keys the config has (validated
    as the trainer would, where no value is left to the reader)."""
    from replicator.trainer import cli, config_files

    file, mode = str(path), []
    if argv[0] == "python":
        assert argv[1:3] == ["-m", "replicator"] and argv[3] in cli._FLAGS_OF, argv
        known = {holder.name for holder in cli._FLAGS_OF[argv[3]]}
        tokens = argv[4:]
        for i, token in enumerate(tokens):
            name = token[2:].split("=")[0] if token.startswith("--") else None
            if name == "config":
                given = token.split("=", 1)[1] if "=" in token else tokens[i + 1]
                file, _, given_mode = given.partition(":")
                file, mode = str(CONFIG_DIR.parent / file), [given_mode] if given_mode else []
                assert pathlib.Path(file).exists(), f"{argv}: no {file}"
            elif name is not None and not name.startswith("config."):
                assert name in known, f"{argv}: {argv[3]} has no flag --{name}"
        argv = tokens
    config = config_files.read_config_file(file, *mode)
    overrides = []
    for token in (t for t in argv if t.startswith("--config.")):
        key, has_value, value = token.removeprefix("--config.").partition("=")
        node = config
        for part in key.split("."):
            assert part in node, f"{token}: {path.name} has no key {key}"
            node = node[part]
        if has_value and not is_placeholder(value) and value != "None":
            overrides.append(token)
    argv = config_files.write_overrides_as_literals(["prog", *overrides])
    monkeypatch.setattr(sys, "argv", argv)  # ml_collections reads the overrides from there
    values = flags.FlagValues()
    config_flags.DEFINE_config_dict("config", config, flag_values=values, lock_config=True)
    values(argv)
    config_lib.validate(values.config)


@pytest.mark.parametrize("path", CONFIG_PATHS, ids=lambda path: path.stem)
def test_the_documented_commands_parse(path, monkeypatch):
    doc = ast.get_docstring(ast.parse(path.read_text()))
    commands = documented_commands(doc)
    assert any(c[:4] == ["python", "-m", "replicator", "train"] for c in commands)
    for argv in commands:
        check_documented(argv, path, monkeypatch)


def test_a_documented_command_with_a_stale_flag_is_caught(monkeypatch):
    path = CONFIG_DIR / "lm_tiny.py"
    for stale in (["--config.mesh.daat=2"], ["--cpu_device=8"], ["--config.batch_size=x"],
                  ["--config.learning_rate=-1.0"]):  # fmt: skip
        argv = ["python", "-m", "replicator", "train", "--config", "configs/lm_tiny.py", *stale]
        with pytest.raises((AssertionError, flags.Error, ValueError)):
            check_documented(argv, path, monkeypatch)


# (config, a regex over its docstring: the expected value, then the step; the metric;
# the tolerance). Each trains the config as documented (seed 0, the suite's 8 CPU
# devices) to that step and compares: a documented number cannot drift silently.
# All slow (make test-slow); make test checks that every documented command parses.
DOCUMENTED_RESULTS = [
    pytest.param(
        "lm_tiny",
        r"\(([\d.]+) at the\s+first record, step (\d+)\)",
        "train loss",
        0.05,
        marks=pytest.mark.slow,  # 10 steps, but 8 devices compile and evaluate: 20-70 s
    ),
    pytest.param(
        "lm_tiny",
        r"eval loss ([\d.]+) \(perplexity [\d.]+\) after (\d+) steps",
        "loss",
        0.01,
        marks=pytest.mark.slow,  # 100 steps: about 30 s on 2 idle cores
    ),
    pytest.param(
        "digits_cnn",
        r"\(([\d.]+)% with seed 0()",
        "accuracy",
        0.003,  # one scan of 360
        marks=pytest.mark.slow,  # 1,200 steps
    ),
    pytest.param(
        "digits_nnx_cnn",
        r"on 8 CPU devices,\s[^)]*?([\d.]+)% fp32()",
        "accuracy",
        0.003,
        marks=pytest.mark.slow,
    ),
]


@pytest.mark.parametrize("name, regex, metric, tolerance", DOCUMENTED_RESULTS,
                         ids=lambda x: str(x)[:20])  # fmt: skip
def test_a_config_reaches_what_its_docstring_says(name, regex, metric, tolerance, tmp_path,
                                                  digits_data_dir):  # fmt: skip
    path = CONFIG_DIR / f"{name}.py"
    found = re.search(regex, ast.get_docstring(ast.parse(path.read_text())))
    assert found, f"{path.name}'s docstring no longer says {regex!r}"
    config = load_config(path, "")
    expected = float(found.group(1)) / (100 if metric == "accuracy" else 1)
    steps = int(found.group(2) or config.num_train_steps)
    config.update(num_train_steps=steps, eval_every_steps=steps, checkpoint_every_steps=steps,
                  data_dir=digits_data_dir)  # fmt: skip
    result = trainer.train_and_evaluate(config, str(tmp_path), quiet=True)
    if metric.startswith("train "):
        first = next(r for r in read_records(tmp_path) if "split" not in r)
        assert first["step"] == steps
        got = first[metric.removeprefix("train ")]
    else:
        got = result[metric]
    assert got == pytest.approx(expected, abs=tolerance), f"{path.name} says {expected}"


@pytest.mark.slow  # the GAN's experiment has fast tests of its own
def test_gan_digits_logs_two_finite_losses(tmp_path, digits_data_dir):
    config = load_config(CONFIG_DIR / "gan_digits.py", "")
    config.update(num_train_steps=20, log_every_steps=5, eval_every_steps=20,
                  checkpoint_every_steps=20, data_dir=digits_data_dir)  # fmt: skip
    trainer.train_and_evaluate(config, str(tmp_path), quiet=True)
    records = read_records(tmp_path)
    train = [r for r in records if "split" not in r]
    assert [r["step"] for r in train] == [5, 10, 15, 20]
    assert all(math.isfinite(r["g_loss"]) and math.isfinite(r["d_loss"]) for r in train)
    assert records[-1]["split"] == "summary"
    assert (tmp_path / "samples" / "step_20.png").exists()
