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
from replicator.checkpoint import (
    Checkpoints,
    CorruptCheckpointError,
    Preempted,
    PreemptionWatcher,
    abstract_like,
    config_differences,
)
from replicator.metrics import (
    MetricWriter,
    ProgressBar,
    Stopwatch,
    peak_flops_per_second,
    summarize_sums,
)
from replicator.precision import LossScale, apply_policy
from replicator.replicator import ReduceOp, Replicator
from replicator.state import TrainState

log = logging.getLogger("replicator")

# For programs that run once, like the state's initialisation, on CPU: XLA's
# optimisations cost more than they save (the digits CNN's init compiles in 0.4 s
# instead of 1.3-2.7 s and runs in 5 ms either way).
_RUN_ONCE = {"xla_backend_optimization_level": 0}


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
    repl = Replicator(devices=devices, mesh=dict(config.mesh), precision=config.precision)
    experiment = importlib.import_module(config.experiment)
    _import_dataset_builders()
    try:
        model = apply_policy(experiment.make_model(**config.model.to_dict()), repl.precision)
    except TypeError as e:
        raise ValueError(f"config.model does not fit {config.experiment}.make_model: {e}") from e
    tx = repl.wrap_optimizer(_make_optimizer(config.optimizer, config.learning_rate))
    eval_source = data.load_data_source(
        config.dataset, config.eval_split, data_dir=config.data_dir, fill_in_background=True
    )
    example = jax.tree.map(lambda x: x[0], experiment.preprocess(data.read_batch(eval_source, [0])))
    loss_scale = LossScale.create() if repl.precision.loss_scaling else None
    init = functools.partial(
        _init_state,
        experiment,
        model,
        tx,
        example,
        config.seed,
        loss_scale,
        config.grad_accum_steps,
    )
    return Run(config, repl, experiment, model, tx, jax.eval_shape(init), eval_source, init)


def train_and_evaluate(
    config: ml_collections.ConfigDict,
    workdir: str,
    *,
    quiet: bool = False,
    devices=None,
    strict: bool = False,
) -> dict[str, Any]:
    """Trains ``config``'s experiment, evaluating and checkpointing along the way.

    Continues from the newest readable checkpoint in ``workdir`` if there is one,
    with the same data order and RNG, so an interrupted run ends exactly like an
    uninterrupted one. SIGTERM/SIGINT save a checkpoint at the next step boundary
    and raise `Preempted`.

    Args:
      config: a training config (see `replicator.config.SCHEMA`).
      workdir: where ``metrics.jsonl``, TensorBoard events and checkpoints go.
      quiet: no progress bar.
      devices: the devices to train on (default: all).
      strict: fail on an unreadable checkpoint instead of falling back to the
        previous one.

    Returns:
      The final eval record: ``step``, ``loss``, ``accuracy``, ``num_examples``.

    Raises:
      Preempted: after saving, when a SIGTERM or SIGINT arrived.
    """
    preemption = PreemptionWatcher()  # before anything slow, so no signal is missed
    try:
        return _train_and_evaluate(config, workdir, preemption, quiet, devices, strict)
    finally:
        preemption.close()


