"""Pipeline parallelism (`rp.pipeline`) over the mesh axis ``stage``.

The invariant: a pipelined stack of layers computes what the plain loop over the
same layers computes (values and gradients), for GPipe and circular schedules on
2 and 4 stages, beside data, fsdp and tensor, on both step paths; the LM trained
on a pipeline equals the LM trained on one device. The program holds the
schedule: ``collective-permute``s over ``stage`` and no parameter gathered over it.
"""

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import replicator as rp
from experiments.lm import make_experiment
from experiments.lm.task import make_preprocess
from replicator.compiled import hlo as hlo
from replicator.parallel.pipelining import bubble_fraction
from replicator.trainer.experiment import Settings
from tests.compare import assert_trained_alike

LAYERS, WIDTH, BATCH = 8, 16, 16
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _layer(p, h):
    return jnp.tanh(h @ p["w"] + p["b"]) + h


def _stack():
    keys = jax.random.split(jax.random.key(0), 3)
    params = {
        "w": jax.random.normal(keys[0], (LAYERS, WIDTH, WIDTH)) / np.sqrt(WIDTH),
        "b": 0.1 * jax.random.normal(keys[1], (LAYERS, WIDTH)),
    }
    return params, jax.random.normal(keys[2], (BATCH, WIDTH))


def _loop_loss(params, x):
    for i in range(LAYERS):
        x = _layer(jax.tree.map(lambda p, i=i: p[i], params), x)
    return jnp.mean(x**2)


