"""The one training loop: ``train_and_evaluate(config, workdir)``.

The loop reads the config (the only code that does, with `setup`) and hands
explicit values to the library and the experiment. One batch flows: data source
-> grain iterator (this process's rows) -> ``repl.distribute`` (global arrays)
-> the experiment's train step (``repl.run`` or ``repl.compile``) -> sums,
reduced across replicas -> `actions` (log, evaluate, save) -> writers.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from typing import Any

import jax
import ml_collections

from replicator import storage
from replicator.checkpoints.checkpoint import CheckpointMismatchError, Checkpoints
from replicator.step import ema as ema
from replicator.trainer import actions as act
from replicator.trainer import aot, data, init_from, lease, pretrained
from replicator.trainer import config as config_lib
from replicator.trainer.config import config_differences
from replicator.trainer.console import parallelism_line
from replicator.trainer.evaluator import eval_views, evaluate_views
from replicator.trainer.instruments import ProgressBar, Stopwatch, summarize_run
from replicator.trainer.optimizer import describe
from replicator.trainer.preemption import PreemptionWatcher
from replicator.trainer.setup import Run, setup, train_params
from replicator.trainer.writers import MetricWriter, check_writers

log = logging.getLogger("replicator")


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
      config: a training config (see `replicator.trainer.config`).
      workdir: where ``metrics.jsonl``, TensorBoard events and checkpoints go.
      quiet: no progress bar.
      devices: the devices to train on (default: all).
      strict: fail on an unreadable checkpoint instead of using the previous one.

    Returns:
      The final eval record: ``step``, ``num_examples`` and the experiment's metrics.
    """
    preemption = PreemptionWatcher()  # before anything slow, so no signal is missed
    try:
        with contextlib.ExitStack() as held:  # the workdir's lease, once _train takes it
            return _train(config, workdir, preemption, held, quiet=quiet, devices=devices,
                          strict=strict)  # fmt: skip
    finally:
        preemption.close()


def _train(config, workdir, preemption, held, *, quiet, devices, strict) -> dict[str, Any]:
    # ---- Setup: everything that can fail on bad input fails before the workdir is touched.
    watch = Stopwatch()
    config = pretrained.checkpoint_model(config)  # init_from='hf:DIR': its config.json's shape
    run = setup(config, devices=devices)
    config, repl = run.config, run.repl
    _check_step(run)  # what the step checks as it is traced (pipeline, context, experts)
    check_writers(config.writers)  # 'wandb' not installed: one line, before the workdir
    train_iter = run.train_iterator()
    workdir = storage.normalize(workdir)
    storage.check_writable(workdir)
    start_from = _init_from(run, workdir)  # read and checked before anything is written
    storage.makedirs(workdir)
    held.enter_context(lease.hold(workdir))  # one run at a time: a second is refused here
    checkpoints, state, start = _start(run, workdir, train_iter, strict, start_from)
    config_lib.write_json(config, storage.join(workdir, "config.json"))
    batches = repl.distribute(train_iter)
    finished = start >= config.num_train_steps
    if finished:
        log.info(
            "Already trained to step %d: evaluating only (%s keeps its records and summary "
            "as they are)", start, storage.join(workdir, "metrics.jsonl")
        )  # fmt: skip
    # A finished run's records are whole: a rerun repeats no step and keeps its summary.
    writer = MetricWriter(workdir, resume_step=start, enabled=False if finished else None,
                          writers=config.writers, config=config.to_dict())  # fmt: skip
    progress = ProgressBar(config.num_train_steps, start, enabled=False if quiet else None)
    actions = _actions(run, workdir, watch, writer, progress, checkpoints, batches, preemption,
                       start)  # fmt: skip
    log.info("%s on %s", config.experiment, repl)
    split = parallelism_line(config.to_dict(), dict(repl.mesh.shape))  # context, MoE, stages
    if split:
        log.info("%s", split)
    prepared = data.summary(config.dataset, config.data_dir, config.train_split)  # chat data
    if prepared:
        log.info("%s", prepared)
    params = train_params(run.abstract_state)
    log.info("%s", describe(run.optimizer_spec, params[0] if len(params) == 1 else params))

    # ---- Train: dispatch a step, then let each periodic action take its turn.
    step, end, completed = start, None, False
    watch.add("setup", watch.elapsed())
    try:
        while step < config.num_train_steps:
            step += 1
            with watch.time("input"):
                position = batches.get_state()  # where this batch starts, for replay
                batch = next(batches)
            actions.profile.before(step)
            with watch.time("compile" if step == start + 1 else "compute"):
                state, sums, status = run.train_step(state, batch)
            checkpoints.check_for_errors()  # a failed async save surfaces here, not later
            end = act.StepEnd(step, step == config.num_train_steps, state, sums, status, batch,
                              position)  # fmt: skip
            for action in actions:
                action(end)
        with watch.time("compute"):
            jax.block_until_ready(state)  # the last steps in flight belong to compute too
        if end is None:  # already trained: just report
            end = act.StepEnd(step, True, state, None, {}, None, None)
            end.eval_result = actions.evaluate(state, step)
        completed = True
    finally:
        for closing in (*reversed(actions), batches, run, progress):
            closing.close()
        with watch.time("checkpoint"):
            checkpoints.close()  # waits for the last save
        summary = summarize_run(run, watch, state, end, start, completed=completed)
        # The step loop's share of writing records; uploads to a bucket run beside it.
        summary["metric_writes_s"] = round(writer.write_seconds, 4)
        summary["metric_uploads_s"] = round(writer.upload_seconds, 4)
        writer.write(step, summary, split="summary")
        writer.close()
    return end.eval_result


