"""The one training loop: ``train_and_evaluate(config, workdir)``, and ``evaluate``.

The loop reads the config (the only place that does) and hands explicit values
to the library: the Replicator (mesh, precision), the experiment (model, steps,
preprocessing), the input pipeline, the checkpoints and the metric writers.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import json
import logging
import os
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from replicator import config as config_lib
from replicator import data
from replicator.checkpoint import Checkpoints, abstract_like
from replicator.metrics import MetricWriter, ProgressBar, Stopwatch, summarize_sums
from replicator.replicator import ReduceOp, Replicator
from replicator.state import TrainState

log = logging.getLogger("replicator")


@dataclasses.dataclass
class Run:
    """What `setup` builds from a config: the pieces both train and eval need."""

    config: ml_collections.ConfigDict
    repl: Replicator
    experiment: ModuleType
    model: Any
    tx: optax.GradientTransformation
    abstract_state: TrainState
    eval_source: Any
    init_state: Callable[[], TrainState]


def setup(config: ml_collections.ConfigDict, *, devices=None) -> Run:
    """Validates ``config`` and builds the Replicator, model, optimizer and state shapes."""
    config = config_lib.validate(config)
    if config.grad_accum_steps != 1:
        raise ValueError(
            f"grad_accum_steps={config.grad_accum_steps}: gradient accumulation is not "
            "available yet; set grad_accum_steps=1 and raise batch_size instead."
        )
    repl = Replicator(devices=devices, mesh=dict(config.mesh), precision=config.precision)
    experiment = importlib.import_module(config.experiment)
    _import_dataset_builders()
    try:
        model = experiment.make_model(repl.precision, **config.model.to_dict())
    except TypeError as e:
        raise ValueError(f"config.model does not fit {config.experiment}.make_model: {e}") from e
    tx = repl.wrap_optimizer(_make_optimizer(config.optimizer, config.learning_rate))
    eval_source = data.load_data_source(config.dataset, config.eval_split, data_dir=config.data_dir)
    example = experiment.preprocess(eval_source[0])
    init = functools.partial(_init_state, experiment, model, tx, example, config.seed)
    return Run(config, repl, experiment, model, tx, jax.eval_shape(init), eval_source, init)


def train_and_evaluate(
    config: ml_collections.ConfigDict, workdir: str, *, quiet: bool = False, devices=None
) -> dict[str, Any]:
    """Trains ``config``'s experiment, evaluating and checkpointing along the way.

    Continues from the latest checkpoint in ``workdir`` if there is one.

    Args:
      config: a training config (see `replicator.config.SCHEMA`).
      workdir: where ``metrics.jsonl``, TensorBoard events and checkpoints go.
      quiet: no progress bar.
      devices: the devices to train on (default: all).

    Returns:
      The final eval record: ``step``, ``loss``, ``accuracy``, ``num_examples``.
    """
    # ---- Set up: everything that can fail on bad input fails before the workdir is touched.
    watch = Stopwatch()
    run = setup(config, devices=devices)
    config, repl = run.config, run.repl
    train_source = data.load_data_source(
        config.dataset, config.train_split, data_dir=config.data_dir
    )
    eval_source = run.eval_source
    eval_batch_size = _eval_batch_size(config, repl)
    _check_divisible("batch_size", config.batch_size, repl)
    train_iter = data.make_train_iterator(
        train_source,
        global_batch_size=config.batch_size,
        preprocess=run.experiment.preprocess,
        seed=config.seed,
        process_index=jax.process_index(),
        process_count=jax.process_count(),
    )

    log.info("%s on %s", config.experiment, repl)

    # ---- Initialise or restore.
    os.makedirs(workdir, exist_ok=True)
    checkpoints = Checkpoints(
        os.path.join(workdir, "checkpoints"), max_to_keep=config.keep_checkpoints
    )
    start_step = checkpoints.latest_step()
    if start_step is None:
        start_step = 0
        state = repl.compile(run.init_state, out_shardings=repl.mirrored_sharding)()
    else:
        target = abstract_like(run.abstract_state, repl.mirrored_sharding)
        state, data_state = checkpoints.restore(start_step, target)
        train_iter.set_state(data_state["iterator"].encode())
        log.info("Resumed from step %d in %s", start_step, checkpoints.directory)
    config_json = config_lib.to_json(config)
    if jax.process_index() == 0:
        with open(os.path.join(workdir, "config.json"), "w") as f:
            f.write(config_json)

    train_step, eval_step = _make_steps(run)
    writer = MetricWriter(workdir)
    progress = ProgressBar(config.num_train_steps, start_step, enabled=False if quiet else None)
    batches = repl.distribute(train_iter)

    def save(step: int) -> None:
        with watch.time("checkpoint"):
            data_state = {"iterator": batches.get_state().decode()}
            checkpoints.save(step, state, data_state=data_state, config_json=config_json)

    def evaluate_now(step: int) -> dict[str, Any]:
        with watch.time("eval"):
            result = {
                "step": step,
                **_evaluate(
                    repl,
                    eval_step,
                    state.params,
                    eval_source,
                    eval_batch_size,
                    run.experiment.preprocess,
                ),
            }
        writer.write(step, result, split=config.eval_split)
        log.info(
            "step %d  %s accuracy %.4f  loss %.4f  (%d examples)",
            step,
            config.eval_split,
            result["accuracy"],
            result["loss"],
            result["num_examples"],
        )
        return result

    # ---- Train. Metrics reach the host one log interval late, so dispatch stays async.
    pending: list[tuple[int, Any]] = []
    last_log = (start_step, time.perf_counter())
    result = None
    for step in range(start_step + 1, config.num_train_steps + 1):
        with watch.time("input"):
            batch = next(batches)
        with watch.time("compile" if step == start_step + 1 else "compute"):
            state, metrics = train_step(state, batch)
        pending.append((step, metrics))
        if step % config.log_every_steps == 0 or step == config.num_train_steps:
            last_log = _log_train(writer, progress, pending, last_log, config.batch_size)
            pending = []
        if step % config.eval_every_steps == 0 and step != config.num_train_steps:
            evaluate_now(step)
        if step % config.checkpoint_every_steps == 0 or step == config.num_train_steps:
            save(step)

    # ---- Final eval and summary.
    repl.wait()
    result = evaluate_now(config.num_train_steps)
    checkpoints.close()
    batches.close()
    progress.close()
    summary = {k: round(v, 3) for k, v in watch.totals.items()} | {"total": watch.elapsed()}
    writer.write(config.num_train_steps, {"wall_time_s": summary}, split="summary")
    writer.close()
    return result


def evaluate(
    config: ml_collections.ConfigDict, workdir: str, *, step: int | None = None, devices=None
) -> dict[str, Any]:
    """Restores parameters from ``workdir`` onto the current devices and evaluates them.

    Args:
      config: the training config (only data, model and mesh keys matter).
      workdir: the training run's directory.
      step: which checkpoint; the latest by default.
      devices: the devices to evaluate on (default: all), whatever trained it.

    Returns:
      ``{"step", "loss", "accuracy", "num_examples"}``.
    """
    run = setup(config, devices=devices)
    config, repl = run.config, run.repl
    checkpoints = Checkpoints(os.path.join(workdir, "checkpoints"), read_only=True)
    available = checkpoints.all_steps()
    step = checkpoints.latest_step() if step is None else step
    if step is None or step not in available:
        raise FileNotFoundError(
            f"No checkpoint {'' if step is None else f'for step {step} '}in "
            f"{checkpoints.directory}; available steps: {available or 'none'}."
        )
    params = checkpoints.restore_params(
        step, abstract_like(run.abstract_state.params, repl.mirrored_sharding)
    )
    checkpoints.close()
    eval_batch_size = _eval_batch_size(config, repl)
    _, eval_step = _make_steps(run)
    return {
        "step": step,
        **_evaluate(
            repl, eval_step, params, run.eval_source, eval_batch_size, run.experiment.preprocess
        ),
    }


def _init_state(experiment, model, tx, example, seed) -> TrainState:
    init_rng, state_rng = jax.random.split(jax.random.key(seed))
    params = experiment.init_params(model, init_rng, example)
    return TrainState(step=jnp.int32(0), params=params, opt_state=tx.init(params), rng=state_rng)


def _make_steps(run: Run):
    """The experiment's steps on the configured path, with per-replica metrics reduced."""
    repl = run.repl
    train_fn = run.experiment.make_train_step(run.model, run.tx)
    eval_fn = run.experiment.make_eval_step(run.model)
    if run.config.step_path == "compile":
        return repl.compile(train_fn, donate_argnums=(0,)), repl.compile(eval_fn)

    def train_step(state, batch):
        state, metrics = repl.run(train_fn, state, batch, donate_argnums=(0,))
        return state, repl.reduce(ReduceOp.SUM, metrics)

    def eval_step(params, batch):
        return repl.reduce(ReduceOp.SUM, repl.run(eval_fn, params, batch))

    return train_step, eval_step


