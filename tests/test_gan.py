"""experiments/gan: TF-Replicator's GAN on digits, on 8 fake CPU devices.

The invariants: 8 replicas train the two players exactly like 1 device and like
the global view (with latents drawn per example, so the samples do not depend
on the split); microbatches keep the model state mirrored; each replica draws
latents of its own by default; the sample score ranks real digits above noise;
the eval sums count every example once, whatever the padding; the config makes
the experiment, and its eval writes a grid of samples.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import math
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import matplotlib.image
import numpy as np
import pytest

import replicator as rp
from experiments.gan import GANConfig, make_experiment, preprocess
from experiments.gan.score import (
    fit_digits_classifier,
    load_digits_split,
    score_sums,
    summarize_scores,
    to_unit_range,
)
from experiments.gan.task import GRID_SIDE, draw_noise
from replicator.trainer.experiment import Experiment, Settings

CONFIG = pathlib.Path(__file__).resolve().parent.parent / "configs" / "gan_digits.py"
# A tiny GAN; latents per example so that 1 and 8 replicas draw the same ones.
TINY = dict(
    noise_dim=8,
    generator_features=(16, 8),
    discriminator_features=(8,),
    d_learning_rate=0.1,
    noise="example",
)
BATCH = 32  # 4 examples per replica


def make_settings(repl: rp.Replicator, model: dict, grad_accum_steps: int = 1) -> Settings:
    # SGD: a gradient summed once too often would show as an update 8x too long.
    return Settings(
        repl=repl, model=model, learning_rate=0.05, optimizer="sgd",
        num_train_steps=2, grad_accum_steps=grad_accum_steps, seed=0,
    )  # fmt: skip


@functools.cache
def digits(split: str) -> dict[str, np.ndarray]:
    images, _ = load_digits_split(split)
    return preprocess({"image": images})


def train_batch(step: int) -> dict[str, np.ndarray]:
    return jax.tree.map(lambda x: x[step * BATCH : (step + 1) * BATCH], digits("train"))


def init(experiment: Experiment, repl: rp.Replicator) -> Any:
    example = jax.tree.map(lambda x: x[0], digits("train"))
    # Runs once: XLA's optimisations would cost more than they save.
    init_state = jax.jit(
        experiment.init_state, compiler_options={"xla_backend_optimization_level": 0}
    )
    return repl.replicate(init_state(jax.random.key(0), example))


@functools.cache
def initial_state(grad_accum_steps: int = 1) -> Any:
    """The tiny GAN's initial state, made once on one device."""
    repl = rp.Replicator(devices=jax.devices()[:1])
    return init(make_experiment(make_settings(repl, TINY, grad_accum_steps)), repl)


def as_numbers(tree: Any) -> Any:
    """PRNG keys as their integer data, so that every leaf compares as numbers."""
    is_key = lambda x: jnp.issubdtype(x.dtype, jax.dtypes.prng_key)
    return jax.tree.map(lambda x: jax.random.key_data(x) if is_key(x) else x, tree)


def assert_trees_close(actual: Any, expected: Any, what: str, tol: float = 1e-5) -> None:
    actual, expected = as_numbers(actual), as_numbers(expected)
    assert jax.tree.structure(actual) == jax.tree.structure(expected), what
    check = lambda path, a, e: np.testing.assert_allclose(
        np.asarray(a), np.asarray(e), rtol=tol, atol=tol,
        err_msg=f"{what}{jax.tree_util.keystr(path)}",
    )  # fmt: skip
    jax.tree_util.tree_map_with_path(check, actual, expected)


@functools.cache
def train_two_steps(
    num_devices: int, path: str, grad_accum_steps: int = 1
) -> tuple[list[Any], list[dict]]:
    """The tiny GAN's states after each of two steps on ``path``, and its train records."""
    repl = rp.Replicator(devices=jax.devices()[:num_devices])
    experiment = make_experiment(make_settings(repl, TINY, grad_accum_steps))
    state, states, records = repl.replicate(initial_state(grad_accum_steps)), [], []
    compiled = repl.compile(experiment.train_step)

    def step(state, batch):
        if path == "compile":
            return compiled(state, batch)
        state, sums = repl.run(experiment.train_step, state, batch)
        return state, repl.reduce(rp.ReduceOp.SUM, sums)  # per-replica sums, added up

    for i in range(2):
        state, sums = step(state, repl.shard_batch(train_batch(i)))
        states.append(state)
        records.append(experiment.summarize(jax.device_get(sums)))
    return states, records