def _check_step(run: Run) -> None:
    """Lowers the train step from shapes alone, so that the checks made as it is traced
    fail before anything is written; the first step reuses the lowering."""
    batch, _ = aot.abstract_batches(run)
    run.train_step.lower(aot.abstract_state(run), batch)


class _Actions(list):
    """The periodic actions in their order at a step boundary, and the two the loop
    also calls directly (the profiler starts before a step; a finished run evaluates)."""

    def __init__(self, actions, profile, evaluate):
        super().__init__(actions)
        self.profile, self.evaluate = profile, evaluate


def _actions(run: Run, workdir, watch, writer, progress, checkpoints, batches, preemption,
             start: int) -> _Actions:  # fmt: skip
    config = run.config

    def wait(tree):
        """The loop waiting for the device: the steps in flight finish on the device's
        time ("compute"), not the time of whatever waited for them."""
        with watch.time("compute"):
            return jax.block_until_ready(tree)

    def evaluate(state, step: int) -> dict[str, Any]:
        wait(state)
        log_train.close()  # this step's train line before its eval's (the wait made it free)
        with watch.time("eval"):
            return _evaluate_and_write(run, writer, state, step, workdir)

    def save(end: act.StepEnd) -> None:
        wait(end.state)
        with watch.time("checkpoint"):
            ranked = {k: v for k, v in (end.eval_result or {}).items() if k == config.best_metric}
            checkpoints.save(
                end.step,
                end.state,
                data_state={"iterator": batches.get_state().decode()},
                config=config.to_dict(),
                metrics=ranked or None,
                before_commit=writer.sync,  # no checkpoint is listed before its records
            )

    per_step, unit = run.per_step_units()
    log_train = act.LogTrain(
        writer, progress, run.experiment.summarize,
        every_steps=config.log_every_steps, per_step=per_step, unit=unit, start=start,
        wait=wait, schedule=run.optimizer_spec.schedule(),
    )  # fmt: skip
    guard = act.WatchNonfinite(
        workdir, config.nonfinite, run.repl.precision.loss_scaling, run.experiment.summarize,
        wait=wait,
    )  # fmt: skip
    profile = act.Profile(
        storage.join(workdir, "profile"), config.profile_steps, config.profile_port, wait=wait
    )
    stop = act.Stop(checkpoints, preemption, flush=lambda: (guard.close(), log_train.close()))
    return _Actions(
        [
            log_train, guard, profile,
            act.Evaluate(evaluate, config.eval_every_steps),
            act.AgreeOnStop(preemption),
            act.Save(save, config.checkpoint_every_steps),
            stop,
        ],
        profile,
        evaluate,
    )  # fmt: skip


