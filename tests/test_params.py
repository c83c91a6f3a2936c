"""``python -m replicator params``: a model's parameter paths, and what the optimizer
keys do to them; a ``freeze`` or ``lr_mults`` that takes every parameter is a warning,
one written for the train state's paths an error that says so (issue 48)."""

from __future__ import annotations

import importlib.util
import logging
import os
import subprocess
import sys

import pytest

from replicator.errors import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CNN_PATHS = [
    "Conv_0/bias", "Conv_0/kernel", "Conv_1/bias", "Conv_1/kernel",
    "Dense_0/bias", "Dense_0/kernel", "Dense_1/bias", "Dense_1/kernel",
]  # fmt: skip


def _config(name: str, **overrides):
    spec = importlib.util.spec_from_file_location(name, f"{ROOT}/configs/{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config("smoke")
    config.update(overrides)
    return config


def _setup(config):
    from replicator.trainer import aot
    from replicator.trainer.setup import setup

    return setup(config, training=False, eval_source=[aot.example_shapes(config).example])


def test_the_command_lists_the_shipped_cnns_paths_and_writes_nothing(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "replicator", "params", "--config",
         f"{ROOT}/configs/digits_cnn.py", "--config.freeze=^(?!head/)"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0] == (
        "experiments.classify: 35,914 parameters in 8 arrays: 0 trained, 35,914 frozen by "
        "config.freeze='^(?!head/)'"
    )
    assert lines[1].split() == ["PATH", "SHAPE", "DTYPE", "SIZE", "FROZEN"]
    assert [line.split()[0] for line in lines[2:10]] == CNN_PATHS
    assert lines[3].split()[0] == "Conv_0/kernel" and "(3, 3, 1, 32)" in lines[3]
    # The guide's old linear probe, on a model without a head: said, with the count.
    (warning,) = [line for line in done.stderr.splitlines() if "freezes every" in line]
    assert "config.freeze='^(?!head/)'" in warning and "35,914 of 35,914" in warning
    assert os.listdir(tmp_path) == []  # no workdir, no log


def test_a_linear_probe_of_the_cnn_trains_its_last_layer_only():
    from replicator.trainer import parameter_table
    from replicator.trainer.optimizer import OptimizerSpec

    config = _config("digits_cnn", freeze="^(?!Dense_1/)")  # the guide's recipe (docs/F.md)
    run = _setup(config)
    spec = OptimizerSpec(freeze=config.freeze)
    (rows,) = parameter_table.state_rows(run.abstract_state, spec).values()
    assert [r.path for r in rows if not r.frozen] == ["Dense_1/bias", "Dense_1/kernel"]
    assert sum(r.size for r in rows if not r.frozen) == 650
    lines = parameter_table.report(run.config, run.abstract_state)
    assert lines[0].endswith("650 trained, 35,264 frozen by config.freeze='^(?!Dense_1/)'")
    assert "init_from_skip see the whole state's, under 'params/'" in lines[-1]


@pytest.mark.parametrize(
    "overrides, said",
    [
        ({"freeze": "."}, "config.freeze='.' freezes every parameter (35,914 of 35,914"),
        ({"lr_mults": (("/", 0.1),)}, "config.lr_mults: ('/', 0.1) takes every parameter"),
    ],
)
def test_a_key_that_takes_every_parameter_is_a_warning(overrides, said, caplog):
    with caplog.at_level(logging.WARNING, logger="replicator"):
        _setup(_config("digits_cnn", **overrides))
    assert [r.getMessage() for r in caplog.records if said in r.getMessage()]


def test_a_key_that_takes_some_parameters_is_no_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="replicator"):
        _setup(_config("digits_cnn", freeze="^Conv_", lr_mults=(("Dense_0/", 0.5),)))
    assert not [r for r in caplog.records if "every parameter" in r.getMessage()]


@pytest.mark.parametrize("key", ["freeze", "weight_decay_mask", "lr_mults"])
def test_a_regex_written_for_the_state_paths_says_which_paths_the_key_sees(key):
    regex = "^params/Dense_1/"
    value = ((regex, 0.1),) if key == "lr_mults" else regex
    config = _config("digits_cnn", **{key: value}, weight_decay=0.1)
    with pytest.raises(ConfigError, match=r"without 'params/': '\^Dense_1/'"):
        _setup(config)


def test_a_scanned_lm_decays_what_the_unrolled_one_does():
    # nn.scan stacks a block's LayerNorm scales and biases on a leading "layers" axis:
    # the default mask counts dimensions per layer, so they stay vectors, undecayed. The
    # q/k/v bias is split by heads ([3, heads, head_dim] a layer): a bias, never decayed.
    import re

    import jax
    import jax.numpy as jnp

    from experiments.lm import Transformer
    from replicator.trainer.optimizer import OptimizerSpec, describe
    from replicator.trainer.parameter_table import parameter_rows

    spec = OptimizerSpec(name="adamw", weight_decay=0.1)
    shape = dict(vocab_size=32, num_layers=3, num_heads=2, embed_dim=16, mlp_dim=32, max_len=8)
    tokens = jnp.zeros((1, 8), jnp.int32)
    decayed, lines, paths = [], [], set()
    for scan in (True, False):
        model = Transformer(**shape, scan_layers=scan)
        params = jax.eval_shape(model.init, jax.random.key(0), tokens)["params"]
        rows = parameter_rows(params, spec)
        decayed.append({re.sub(r"^block_\d+/", "blocks/", r.path) for r in rows if r.decayed})
        paths |= {re.sub(r"^block_\d+/", "blocks/", r.path) for r in rows}
        lines.append(describe(spec, params).split(": ", 1)[1])  # (the array counts differ)
    assert decayed[0] == decayed[1]
    assert lines[0] == lines[1]  # the log's count of decayed parameters too
    assert {"blocks/mlp/fc/kernel", "blocks/attention/out_kernel"} <= decayed[0]
    biases = ("ln_attention/scale", "ln_mlp/bias", "mlp/fc/bias", "attention/out_bias",
              "attention/qkv_bias")  # fmt: skip
    for bias in biases:
        assert f"blocks/{bias}" in paths and f"blocks/{bias}" not in decayed[0]