@pytest.mark.slow  # make test-slow: a faster test holds its invariant
def test_train_step_8_replicas_equal_1_device_and_compile():
    (_, reference), reference_records = train_two_steps(1, "run")
    for record in reference_records:
        assert set(record) == {"loss", "g_loss", "d_loss"}
        assert all(math.isfinite(v) for v in record.values()), record
    initial = initial_state()
    # Both players and both kinds of model state moved, so the comparison means something.
    moved = jax.tree.map(lambda a, b: not np.allclose(a, b), *as_numbers((reference, initial)))
    for name, tree in [("generator params", moved.generator.params),
                       ("discriminator params", moved.discriminator.params),
                       ("BatchNorm statistics", moved.generator.model_state),
                       ("power iteration", moved.discriminator.model_state)]:  # fmt: skip
        assert any(jax.tree.leaves(tree)), f"{name} did not change"

    for path in ("run", "compile"):
        (_, state), records = train_two_steps(8, path)
        # Mirrored, not stacked per replica: the same shapes as one device's.
        assert jax.tree.map(np.shape, state) == jax.tree.map(np.shape, reference), path
        assert_trees_close(state, reference, f"{path} on 8 devices: ")
        for record, expected in zip(records, reference_records):
            assert record == pytest.approx(expected, rel=1e-5, abs=1e-6), path


@pytest.mark.slow  # make test-slow: a faster test holds its invariant
def test_microbatches_keep_the_model_state_mirrored():
    """k microbatches: the discriminator's first update equals one batch's, its state mirrored.

    (The generator's differs by design: its BatchNorm normalises each microbatch.)
    """
    (one_batch, _), records = train_two_steps(8, "run")
    (microbatched, _), microbatched_records = train_two_steps(8, "run", grad_accum_steps=2)
    shapes = lambda state: [np.shape(x) for x in jax.tree.leaves(state)]
    assert shapes(microbatched) == shapes(one_batch)  # mirrored, not stacked per replica
    for part in ("params", "model_state"):
        assert_trees_close(
            getattr(microbatched.discriminator, part),
            getattr(one_batch.discriminator, part),
            f"discriminator {part}: ",
        )
    assert microbatched_records[0]["d_loss"] == pytest.approx(records[0]["d_loss"], rel=1e-5)


def test_each_replica_draws_latents_of_its_own():
    repl = rp.Replicator()
    key = repl.replicate(jax.random.key(3))
    seeds = repl.shard_batch(train_batch(0)["noise_seed"])
    draw = lambda key, seeds: draw_noise(key, seeds, 4, "replica")
    per_replica = np.asarray(repl.run(draw, key, seeds))  # [replicas, 4, 4]
    assert len({row.tobytes() for row in per_replica}) == repl.num_replicas
    # The global view is one replica: the key itself draws the whole batch.
    expected = jax.random.normal(jax.random.key(3), (BATCH, 4))
    np.testing.assert_allclose(repl.compile(draw)(key, seeds), expected)
    # Per example, a latent depends on the example alone, not on the split.
    by_example = lambda key, seeds: draw_noise(key, seeds, 4, "example")
    np.testing.assert_allclose(
        np.reshape(repl.run(by_example, key, seeds), (BATCH, 4)),
        repl.compile(by_example)(key, seeds),
    )


def test_score_ranks_real_digits_above_noise():
    classifier = fit_digits_classifier()
    assert classifier.test_accuracy > 0.95
    references = digits("test")["image"]
    rng = np.random.default_rng(0)
    candidates = {
        "real": digits("train")["image"][rng.permutation(1437)[:360]],
        "noise": rng.uniform(-1, 1, references.shape).astype(np.float32),
        "blank": -np.ones_like(references),
    }
    mask = np.ones(len(references))
    scores = {
        name: summarize_scores(score_sums(classifier, samples, references, mask))
        for name, samples in candidates.items()
    }
    assert scores["real"]["fid"] < 2 and scores["real"]["classifier_score"] > 9
    for name in ("noise", "blank"):
        assert scores[name]["fid"] > 50 * scores["real"]["fid"], scores
        assert scores[name]["classifier_score"] < 4, scores
    assert scores["blank"]["classifier_score"] == pytest.approx(1.0, abs=1e-3)  # one class
    same = summarize_scores(score_sums(classifier, references, references, mask))
    assert same["fid"] == pytest.approx(0.0, abs=1e-6)