def _evaluate(repl, eval_step, params, source, global_batch_size, preprocess) -> dict[str, Any]:
    """One exact pass over ``source``: sums on device, one transfer at the end."""
    batches = data.make_eval_iterator(
        source,
        global_batch_size=global_batch_size,
        preprocess=preprocess,
        process_index=jax.process_index(),
        process_count=jax.process_count(),
    )
    totals = None
    for batch in repl.distribute(batches):
        sums = eval_step(params, batch)
        totals = sums if totals is None else jax.tree.map(jnp.add, totals, sums)
    result = summarize_sums(jax.device_get(totals))
    if result["num_examples"] != len(source):
        raise RuntimeError(
            f"Evaluation counted {result['num_examples']} examples but the split has "
            f"{len(source)}; the input pipeline lost or duplicated examples."
        )
    return result


def _log_train(writer, progress, pending, last_log, batch_size):
    """Fetches the pending steps' metrics (now finished) and writes one record."""
    last_step, last_time = last_log
    step = pending[-1][0]
    now = time.perf_counter()
    totals = jax.device_get([m for _, m in pending])
    loss = float(np.mean([m["loss"] for m in totals]))
    accuracy = sum(float(m["correct"]) for m in totals) / sum(float(m["count"]) for m in totals)
    examples_per_sec = (step - last_step) * batch_size / max(now - last_time, 1e-9)
    record = {"loss": loss, "accuracy": accuracy, "examples_per_sec": examples_per_sec}
    writer.write(step, record)
    progress.update(step, loss=loss, examples_per_sec=examples_per_sec)
    return step, now