def _start(run: Run, workdir: str, train_iter, strict: bool, start_from):
    """The run's checkpoints, and the state and step it starts from (`_restore_or_init`)."""
    config = run.config
    checkpoints = Checkpoints(
        storage.join(workdir, "checkpoints"),
        run.repl,
        keep=config.keep_checkpoints,
        keep_best=config.keep_best_checkpoints,
        best_metric=config.best_metric,
        best_mode=config.best_mode,
    )
    state, start = _restore_or_init(run, checkpoints, train_iter, strict, start_from, workdir)
    if start == 0 and storage.exists(storage.join(workdir, "metrics.jsonl")):
        log.info(
            "No complete checkpoint in %s: training from step 0 (the earlier attempt's "
            "records are replaced)",
            checkpoints.directory,
        )
    return checkpoints, state, start


def _init_from(run: Run, workdir: str):
    """``config.init_from``'s plan and arrays, as a function that returns them: read and
    checked now, before anything is written, unless the workdir has checkpoints to
    resume from (then only if it starts afresh after all: a resumed run needs no
    source, which may be gone by then). None without ``init_from``."""
    config = run.config
    if config.init_from is None:
        return None

    def plan_and_read():
        targets = tuple(target for target, _ in run.experiment.copies)
        return pretrained.load(config, run.abstract_state, run.repl, targets)

    if storage.exists(storage.join(workdir, "checkpoints")):
        return plan_and_read
    loaded = plan_and_read()
    return lambda: loaded


def _restore_or_init(
    run: Run, checkpoints: Checkpoints, train_iter, strict: bool, start_from, workdir: str
):
    """The newest readable checkpoint's state and step (moving the iterator there), or
    a fresh state at step 0 (with ``init_from``'s arrays, by the plan ``start_from``)."""
    if checkpoints.latest_step() is None:
        state = run.init_state()
        if start_from is not None:
            the_plan, arrays = start_from()
            # The EMA starts from the loaded parameters, not from the initialisation.
            state = ema.restart(init_from.place(the_plan, arrays, state))
            _tell_init_from(the_plan, workdir)
        # What the experiment keeps of the starting parameters (the LM's DPO reference).
        return init_from.copy_leaves(state, run.experiment.copies), 0
    try:
        state = checkpoints.restore(like=run.abstract_state, strict=strict)
    except CheckpointMismatchError as e:
        raise CheckpointMismatchError(  # its list of paths stays last, one per line
            "The workdir holds checkpoints of another model than the config's (use another "
            f"--workdir; --force trains there only where the model fits). {e}"
        ) from e
    step = checkpoints.restored_step
    train_iter.set_state(checkpoints.saved_data_state(step)["iterator"].encode())
    changes = config_differences(checkpoints.saved_config(step), run.config.to_dict())
    if changes:
        log.warning(
            "The config differs from the one saved with the checkpoint:\n  %s",
            "\n  ".join(changes),
        )
    log.info("Resumed from step %d in %s", step, checkpoints.directory)
    return state, step


def _tell_init_from(the_plan: init_from.Plan, workdir: str) -> None:
    """What ``init_from`` loaded: its line on the console, every path in ``log.txt``. The
    CLI's console routes the log records so; from Python, where no handler shows
    replicator's info records, the line goes to stderr and the paths to
    ``WORKDIR/log.txt`` here."""
    log.info("%s", the_plan.report())
    log.info("%s", the_plan.details(), extra={"log_only": True})
    # (The CLI's console writes log.txt itself; only process 0 reports, as there.)
    if (log.handlers and not log.propagate) or jax.process_index() != 0:
        return
    if not (log.isEnabledFor(logging.INFO) and log.hasHandlers()):
        print(the_plan.report(), file=sys.stderr, flush=True)
    path = storage.join(workdir, "log.txt")
    before = storage.read_text(path) if storage.exists(path) else ""
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    storage.write_text(path, f"{before}==== {stamp} train_and_evaluate\n{the_plan.details()}\n")


def _evaluate_and_write(run: Run, writer, state, step: int, workdir: str) -> dict[str, Any]:
    views = eval_views(run, state)
    result = {"step": step, **evaluate_views(run, views)}
    eval_state = views[""]
    writer.write(step, result, split=run.config.eval_split)
    shown = "  ".join(f"{k} {v:.4g}" for k, v in result.items() if isinstance(v, float))
    log.info("step %d  %s %s  (%d examples)", step, run.config.eval_split, shown,
             result["num_examples"])  # fmt: skip
    if run.experiment.after_eval is not None and jax.process_index() == 0:
        run.experiment.after_eval(eval_state, workdir, step)
    return result
