"""Evaluation: one exact pass over a split, from the trainer or from a checkpoint.

Every example of the split counts exactly once on any device or process count:
the last batches are padded and masked, the experiment's eval step returns sums
over real examples, and the sums are added up on the devices and fetched once.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import orbax.checkpoint as ocp

from replicator import storage
from replicator.checkpoints.checkpoint import Checkpoints, CorruptCheckpointError
from replicator.errors import ConfigError
from replicator.step import ema as ema_lib
from replicator.trainer import config as config_lib
from replicator.trainer import data
from replicator.trainer.setup import Run, setup, sync_policy
from replicator.trainer.writers import MetricWriter

log = logging.getLogger("replicator")


def evaluate_split(run: Run, eval_state: Any) -> dict[str, Any]:
    """The experiment's metrics over the whole eval split, and ``num_examples``."""
    batches = data.make_eval_iterator(
        run.eval_source,
        global_batch_size=run.eval_batch_size,
        preprocess=run.experiment.preprocess,
        process_index=jax.process_index(),
        process_count=jax.process_count(),
    )
    totals = None
    for batch in run.repl.distribute(batches):
        sums = run.eval_step(eval_state, batch)
        totals = sums if totals is None else jax.tree.map(jnp.add, totals, sums)
    sums, count = jax.device_get(totals)
    count = int(count)
    if count != len(run.eval_source):
        raise RuntimeError(
            f"Evaluation counted {count} examples but the split has "
            f"{len(run.eval_source)}; the input pipeline lost or duplicated examples."
        )
    metrics = run.experiment.summarize(sums)
    missing = [name for name in run.experiment.metric_names if name not in metrics]
    if missing:
        raise config_lib.ConfigError(
            f"{run.config.experiment}: summarize reported {sorted(metrics)} for the eval sums, "
            f"without {missing} that its metric_names declare."
        )
    return {**metrics, "num_examples": count}


EMA = "ema_"  # the prefix of the EMA parameters' metrics


def eval_views(run: Run, state: Any, *, params: bool = True, ema: bool = True) -> dict[str, Any]:
    """What eval evaluates of a train state, by the prefix of its metrics: ``""`` the
    parameters, ``"ema_"`` their moving average where the run keeps one
    (`replicator.step.ema`). Works on label trees too (`_picked`)."""
    views = {"": run.eval_state(state)} if params else {}
    if ema and run.config.ema_decay is not None:
        views[EMA] = run.eval_state(ema_lib.with_ema_params(state))
    return views


def evaluate_views(run: Run, views: dict[str, Any]) -> dict[str, Any]:
    """`evaluate_split` of each view, the metrics of all in one record (each view's
    prefixed by its key) with ``num_examples``."""
    record: dict[str, Any] = {}
    for prefix, eval_state in views.items():
        result = evaluate_split(run, eval_state)
        count = result.pop("num_examples")
        record.update({f"{prefix}{k}": v for k, v in result.items()})
    return {**record, "num_examples": count}


def run_config(workdir: str) -> ml_collections.ConfigDict | None:
    """The config a training run saved in ``WORKDIR/config.json``, or None if there is none.

    Every key is overridable as in a config file (`config_lib.from_saved`): keys saved
    as None keep their types, the experiment's own included.
    """
    saved = config_lib.read_saved(workdir)
    return None if saved is None else config_lib.from_saved(saved)


class Evaluator:
    """Restores what eval needs from a run's checkpoints and evaluates it exactly."""

    def __init__(
        self,
        config: ml_collections.ConfigDict | None,
        workdir: str,
        *,
        devices=None,
        ema: bool = False,
    ):
        if config is None:
            config = run_config(workdir)
            if config is None:
                raise FileNotFoundError(
                    f"{storage.join(workdir, 'config.json')} does not exist; pass the "
                    "training config."
                )
        self.run = setup(config, devices=devices, training=False)
        self.config = self.run.config
        self.checkpoints = Checkpoints(
            storage.join(workdir, "checkpoints"), self.run.repl, read_only=True
        )
        if ema and self.config.ema_decay is None:
            raise ConfigError(
                f"eval --ema: the run in {workdir} kept no EMA of its parameters "
                "(its config.ema_decay is None)"
            )
        abstract = self.run.abstract_state
        if sync_policy(self.config) is None and self.config.ema_decay is None:
            like = self.run.experiment.eval_state(abstract)
            self._like, self._view = like, lambda x: {"": x}
        else:  # the leaves the views use, wherever they are (DiLoCo's outer parameters, EMA)
            self._like, self._view = _picked(
                abstract, lambda state: eval_views(self.run, state, params=not ema)
            )

    def evaluate(self, step: int | None = None, *, strict: bool = False) -> dict[str, Any]:
        """Evaluates checkpoint ``step`` (default: the newest readable one)."""
        self.checkpoints.reload()
        views = self._view(self.checkpoints.restore(like=self._like, step=step,
                                                    strict=strict, partial=True))  # fmt: skip
        step = self.checkpoints.restored_step
        return {"step": step, **evaluate_views(self.run, views)}

    def close(self) -> None:
        self.checkpoints.close()
        self.run.close()


