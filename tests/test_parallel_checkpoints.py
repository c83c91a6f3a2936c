"""Context and expert parallelism (issue 35) across layouts and on one mesh together.

The invariant: a checkpoint does not remember the mesh that wrote it. An LM run
checkpointed with its experts split over ``expert``, or its sequences over
``context``, resumes on another split of that axis, or on data parallelism alone,
like the uninterrupted run, and its checkpoints evaluate on one device as they did
on the mesh. And a mixture-of-experts LM on a mesh with both axes trains like the
same LM on one device.
"""

import shutil

import jax
import numpy as np
import pytest

import replicator as rp
from experiments.lm.task import make_preprocess
from tests.test_lm_parallel import MOE, TINY, _assert_trains_alike, _train

MOE_KEYS = dict(num_experts=4, experts_per_token=2, expert_capacity_factor=1.0, moe_every=2)
# One eval batch of 64 windows instead of the 584 of the test split: each run's
# evaluation then costs about a second, and the records name this split.
EVAL_SPLIT = "test[:64]"


@pytest.fixture(scope="module")
def stdlib_dir(tmp_path_factory):
    from tests.test_lm import build

    path = str(tmp_path_factory.mktemp("tfds"))
    build("python_stdlib/modules_128", path)
    return path


def _config(data_dir, mesh, model=None, **overrides):
    from tests.test_pipeline import _lm_config

    config = _lm_config(data_dir, mesh, eval_split=EVAL_SPLIT, **overrides)
    config.model.update(model or {})
    return config


def _records(workdir, split):
    from tests.helpers.configs import read_records

    return {r["step"]: r for r in read_records(workdir) if r.get("split") == split}


def _assert_resumes_anywhere_and_evaluates_on_one_device(tmp_path, config, saved_on, resumed_on):
    """Trains 4 steps on ``saved_on``; then 2 steps there, resumed for 2 more on each
    ``(mesh, step_path)`` of ``resumed_on``; then evaluates the first run's
    checkpoints on one device."""
    from replicator import trainer

    straight = str(tmp_path / "straight")
    trainer.train_and_evaluate(config(saved_on), straight, quiet=True)
    expected = _records(straight, EVAL_SPLIT)
    assert sorted(expected) == [2, 4]
    halfway = str(tmp_path / "halfway")
    trainer.train_and_evaluate(config(saved_on, num_train_steps=2), halfway, quiet=True)
    for mesh, step_path in resumed_on:
        resumed = str(tmp_path / f"{'-'.join(map(str, mesh.values()))}-{step_path}")
        shutil.copytree(halfway, resumed)
        trainer.train_and_evaluate(config(mesh, step_path=step_path), resumed, quiet=True)
        trained = _records(resumed, None)  # train records have no split
        assert sorted(trained) == [2, 4], "the second run did not resume at step 2"
        got = _records(resumed, EVAL_SPLIT)
        assert sorted(got) == [2, 4]
        assert got[2]["loss"] == expected[2]["loss"]  # the first run's, copied
        assert got[4]["loss"] == pytest.approx(expected[4]["loss"], rel=1e-5), (mesh, step_path)
    for step in (2, 4):
        one = trainer.evaluate(None, straight, step=step, devices=jax.devices()[:1])
        assert one["loss"] == pytest.approx(expected[step]["loss"], rel=1e-6), step
        assert one["num_examples"] == expected[step]["num_examples"] == 64
    return _records(straight, None)


# ------------------------------------------------------------------ across layouts