def _train_and_evaluate(config, workdir, preemption, quiet, devices, strict) -> dict[str, Any]:
    # ---- Set up: everything that can fail on bad input fails before the workdir is touched.
    watch = Stopwatch()
    run = setup(config, devices=devices)
    config, repl = run.config, run.repl
    # Decoding the splits starts now, on threads, and overlaps compilation.
    train_source = data.load_data_source(
        config.dataset, config.train_split, data_dir=config.data_dir, fill_in_background=True
    )
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
    config_json = config_lib.to_json(config)
    log.info("%s on %s", config.experiment, repl)

    # ---- Initialise, or restore the newest readable checkpoint.
    os.makedirs(workdir, exist_ok=True)
    checkpoints = Checkpoints(
        os.path.join(workdir, "checkpoints"),
        max_to_keep=config.keep_checkpoints,
        keep_best=config.keep_best_checkpoints,
        best_metric=config.best_metric,
        best_mode=config.best_mode,
    )
    target = abstract_like(run.abstract_state, repl.mirrored_sharding)
    start_step, restored = checkpoints.restore_latest_good(
        lambda step: checkpoints.restore(step, target), strict=strict
    )
    if start_step is None:
        start_step = 0
        state = repl.compile(
            run.init_state,
            out_shardings=repl.mirrored_sharding,
            compiler_options=_RUN_ONCE if repl.mesh.devices.flat[0].platform == "cpu" else None,
        )()
    else:
        state, data_state = restored
        train_iter.set_state(data_state["iterator"].encode())
        _warn_config_changes(checkpoints.saved_config(start_step), json.loads(config_json))
        log.info("Resumed from step %d in %s", start_step, checkpoints.directory)
    if jax.process_index() == 0:
        with open(os.path.join(workdir, "config.json"), "w") as f:
            f.write(config_json)

    train_step, eval_step = _make_steps(run)
    writer = MetricWriter(workdir, resume_step=start_step)
    progress = ProgressBar(config.num_train_steps, start_step, enabled=False if quiet else None)
    batches = repl.distribute(train_iter)

    def save(step: int, metrics: dict[str, Any] | None = None) -> None:
        with watch.time("checkpoint"):
            checkpoints.save(
                step,
                state,
                data_state={"iterator": batches.get_state().decode()},
                config_json=config_json,
                metrics=metrics and {k: metrics[k] for k in ("accuracy", "loss")},
            )

    def evaluate_now(step: int) -> dict[str, Any]:
        with watch.time("eval"):
            result = _evaluate(
                repl,
                eval_step,
                state.params,
                run.eval_source,
                eval_batch_size,
                run.experiment.preprocess,
            )
        result = {"step": step, **result}
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

    # ---- Train. A logged step's metrics reach the host one step late, so the host never
    # waits for the device just to log.
    logger = _TrainLogger(writer, progress, start_step, config.batch_size)
    guard = _NonfiniteGuard(workdir, config.nonfinite, repl.precision.loss_scaling)
    profiler = _Profiler(os.path.join(workdir, "profile"), config.profile_steps)
    step, batch, completed = start_step, None, False
    watch.add("setup", watch.elapsed())  # model, data, state: everything before the first step
    try:
        while step < config.num_train_steps:
            step += 1
            with watch.time("input"):
                position = batches.get_state()  # where this batch starts, for replay
                batch = next(batches)
            profiler.before(step)
            with watch.time("compile" if step == start_step + 1 else "compute"):
                state, metrics, status = train_step(state, batch)
            profiler.after(step, metrics)
            checkpoints.check_for_errors()  # a failed async save surfaces here, not later
            last = step == config.num_train_steps
            progress.update(step)
            guard.watch(step, metrics, status, batch, position)
            logger.flush()
            if step % config.log_every_steps == 0 or last:
                logger.hold(step, metrics)
            eval_result = None
            if step % config.eval_every_steps == 0 or last:
                eval_result = evaluate_now(step)
            stop = preemption.stop_step(step) == step
            if step % config.checkpoint_every_steps == 0 or last or stop:
                save(step, eval_result)
            if stop and not last:
                guard.flush()
                logger.flush()
                checkpoints.wait()
                log.warning("%s received; stopped at step %d.", preemption.signal_name, step)
                raise Preempted(step, checkpoints.directory)
        with watch.time("compute"):
            jax.block_until_ready(state)  # the last steps in flight belong to compute too
        guard.flush()
        logger.flush()
        if start_step == config.num_train_steps:
            eval_result = evaluate_now(step)  # already trained: just report
        completed = True
    finally:
        batches.close()
        for source in (train_source, run.eval_source):
            if isinstance(source, data.CachedSource):
                source.stop_filling()
        progress.close()
        with watch.time("checkpoint"):
            checkpoints.close()  # waits for the last save
        profiler.stop()
        total = watch.elapsed()
        summary = {k: round(v, 3) for k, v in watch.totals.items()} | {
            "other": round(total - sum(watch.totals.values()), 3),  # logging, progress bar
            "total": round(total, 3),
        }
        steps_run = step - start_step
        record = {"wall_time_s": summary, "steps": steps_run}
        if steps_run:
            record["examples_per_sec"] = steps_run * config.batch_size / summary["total"]
            # Goodput: the share of wall time spent in training steps proper.
            record["goodput"] = watch.totals.get("compute", 0.0) / summary["total"]
        if completed and steps_run > 1 and writer.enabled:
            record |= _utilization(repl, train_step, state, batch, steps_run - 1, watch)
        writer.write(step, record, split="summary")
        log.info("wall time: %s", ", ".join(f"{k} {v:.1f} s" for k, v in summary.items()))
        if "mfu" in record:
            log.info(
                "%.3g FLOP per step, MFU %.1f%% (peak: %s)",
                record["flops_per_step"],
                100 * record["mfu"],
                record["peak_source"],
            )
        writer.close()
    return eval_result