@pytest.mark.parametrize(
    "stages, repeats, microbatches",
    [(2, 1, 2), (4, 1, 8), (2, 2, 4), (4, 2, 4), (2, 4, 2)],
)
def test_a_pipeline_computes_the_loop_over_its_layers(stages, repeats, microbatches):
    params, x = _stack()
    mesh = jax.make_mesh((8 // stages, stages), ("data", "stage"), axis_types=(AxisType.Auto,) * 2)

    def loss(params, x):
        y = rp.pipeline(_layer, params, x, microbatches=microbatches, repeats=repeats)
        return jnp.mean(y**2)

    with jax.set_mesh(mesh):
        placed = jax.device_put(params, NamedSharding(mesh, P("stage")))
        value, grads = jax.jit(jax.value_and_grad(loss))(placed, jax.device_put(x))
    expected, expected_grads = jax.value_and_grad(_loop_loss)(params, x)
    np.testing.assert_allclose(value, expected, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), grads, expected_grads)


def test_without_a_stage_axis_it_is_the_loop():
    params, x = _stack()
    y = rp.pipeline(_layer, params, x, microbatches=4)
    np.testing.assert_allclose(jnp.mean(y**2), _loop_loss(params, x), rtol=1e-6)


@pytest.mark.parametrize(
    "params, kwargs, message",
    [
        ({"w": jnp.ones((6, 2, 2))}, dict(microbatches=4), "6 layers do not split over 4 stages"),
        ({"w": jnp.ones((8, 2, 2))}, dict(microbatches=2), "at least 4"),
        ({"w": jnp.ones((8, 2, 2))}, dict(microbatches=4, repeats=4), "4 stages x 4 repeats"),
        ({"w": jnp.ones((8, 2, 2)), "b": jnp.ones((4, 2))}, dict(microbatches=4), "same leading"),
        ({"w": jnp.ones((8, 2, 2))}, dict(microbatches=5), "batch of 16 does not split"),
    ],
)
def test_a_schedule_that_cannot_run_is_one_line(params, kwargs, message):
    mesh = jax.make_mesh((2, 4), ("data", "stage"), axis_types=(AxisType.Auto,) * 2)
    with jax.set_mesh(mesh), pytest.raises(ValueError, match=message) as error:
        rp.pipeline(lambda p, h: h @ p["w"], params, jnp.ones((16, 2)), **kwargs)
    assert "\n" not in str(error.value)


def test_the_bubble_is_the_idle_share_of_the_iterations():
    assert bubble_fraction(4, 4) == 3 / 7
    assert bubble_fraction(4, 4, repeats=2) == 3 / 11  # the circular schedule's smaller bubble
    assert bubble_fraction(1, 8) == 0


# ------------------------------------------------------------------- the LM

TINY = dict(vocab_size=64, num_layers=4, num_heads=2, embed_dim=32, mlp_dim=64, max_len=32)


def _settings(repl, grad_accum_steps=1, **pipeline):
    return Settings(
        repl=repl, model=TINY, learning_rate=3e-3, optimizer="adam", num_train_steps=3,
        grad_accum_steps=grad_accum_steps, seed=0, options=pipeline,
    )  # fmt: skip


@pytest.fixture(scope="module")
def batches():
    rng = np.random.default_rng(0)
    preprocess = make_preprocess(TINY["max_len"])
    return [preprocess({"tokens": rng.integers(0, 64, (16, 33))}) for _ in range(3)]


def _train(repl, path, batches, **pipeline):
    experiment = make_experiment(_settings(repl, **pipeline))
    example = jax.tree.map(lambda x: x[0], batches[0])
    state = repl.init(experiment.init_state, jax.random.key(0), example)  # placed by the rules
    if path == "compile":
        step = repl.compile(experiment.train_step)
    else:
        step = lambda s, b: repl.run(experiment.train_step, s, b)  # noqa: E731
    losses = []
    for batch in batches:
        state, sums = step(state, repl.shard_batch(batch))
        if sums["loss"].ndim:
            sums = repl.reduce(rp.ReduceOp.SUM, sums)
        losses.append(float(sums["loss"]))
    return losses, jax.device_get(state.params)


@pytest.fixture(scope="module")
def one_device(batches):
    return _train(rp.Replicator(devices=jax.devices()[:1]), "compile", batches)


@pytest.mark.parametrize(
    "path, mesh, pipeline",
    [
        ("compile", {"stage": 2, "data": 4}, dict(remat_policy="full")),  # each layer remat
        pytest.param("run", {"stage": 4, "data": 2}, dict(pipeline_microbatches=4),
                     marks=pytest.mark.slow),
        pytest.param(
            "compile", {"stage": 2, "fsdp": 2, "tensor": 2},
            dict(pipeline_microbatches=2, pipeline_repeats=2), marks=pytest.mark.slow,
        ),
        pytest.param(
            "run", {"stage": 2, "fsdp": 2, "tensor": 2},
            dict(pipeline_microbatches=4, pipeline_repeats=2), marks=pytest.mark.slow,
        ),
        pytest.param(
            "compile", {"stage": 4, "fsdp": 2}, dict(pipeline_microbatches=8),
            marks=pytest.mark.slow,
        ),
        pytest.param("run", {"stage": 2, "data": 4}, {}, marks=pytest.mark.slow),
    ],
)  # fmt: skip
def test_the_lm_on_a_pipeline_trains_like_one_device(path, mesh, pipeline, batches, one_device):
    repl = rp.Replicator(mesh=mesh, min_size=0)  # every layer split over the stages
    losses, params = _train(repl, path, batches, **pipeline)
    np.testing.assert_allclose(losses, one_device[0], rtol=1e-6)
    assert_trained_alike(params, one_device[1])  # Adam's rare amplified rounding bounded


@pytest.mark.slow  # make test-slow: a faster test holds its invariant
@pytest.mark.parametrize("path", ["compile", "run"])
def test_gradient_accumulation_runs_the_schedule_per_microbatch(path, batches, one_device):
    repl = rp.Replicator(mesh={"stage": 2, "data": 4}, min_size=0)
    losses, params = _train(repl, path, batches, grad_accum_steps=2, pipeline_microbatches=2)
    np.testing.assert_allclose(losses, one_device[0], rtol=1e-6)
    assert_trained_alike(params, one_device[1])


@pytest.mark.slow
def test_a_pipeline_in_bf16_trains_like_one_device_in_bf16(batches):
    # Under run: XLA:CPU aborts compiling a partly manual program's bf16 collectives
    # (`ReplicaPrograms.manual_axes`), which compile's pipeline is; TPUs and GPUs do not.
    one = _train(rp.Replicator(devices=jax.devices()[:1], precision="bf16"), "compile", batches)
    repl = rp.Replicator(mesh={"stage": 2, "data": 4}, precision="bf16", min_size=0)
    losses, params = _train(repl, "run", batches)
    np.testing.assert_allclose(losses, one[0], rtol=2e-3)  # bf16 sums in other orders
    # Adam turns a bf16 rounding of a near-zero gradient into a step of up to the
    # learning rate (3e-3) either way: a few such elements (two runs, 3 steps: < 2e-2).
    assert_trained_alike(params, one[1], atol=1e-3, worst=2e-2, share=0.01)


def test_the_program_passes_activations_and_never_gathers_a_stage(batches):
    repl = rp.Replicator(mesh={"stage": 4, "data": 2}, min_size=0)  # every layer split
    experiment = make_experiment(_settings(repl, pipeline_microbatches=4))
    example = jax.tree.map(lambda x: x[0], batches[0])
    state = repl.init(experiment.init_state, jax.random.key(0), example)  # placed by the rules
    blocks = state.params["blocks"]
    assert all(x.sharding.spec[0] == "stage" for x in jax.tree.leaves(blocks))
    compiled = repl.compile(experiment.train_step).lower(state, repl.shard_batch(batches[0]))
    text = compiled.compile().as_text()
    report = hlo.analyze(text, repl.mesh)
    by_kind = {}
    for c in report.collectives:
        by_kind.setdefault(c.kind, set()).add(tuple(c.axes))
    assert ("stage",) in by_kind.get("collective-permute", set()), by_kind
    gathered_over_stage = [
        c for c in report.collectives if c.kind == "all-gather" and "stage" in c.axes
    ]
    assert not gathered_over_stage, gathered_over_stage
    # The gradients are summed over data once per step (XLA combines them into one
    # all-reduce), not in each of the schedule's 7 iterations; the input's gradient over
    # the stages once too.
    # (Per iteration they would be 8 over data and 9 over stage.)
    for axis, most in (("data", 1), ("stage", 3)):  # over stage: the output, the input
        summed = [c for c in report.collectives if c.kind == "all-reduce" and axis in c.axes]
        assert sum(c.count for c in summed if not c.in_branch) <= most, (axis, summed)
    assert re.search(r"collective-permute", text)


# --------------------------------------------------------------- the trainer


def _lm_config(data_dir, mesh, **overrides):
    from tests.helpers.configs import load_config

    config = load_config("lm_tiny", "smoke")
    config.model.update(num_layers=4)
    config.update(mesh=mesh, data_dir=data_dir, eval_every_steps=2, checkpoint_every_steps=2)
    config.update(keep_checkpoints=5, **overrides)
    return config


@pytest.fixture(scope="module")
def stdlib_dir(tmp_path_factory):
    from tests.test_lm import build

    path = str(tmp_path_factory.mktemp("tfds"))
    build("python_stdlib/modules_128", path)
    return path


def _eval_records(workdir):
    from tests.helpers.configs import read_records

    return {r["step"]: r for r in read_records(workdir) if r.get("split") == "test"}


@pytest.mark.slow
def test_a_run_on_4_stages_resumes_on_2_and_evaluates_on_1_device(tmp_path, stdlib_dir):
    """The layer stack is saved whole ``[layers, ...]``: a run checkpointed on 4 stages
    resumes on 2 and on none like the uninterrupted run, and its checkpoints evaluate on
    one device as they did on the pipeline."""
    from replicator import trainer

    four = {"stage": 4, "data": 2}
    straight = str(tmp_path / "straight")
    trainer.train_and_evaluate(
        _lm_config(stdlib_dir, four, pipeline_microbatches=4), straight, quiet=True
    )
    expected = _eval_records(straight)
    for mesh in ({"stage": 2, "data": 4}, {"data": 8}):
        resumed = str(tmp_path / "-".join(map(str, mesh.values())))
        config = _lm_config(stdlib_dir, four, pipeline_microbatches=4, num_train_steps=2)
        trainer.train_and_evaluate(config, resumed, quiet=True)
        trainer.train_and_evaluate(_lm_config(stdlib_dir, mesh), resumed, quiet=True)
        got = _eval_records(resumed)
        assert sorted(got) == sorted(expected) == [2, 4]
        assert got[4]["loss"] == pytest.approx(expected[4]["loss"], rel=1e-5)
    for step in (2, 4):
        one = trainer.evaluate(None, straight, step=step, devices=jax.devices()[:1])
        assert one["loss"] == pytest.approx(expected[step]["loss"], rel=1e-6)
        assert one["num_examples"] == expected[step]["num_examples"]


def test_a_schedule_the_config_cannot_run_is_one_line_from_the_command_line(tmp_path):
    import subprocess
    import sys

    command = [
        sys.executable, "-m", "replicator", "train", "--config", "configs/lm_tiny.py:smoke",
        "--workdir", str(tmp_path / "run"), "--config.mesh=dict(stage=4, data=2)",
        "--config.model.num_layers=2", "--config.num_train_steps=1",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 2, done.stderr[-2000:]
    (line,) = done.stderr.strip().splitlines()  # found by the config's validation
    assert line.startswith("error: ") and "pipeline: 2 layers do not split" in line
    assert "Traceback" not in done.stderr