@pytest.mark.slow
def test_a_run_on_4_experts_resumes_on_2_and_on_none_and_evaluates_on_1_device(
    tmp_path, stdlib_dir
):
    """The experts' kernels are saved whole ``[experts, ...]``: a run checkpointed with
    them split 4 ways over ``expert`` resumes split 2 ways (both step paths), and on
    ``data`` alone, like the uninterrupted run; its checkpoints evaluate on one device as
    they did on the expert mesh. Capacity factor 1 drops tokens: the same ones on every
    layout, or the losses would part."""

    def config(mesh, **overrides):
        return _config(stdlib_dir, mesh, MOE_KEYS, **{"step_path": "compile", **overrides})

    trained = _assert_resumes_anywhere_and_evaluates_on_one_device(
        tmp_path,
        config,
        saved_on={"expert": 4, "data": 2},
        resumed_on=[({"expert": 2, "data": 4}, "compile"), ({"data": 8}, "compile"),
                    ({"expert": 2, "data": 4}, "run")],
    )  # fmt: skip
    assert all(0 < trained[step]["dropped_fraction"] < 1 for step in (2, 4))


@pytest.mark.slow
def test_a_run_on_a_2_way_ring_resumes_on_4_and_on_none_and_evaluates_on_1_device(
    tmp_path, stdlib_dir
):
    """Load balancing reorders the sequence inside the step only: a run checkpointed on a
    load-balanced 2-way ``context`` ring resumes on a 4-way one, and on ``data`` alone,
    like the uninterrupted run, on both step paths; its checkpoints evaluate on one
    device as they did on the ring."""

    def config(mesh, **overrides):
        return _config(
            stdlib_dir, mesh, **{"step_path": "compile", **overrides},
            context_strategy="ring", context_load_balance=True,
        )  # fmt: skip

    _assert_resumes_anywhere_and_evaluates_on_one_device(
        tmp_path,
        config,
        saved_on={"context": 2, "data": 4},
        resumed_on=[({"context": 4, "data": 2}, "compile"), ({"data": 8}, "compile"),
                    ({"context": 4, "data": 2}, "run")],
    )  # fmt: skip


# ------------------------------------------------------------------ both axes on one mesh

BOTH = {"context": 2, "expert": 2, "data": 2}


@pytest.fixture(scope="module")
def batches():
    rng = np.random.default_rng(0)
    preprocess = make_preprocess(TINY["max_len"])
    return [preprocess({"tokens": rng.integers(0, 64, (16, 33))}) for _ in range(3)]


@pytest.fixture(scope="module")
def one_device_moe(batches):
    return _train(rp.Replicator(devices=jax.devices()[:1]), "compile", batches, MOE)


@pytest.mark.slow
@pytest.mark.parametrize("path, strategy", [("compile", "ring"), ("run", "gather")])
def test_an_moe_lm_over_context_and_experts_trains_like_one_device(
    path, strategy, batches, one_device_moe
):
    """Each token's sequence split over ``context`` and its expert over ``expert``, on
    one mesh: the same tokens dropped, the same losses and parameters as one device."""
    repl = rp.Replicator(mesh=BOTH, min_size=0)
    got = _train(repl, path, batches, MOE, context_strategy=strategy)
    dropped = [r["dropped_fraction"] for r in got[0]]
    assert 0 < dropped[0] < 1
    np.testing.assert_allclose(dropped, [r["dropped_fraction"] for r in one_device_moe[0]])
    _assert_trains_alike(got, one_device_moe)


@pytest.mark.slow  # make test-slow: the fast suite holds its invariant elsewhere
def test_a_load_balanced_moe_lm_with_a_capacity_drops_what_one_device_drops(
    batches, one_device_moe
):
    """With a finite capacity, the tokens an expert keeps are those one device keeps,
    whatever order load balancing stores the sequence in (the queues follow the
    positions): the same drops, losses and parameters as one device."""
    repl = rp.Replicator(mesh=BOTH, min_size=0)
    got = _train(repl, "compile", batches, MOE, context_load_balance=True)
    dropped = [r["dropped_fraction"] for r in got[0]]
    np.testing.assert_allclose(dropped, [r["dropped_fraction"] for r in one_device_moe[0]])
    _assert_trains_alike(got, one_device_moe)
