"""Flax NNX experiments in the trainer: the NNX tutorial's CNN as a classify variant.

The invariants: the NNX experiment's step on 8 replicas equals the global view;
its parameters and BatchNorm statistics live in `rp.TrainState` (``params`` /
``model_state``), so the smoke config trains through `train_and_evaluate` and
eval restores it on 1 and 3 devices with the same metrics; a precision policy
on an NNX module computes in bf16 from float32 parameters, keeps BatchNorm
statistics in float32 and writes the module's state changes back.
"""

from __future__ import annotations

import functools
import importlib.util
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import replicator as rp
from experiments.classify import make_experiment
from replicator import trainer
from replicator.trainer import Settings
from replicator.trainer.setup import setup

CONFIG = pathlib.Path(__file__).resolve().parent.parent / "configs" / "digits_nnx_cnn.py"
SMALL = dict(arch="nnx_cnn", conv_features=(8, 16), hidden_features=32)


def make_settings(repl: rp.Replicator, **model) -> Settings:
    # SGD: a gradient summed once too often would show as an update 8x too long.
    return Settings(
        repl=repl, model={**SMALL, **model}, learning_rate=0.05, optimizer="sgd",
        num_train_steps=3, grad_accum_steps=1, seed=0,
    )  # fmt: skip


def make_batch(size: int = 24, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "image": rng.uniform(size=(size, 8, 8, 1)).astype(np.float32),
        "label": rng.integers(0, 10, size).astype(np.int32),
    }


def init(experiment, repl: rp.Replicator) -> rp.TrainState:
    example = jax.tree.map(lambda x: x[0], make_batch(1))
    return repl.replicate(jax.jit(functools.partial(experiment.init_state, jax.random.key(0)))(
        example))  # fmt: skip


def variable_types(state: nnx.State) -> set[type]:
    return {type(v) for v in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable))}


def load_config(mode: str = "smoke", **overrides):
    spec = importlib.util.spec_from_file_location(CONFIG.stem, CONFIG)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config(mode)
    config.update(overrides)
    return config


def test_train_step_on_8_replicas_equals_the_global_view():
    repl = rp.Replicator()
    experiment = make_experiment(make_settings(repl, dropout_rate=0.0))
    start = init(experiment, repl)
    assert isinstance(start.params, nnx.State) and isinstance(start.model_state, nnx.State)
    assert variable_types(start.params) == {nnx.Param}
    assert variable_types(start.model_state) == {nnx.BatchStat}

    def train_step(state, batch):  # the sums added up over the replicas, as the trainer does
        state, sums = experiment.train_step(state, batch)
        return state, repl.reduce(rp.ReduceOp.SUM, sums)

    compiled = repl.compile(train_step)
    ends = {}
    for path in ("run", "compile"):
        state = start
        for seed in range(3):
            batch = repl.shard_batch(make_batch(seed=seed))
            if path == "run":
                state, sums = repl.run(train_step, state, batch)
            else:
                state, sums = compiled(state, batch)
        ends[path] = state, sums
    (run_state, run_sums), (compiled_state, compiled_sums) = ends["run"], ends["compile"]
    assert int(run_state.step) == 3
    kernel = lambda state: np.asarray(state.params["linear2"]["kernel"].get_value())
    assert not np.allclose(kernel(run_state), kernel(start))  # trained, not a no-op
    mean = run_state.model_state["batch_norm1"]["mean"].get_value()
    assert mean.shape == (8,) and np.abs(mean).max() > 0  # moved, one value on every replica
    for ours, theirs in [
        (run_state.params, compiled_state.params),
        (run_state.model_state, compiled_state.model_state),
        (run_sums, compiled_sums),
    ]:
        jax.tree.map(
            lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), ours, theirs
        )
    assert float(run_sums["count"]) == 24.0


@pytest.fixture(scope="module", params=[None, "bf16"], ids=["fp32", "bf16"])
def trained(request, tmp_path_factory, digits_data_dir):
    workdir = str(tmp_path_factory.mktemp("nnx_run"))
    config = load_config(data_dir=digits_data_dir, precision=request.param)
    result = trainer.train_and_evaluate(config, workdir, quiet=True)
    return config, workdir, result


@pytest.mark.slow  # make test-slow: a faster test holds its invariant
def test_smoke_config_trains_with_its_state_in_the_train_state(trained):
    config, workdir, result = trained
    assert result["step"] == config.num_train_steps and result["num_examples"] == 360
    assert np.isfinite(result["loss"])
    abstract = setup(config).abstract_state
    assert {x.dtype for x in jax.tree.leaves(abstract.params)} == {jnp.dtype("float32")}
    assert {x.dtype for x in jax.tree.leaves(abstract.model_state)} == {jnp.dtype("float32")}
    assert sorted(abstract.model_state["batch_norm2"]) == ["mean", "var"]