def _batch_unit(repl: Replicator) -> int:
    return repl.num_replicas * jax.process_count() // np.gcd(repl.num_replicas, jax.process_count())


def _eval_batch_size(config, repl: Replicator) -> int:
    """The eval batch, rounded up to split evenly; padding and masks keep eval exact."""
    unit = _batch_unit(repl)
    return -(-(config.eval_batch_size or config.batch_size) // unit) * unit


def _check_divisible(name: str, size: int, repl: Replicator) -> None:
    unit = _batch_unit(repl)
    if size % unit:
        raise ValueError(
            f"config.{name}={size} does not split evenly over {repl.num_replicas} replicas "
            f"and {jax.process_count()} processes; use a multiple of {unit}."
        )


def _make_optimizer(name: str, learning_rate: float) -> optax.GradientTransformation:
    factory = getattr(optax, name, None)
    if not callable(factory):
        raise ValueError(f"config.optimizer={name!r} is not an optax optimizer (e.g. 'adam').")
    return factory(learning_rate)


def _import_dataset_builders() -> None:
    # Registers the offline tfds builders of this repository (e.g. "digits").
    importlib.import_module("experiments.datasets")


def load_saved_config(workdir: str) -> dict[str, Any]:
    """The resolved config a run wrote to ``WORKDIR/config.json``."""
    with open(os.path.join(workdir, "config.json")) as f:
        return json.load(f)