def evaluate(
    config: ml_collections.ConfigDict,
    workdir: str,
    *,
    step: int | None = None,
    devices=None,
    strict: bool = False,
) -> dict[str, Any]:
    """Restores parameters from ``workdir`` onto the current devices and evaluates them.

    Args:
      config: the training config (only data, model and mesh keys matter).
      workdir: the training run's directory.
      step: which checkpoint; by default the newest readable one.
      devices: the devices to evaluate on (default: all), whatever trained it.
      strict: fail on an unreadable checkpoint instead of falling back.

    Returns:
      ``{"step", "loss", "accuracy", "num_examples"}``.
    """
    evaluator = Evaluator(config, workdir, devices=devices)
    try:
        return evaluator.evaluate(step, strict=strict)
    finally:
        evaluator.close()


def follow(
    config: ml_collections.ConfigDict,
    workdir: str,
    *,
    devices=None,
    timeout_s: float | None = None,
) -> list[dict[str, Any]]:
    """A sidecar evaluator: evaluates every new checkpoint in ``workdir`` as it appears.

    Results go to ``metrics.jsonl`` (``"sidecar": true``) and are attached to the
    checkpoint, where the training run's best-N retention finds them. Stops after
    the checkpoint of the final step, or when no new checkpoint came for
    ``timeout_s`` seconds.

    Args:
      config: the training config.
      workdir: the training run's directory.
      devices: the devices to evaluate on.
      timeout_s: how long to wait for each new checkpoint; None waits forever.

    Returns:
      The eval records, oldest first.
    """
    evaluator = Evaluator(config, workdir, devices=devices)
    writer = MetricWriter(workdir, resume_step=None)
    results, last = [], None
    try:
        while last is None or last < evaluator.config.num_train_steps:
            step = _wait_for_checkpoint(evaluator.checkpoints, after=last, timeout_s=timeout_s)
            if step is None:
                log.info("No new checkpoint in %s s; stopping.", timeout_s)
                break
            last = step
            try:
                result = evaluator.evaluate(step)
            except (FileNotFoundError, CorruptCheckpointError) as e:
                log.warning("sidecar: skipping step %d: %s", step, e)  # e.g. deleted by retention
                continue
            writer.write(step, {**result, "sidecar": True}, split=evaluator.config.eval_split)
            evaluator.checkpoints.write_metrics(
                step, {"accuracy": result["accuracy"], "loss": result["loss"]}
            )
            log.info("sidecar: step %d accuracy %.4f", step, result["accuracy"])
            results.append(result)
    finally:
        writer.close()
        evaluator.close()
    return results


class Evaluator:
    """Restores parameters from a run's checkpoints and evaluates them exactly."""

    def __init__(self, config: ml_collections.ConfigDict, workdir: str, *, devices=None):
        self.run = setup(config, devices=devices)
        self.config = self.run.config
        self.checkpoints = Checkpoints(os.path.join(workdir, "checkpoints"), read_only=True)
        _, self._eval_step = _make_steps(self.run)
        self._target = abstract_like(
            self.run.abstract_state.params, self.run.repl.mirrored_sharding
        )

    def evaluate(self, step: int | None = None, *, strict: bool = False) -> dict[str, Any]:
        """Evaluates checkpoint ``step`` (default: the newest readable one)."""
        self.checkpoints.reload()
        available = self.checkpoints.all_steps()
        if step is None:
            step, params = self.checkpoints.restore_latest_good(
                lambda s: self.checkpoints.restore_params(s, self._target), strict=strict
            )
        elif step in available:
            params = self.checkpoints.restore_params(step, self._target)
        if step is None or step not in available:
            raise FileNotFoundError(
                f"No {'readable checkpoint' if step is None else f'checkpoint for step {step}'}"
                f" in {self.checkpoints.directory}; available steps: {available or 'none'}."
            )
        run = self.run
        result = _evaluate(
            run.repl,
            self._eval_step,
            params,
            run.eval_source,
            _eval_batch_size(self.config, run.repl),
            run.experiment.preprocess,
        )
        return {"step": step, **result}

    def close(self) -> None:
        self.checkpoints.close()
        if isinstance(self.run.eval_source, data.CachedSource):
            self.run.eval_source.stop_filling()