@pytest.mark.parametrize("num_devices", [1, 3])
def test_eval_restores_onto_any_device_count(trained, num_devices):
    config, workdir, result = trained
    got = trainer.evaluate(config, workdir, devices=jax.devices()[:num_devices])
    assert got["step"] == config.num_train_steps and got["num_examples"] == 360
    assert got["accuracy"] == pytest.approx(result["accuracy"], abs=1e-9)
    assert got["loss"] == pytest.approx(result["loss"], rel=1e-5)


class Block(nnx.Module):
    """Conv, BatchNorm, dropout with its own Rngs (RNG state in the module), Linear."""

    def __init__(self, rngs: nnx.Rngs):
        self.conv = nnx.Conv(1, 4, kernel_size=(3, 3), rngs=rngs)
        self.norm = nnx.BatchNorm(4, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=1))
        self.linear = nnx.Linear(4 * 8 * 8, 3, rngs=rngs)

    def __call__(self, x):
        x = self.dropout(nnx.relu(self.norm(self.conv(x))))
        return self.linear(x.reshape(x.shape[0], -1))


def equations(jaxpr: jax.extend.core.Jaxpr, names: set[str]) -> list:
    """The equations named ``names`` in ``jaxpr`` and every jaxpr nested in it."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in names:
            found.append(eqn)
        for param in eqn.params.values():
            for sub in param if isinstance(param, tuple | list) else (param,):
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    found += equations(sub.jaxpr, names)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    found += equations(sub, names)
    return found


def test_policy_on_an_nnx_module_computes_in_bf16_from_fp32_params():
    block = Block(nnx.Rngs(0))
    assert rp.apply_policy(block, "fp32") is block
    model = rp.apply_policy(block, "bf16")
    images = jnp.asarray(make_batch(4)["image"])
    graphdef, state = nnx.split(model)

    def grads_and_logits(state):
        def loss_fn(model):
            logits = model(images)
            return logits.sum(), logits

        model = nnx.merge(graphdef, state)
        grads, logits = nnx.grad(loss_fn, has_aux=True)(model)
        return grads, logits, nnx.state(model)

    jaxpr = jax.make_jaxpr(grads_and_logits)(state)
    ops = equations(jaxpr.jaxpr, {"conv_general_dilated", "dot_general"})
    assert len(ops) >= 4  # forward and backward
    for eqn in ops:
        assert {v.aval.dtype for v in eqn.invars} == {jnp.dtype("bfloat16")}, eqn

    grads, logits, new_state = jax.jit(grads_and_logits)(state)
    assert logits.dtype == jnp.float32  # the output dtype
    params = nnx.state(block, nnx.Param)
    assert jax.tree.structure(grads) == jax.tree.structure(nnx.state(model, nnx.Param))
    assert {x.dtype for x in jax.tree.leaves(grads)} == {jnp.dtype("float32")}
    assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype("float32")}

    nnx.jit(lambda model: model(images))(model)  # in place: the wrapped module's state moves
    assert block.norm.mean.get_value().dtype == jnp.float32
    assert np.abs(block.norm.mean.get_value()).max() > 0
    assert int(block.dropout.rngs.count.get_value()) == 1
    np.testing.assert_allclose(  # the traced call's statistics are the same numbers
        new_state["module"]["norm"]["mean"].get_value(), block.norm.mean.get_value(), rtol=1e-6
    )


@pytest.mark.parametrize("precision", ["bf16", pytest.param("fp16", marks=pytest.mark.slow)])
def test_experiment_under_a_policy_runs_convolutions_and_matmuls_in_low_precision(precision):
    repl = rp.Replicator(precision=precision)
    experiment = make_experiment(make_settings(repl))
    state = init(experiment, repl)
    batch = repl.shard_batch(make_batch())
    hlo = repl.lower(experiment.train_step, state, batch).as_text()
    low = {"bf16": "bf16", "fp16": "f16"}[precision]
    ops = [line for line in hlo.splitlines() if re.search(r"\.(convolution|dot_general)\b", line)]
    assert len(ops) >= 8  # 2 convolutions and 2 matmuls, forward and backward
    for line in ops:
        operands = re.search(r":\s*\((.*)\)\s*->", line).group(1)
        assert "f32" not in operands and low in operands, line
    state, _ = repl.run(experiment.train_step, state, batch)
    assert {x.dtype for x in jax.tree.leaves(state.params)} == {jnp.dtype("float32")}
    assert {x.dtype for x in jax.tree.leaves(state.model_state)} == {jnp.dtype("float32")}
    assert (state.loss_scale is not None) == (precision == "fp16")