def restore_params(
    run: Run, workdir: str, *, step: int | None = None, strict: bool = False
) -> tuple[Any, int] | None:
    """The parameters of a run's checkpoint, alone, on ``run``'s shardings (what ``sample``
    and ``export`` read): the eval state's ``params``, nothing else read.

    Args:
      run: set up from the run's config (`setup` with ``training=False``), on the
        devices to restore onto.
      workdir: the training run's directory.
      step: the checkpoint's step; None: the newest readable one.
      strict: with ``step=None``, fail on an unreadable newest checkpoint instead of
        falling back to an older one (`Checkpoints.restore`).

    Returns:
      ``(params, step)``, or None where ``workdir`` holds no checkpoint.

    Raises:
      CheckpointNotFoundError: no checkpoint ``step``.
    """
    directory = storage.join(workdir, "checkpoints")
    if not storage.exists(directory):
        return None
    checkpoints = Checkpoints(directory, run.repl, read_only=True)
    try:
        if checkpoints.latest_step() is None:
            return None
        like = {"params": run.experiment.eval_state(run.abstract_state)["params"]}
        restored = checkpoints.restore(like=like, step=step, strict=strict, partial=True)
        return restored["params"], checkpoints.restored_step
    finally:
        checkpoints.close()


def _picked(abstract: Any, pick) -> tuple[Any, Any]:
    """What to restore for ``pick(state)`` when it takes leaves from anywhere in the
    state (not only whole top-level fields): the state's structure with every leaf
    it does not use an Orbax placeholder (neither read nor allocated), and how to
    build ``pick(state)`` from what that restores."""
    leaves, treedef = jax.tree.flatten(abstract)
    picked = pick(jax.tree.unflatten(treedef, range(len(leaves))))  # leaf indices
    used = set(jax.tree.leaves(picked))
    like = jax.tree.unflatten(
        treedef, [x if i in used else ocp.PLACEHOLDER for i, x in enumerate(leaves)]
    )

    def view(restored: Any) -> Any:
        values = treedef.flatten_up_to(restored)
        return jax.tree.map(lambda i: values[i], picked)

    return like, view


def evaluate(
    config: ml_collections.ConfigDict | None,
    workdir: str,
    *,
    step: int | None = None,
    devices=None,
    strict: bool = False,
    ema: bool = False,
) -> dict[str, Any]:
    """Restores a checkpoint of ``workdir`` onto the current devices and evaluates it.

    Args:
      config: the training config (data, model and mesh keys matter); None uses
        the run's own (`run_config`).
      workdir: the training run's directory.
      step: which checkpoint; by default the newest readable one.
      devices: the devices to evaluate on (default: all), whatever trained it.
      strict: fail on an unreadable checkpoint instead of falling back.
      ema: evaluate only the moving average of the parameters (``ema_`` metrics) of
        a run that kept one (``ema_decay``); by default both, where it did.

    Returns:
      ``{"step", "num_examples", ...}`` with the experiment's metrics.
    """
    evaluator = Evaluator(config, workdir, devices=devices, ema=ema)
    try:
        return evaluator.evaluate(step, strict=strict)
    finally:
        evaluator.close()


def follow(
    config: ml_collections.ConfigDict | None,
    workdir: str,
    *,
    devices=None,
    timeout_s: float | None = None,
    on_result: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """A sidecar evaluator: evaluates every new checkpoint in ``workdir`` as it appears.

    ``config`` is as for `evaluate`. Results go to ``metrics.jsonl`` (for a
    ``gs://`` workdir ``metrics.sidecar.jsonl``: objects cannot be appended to)
    with ``"sidecar": true``, and are attached to the checkpoint, where the
    training run's best-N retention finds them. Stops after the checkpoint of the final
    step, or when no new checkpoint came for ``timeout_s`` seconds.

    ``on_result`` is called with each record as it comes (the CLI prints it);
    without one, each is logged.

    Returns:
      The eval records, oldest first.
    """
    evaluator = Evaluator(config, workdir, devices=devices)
    # Locally both processes append to metrics.jsonl; a bucket's objects are written
    # whole, so there the sidecar keeps its own file rather than overwrite training's.
    name = "metrics.sidecar.jsonl" if storage.is_remote(workdir) else "metrics.jsonl"
    writer = MetricWriter(workdir, resume_step=None, name=name)
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
                step, {k: v for k, v in result.items() if isinstance(v, float)}
            )
            if on_result is None:
                log.info("sidecar: step %d %s", step, json.dumps(result))
            else:
                on_result(result)
            results.append(result)
    finally:
        writer.close()
        evaluator.close()
    return results


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