def _wait_for_checkpoint(checkpoints: Checkpoints, *, after: int | None, timeout_s):
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        checkpoints.reload()
        newer = [s for s in checkpoints.all_steps() if after is None or s > after]
        if newer:
            return newer[0]
        if deadline is not None and time.monotonic() > deadline:
            return None
        time.sleep(0.5)


def _init_state(experiment, model, tx, example, seed, loss_scale, grad_accum_steps) -> TrainState:
    init_rng, state_rng = jax.random.split(jax.random.key(seed))
    params = experiment.init_params(model, init_rng, example)
    return TrainState.create(
        params, tx, state_rng, loss_scale=loss_scale, grad_accum_steps=grad_accum_steps
    )


def _make_steps(run: Run):
    """The experiment's steps on the configured path, with per-replica metrics reduced.

    The train step returns ``(state, metrics, status)``: ``status`` holds the
    mirrored counters the loop watches (updates skipped this step, loss scale).
    """
    repl, config = run.repl, run.config
    train_fn = _with_matmul_precision(
        run.experiment.make_train_step(run.model, run.tx), config.matmul_precision
    )
    eval_fn = _with_matmul_precision(
        run.experiment.make_eval_step(run.model), config.matmul_precision
    )

    def train_with_status(state, batch):
        new_state, metrics = train_fn(state, batch)
        status = {"skipped": new_state.skipped_steps - state.skipped_steps}
        if new_state.loss_scale is not None:
            status["loss_scale"] = new_state.loss_scale.scale
        return new_state, metrics, status

    if config.step_path == "compile":
        return repl.compile(train_with_status, donate_argnums=(0,)), repl.compile(eval_fn)

    def train_step(state, batch):
        state, metrics, status = repl.run(train_with_status, state, batch, donate_argnums=(0,))
        return state, repl.reduce(ReduceOp.SUM, metrics), status

    train_step.lower = lambda state, batch: repl.lower(
        train_with_status, state, batch, donate_argnums=(0,)
    )

    def eval_step(params, batch):
        return repl.reduce(ReduceOp.SUM, repl.run(eval_fn, params, batch))

    return train_step, eval_step


def _utilization(repl: Replicator, train_step, state, batch, steps: int, watch) -> dict:
    """The train step's FLOPs (XLA's count) and model FLOPs utilization over ``steps``.

    MFU = FLOPs per step x steps / compute time / peak FLOP/s of the mesh's
    devices (`peak_flops_per_second`). Compute time excludes the
    first, compiling step, as ``steps`` does.
    """
    devices = list(repl.mesh.devices.flat)
    result: dict[str, Any] = {}
    try:
        # The compiled program is cached: this neither traces nor compiles again.
        cost = train_step.lower(state, batch).compile().cost_analysis()
        flops = float(cost["flops"]) * len(devices)  # XLA counts one device's program
        result["flops_per_step"] = flops
        compute = watch.totals.get("compute", 0.0)
        peak = peak_flops_per_second(devices)
        if peak is not None and compute > 0 and flops > 0:
            result |= {
                "mfu": flops * steps / compute / peak[0],
                "peak_flops_per_sec": peak[0],
                "peak_source": peak[1],
            }
    except Exception as e:  # noqa: BLE001  (an instrument must not fail the run)
        log.warning("No FLOP count or MFU for the train step: %s", e)
    return result


def _with_matmul_precision(fn: Callable, precision: str | None) -> Callable:
    if precision is None:
        return fn

    @functools.wraps(fn)
    def traced_with_precision(*args):
        with jax.default_matmul_precision(precision):
            return fn(*args)

    return traced_with_precision


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