def test_eval_sums_exact_under_padding():
    repl = rp.Replicator()
    experiment = make_experiment(make_settings(repl, TINY))
    (_, state), _ = train_two_steps(8, "run")
    eval_state = experiment.eval_state(state)
    split = digits("test")  # 360 scans

    # One unpadded batch of the whole split, in the global view.
    whole = {**split, "mask": np.ones(360, bool)}
    expected = repl.compile(experiment.eval_step)(eval_state, repl.shard_batch(whole))

    # Batches of 64 per replica run, the last one padded with junk that must count nowhere.
    rng, totals = np.random.default_rng(0), None
    for start in range(0, 360, 64):
        rows = {name: values[start : start + 64] for name, values in split.items()}
        pad = 64 - len(rows["image"])
        batch = {
            "image": np.concatenate([rows["image"], rng.normal(size=(pad, 8, 8, 1))]),
            "noise_seed": np.concatenate([rows["noise_seed"], rng.integers(0, 9, pad)]),
            "mask": np.arange(64) < 64 - pad,
        }
        batch = jax.tree.map(np.asarray, batch)
        batch["image"] = batch["image"].astype(np.float32)
        batch["noise_seed"] = batch["noise_seed"].astype(np.uint32)
        sums = repl.run(experiment.eval_step, eval_state, repl.shard_batch(batch))
        sums = repl.reduce(rp.ReduceOp.SUM, sums)
        totals = sums if totals is None else jax.tree.map(jnp.add, totals, sums)
    assert float(totals["count"]) == 360
    assert_trees_close(totals, expected, "padded batches vs one batch: ", tol=1e-4)
    got, want = experiment.summarize(totals), experiment.summarize(expected)
    assert set(got) == set(experiment.metric_names)
    assert got == pytest.approx(want, rel=1e-4)


def test_config_makes_the_experiment_and_sample_grids(tmp_path):
    spec = importlib.util.spec_from_file_location("gan_digits", CONFIG)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config("smoke")
    repl = rp.Replicator()
    settings = Settings(
        repl=repl, model=config.model.to_dict(), learning_rate=config.learning_rate,
        optimizer=config.optimizer, num_train_steps=config.num_train_steps,
        grad_accum_steps=config.grad_accum_steps, seed=config.seed,
    )  # fmt: skip
    experiment = make_experiment(settings)
    assert config.best_metric in experiment.metric_names
    state = init(experiment, repl)  # the steps are tested above, on the tiny GAN
    experiment.after_eval(experiment.eval_state(state), str(tmp_path), 2)
    grid = matplotlib.image.imread(tmp_path / "samples" / "step_2.png")
    side = GRID_SIDE * (8 * 4 + 1) + 1  # tiles of 32 px and 1 px gaps
    assert grid.shape[:2] == (side, side)
    assert grid[..., :3].std() > 0  # samples, not a blank page


def test_unknown_model_key_is_named():
    with pytest.raises(ValueError, match="noise_dims"):
        GANConfig.from_model({"noise_dims": 8})
    with pytest.raises(ValueError, match="'replica', 'example'"):
        GANConfig.from_model({"noise": "global"})


def test_the_judge_reads_the_tfds_split():
    from experiments.datasets import digits as builder
    from experiments.gan import score

    assert score._DIGITS_SPLIT_SEED == builder._SPLIT_SEED
    train, _ = load_digits_split("train")
    test, _ = load_digits_split("test")
    assert (len(train), len(test)) == (1437, builder.NUM_TEST_EXAMPLES)
    assert train.dtype == np.uint8 and train.shape[1:] == (8, 8, 1) and train.max() == 255


def test_preprocess_gives_each_scan_a_fixed_seed():
    images, _ = load_digits_split("train")
    batch = preprocess({"image": images[:5], "label": np.arange(5)})
    assert set(batch) == {"image", "noise_seed"}
    np.testing.assert_array_equal(batch["image"], to_unit_range(images[:5]))
    assert batch["image"].min() >= -1 and batch["image"].max() <= 1
    again = preprocess({"image": images[3:5]})["noise_seed"]
    np.testing.assert_array_equal(again, batch["noise_seed"][3:])
    assert len(set(digits("train")["noise_seed"].tolist())) == 1437  # no two scans share one