class _NonfiniteGuard:
    """Checks every step for a skipped (non-finite) update, one step late.

    With dynamic loss scaling, a skip with a finite loss is an expected overflow
    (the scale halves) and is only counted. Any other skip is recorded in
    ``WORKDIR/nonfinite/step_<N>.process_<P>.json`` (the input iterator's position
    before the batch and, when the batch carries an ``index``, its example
    indices), so the batch can be replayed; policy ``"halt"`` then stops the run.
    """

    def __init__(self, workdir: str, policy: str, loss_scaling: bool):
        self._dir = os.path.join(workdir, "nonfinite")
        self._policy, self._loss_scaling = policy, loss_scaling
        self._held = None

    def watch(self, step, metrics, status, batch, position) -> None:
        previous, self._held = self._held, (step, metrics, status, batch, position)
        if previous is not None:
            self._check(*previous)

    def flush(self) -> None:
        if self._held is not None:
            held, self._held = self._held, None
            self._check(*held)

    def _check(self, step, metrics, status, batch, position) -> None:
        if not int(jax.device_get(status["skipped"])):
            return
        loss = float(jax.device_get(metrics["loss"]))
        if self._loss_scaling and np.isfinite(loss):
            log.info("step %d: gradients overflowed; update skipped, loss scale halved.", step)
            return
        record = {"step": step, "loss": loss, "iterator_state_before": position.decode()}
        if "index" in batch:
            shards = batch["index"].addressable_shards
            record["example_indices"] = np.concatenate(
                [np.asarray(s.data) for s in shards]
            ).tolist()
        os.makedirs(self._dir, exist_ok=True)
        path = os.path.join(self._dir, f"step_{step}.process_{jax.process_index()}.json")
        with open(path, "w") as f:
            json.dump(record, f)
        if self._policy == "halt":
            raise FloatingPointError(
                f"Non-finite loss or gradients at step {step} (loss {loss}); the update was not "
                f"applied. The batch is recorded in {path}. Set config.nonfinite='skip' to "
                "skip such steps instead."
            )
        log.warning("step %d: non-finite gradients; update skipped (batch in %s).", step, path)


class _Profiler:
    """Captures a JAX profiler trace of steps START..END (config ``profile_steps``),
    viewable in TensorBoard's profile plugin or Perfetto."""

    def __init__(self, directory: str, steps: str | None):
        self._dir = directory
        self._range = tuple(int(x) for x in steps.split(",")) if steps else None
        self._active = False

    def before(self, step: int) -> None:
        if self._range and step == self._range[0] and jax.process_index() == 0:
            jax.profiler.start_trace(self._dir)
            self._active = True

    def after(self, step: int, outputs: Any) -> None:
        if self._active and step >= self._range[1]:
            jax.block_until_ready(outputs)  # the traced steps, finished
            self.stop()

    def stop(self) -> None:
        if self._active:
            jax.profiler.stop_trace()
            self._active = False
            log.info("Profiler trace of steps %s-%s in %s", *self._range, self._dir)


class _TrainLogger:
    """Writes the metrics of every logged step, fetched once the next step is dispatched.

    A record holds that step's own metrics (not a mean since the last record), so
    a resumed run logs exactly what an uninterrupted one does.
    """

    def __init__(self, writer: MetricWriter, progress: ProgressBar, step: int, batch_size: int):
        self._writer, self._progress, self._batch_size = writer, progress, batch_size
        self._held = None
        self._last = (step, time.perf_counter())

    def hold(self, step: int, metrics: Any) -> None:
        self._held = (step, metrics)

    def flush(self) -> None:
        if self._held is None:
            return
        (step, metrics), self._held = self._held, None
        metrics = jax.device_get(metrics)
        now = time.perf_counter()
        last_step, last_time = self._last
        self._last = (step, now)
        record = {
            "loss": float(metrics["loss"]),
            "accuracy": float(metrics["correct"]) / float(metrics["count"]),
            "examples_per_sec": (step - last_step) * self._batch_size / max(now - last_time, 1e-9),
        }
        self._writer.write(step, record)
        self._progress.update(
            step, loss=record["loss"], examples_per_sec=record["examples_per_sec"]
        )


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


def _warn_config_changes(saved: dict, current: dict) -> None:
    changes = config_differences(saved, current)
    if changes:
        log.warning(
            "The config differs from the one saved with the checkpoint:\n  %s",
            "\n  ".join(changes),
        )
