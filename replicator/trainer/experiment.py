"""The Experiment protocol: the one seam between the trainer and a task.

A config names its experiment by dotted module path (``experiments.classify``);
the module has ``make_experiment(settings) -> Experiment``. The trainer never
imports ``experiments/`` itself and knows no metric by name: the experiment
supplies its preprocessing, its initial state (one or several parameter sets
and optimizers: a GAN has two), its train and eval steps, and how the steps'
*sums* become the reported metrics.

Sums are what make metrics exact on any number of devices, processes and
batches: every leaf a step returns is a sum over examples (a total loss, a count
of correct predictions, a count of real tokens), so the trainer can add them up
across replicas (``repl.reduce(SUM)``), batches and processes, and only then
divide, on the host, in `Experiment.summarize`. Padded eval examples carry
``mask == 0`` and must add nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax.numpy as jnp
import optax

import replicator as rp
from replicator.errors import ConfigError
from replicator.parallel.diloco import DiLoCo
from replicator.replicator import Replicator
from replicator.trainer.optimizer import OptimizerSpec, make_optimizer

PyTree = Any
Batch = Mapping[str, Any]


@dataclasses.dataclass(frozen=True)
class Settings:
    """What the trainer tells an experiment: explicit values, never the whole config.

    Attributes:
      repl: the Replicator (mesh, ``axis_name``, precision policy).
      model: the config's ``model`` dict, the experiment's own keyword arguments.
      learning_rate: the config's peak learning rate.
      optimizer: the name of an optax alias taking ``learning_rate`` (``"adam"``).
      num_train_steps: how many steps the run trains.
      grad_accum_steps: microbatches per replica batch (`rp.TrainState`).
      seed: the run's seed.
      sync: the optimizer's synchronisation: None (every step) or `rp.DiLoCo`.
      optimizer_spec: the config's optimizer keys (schedule, decay, clipping, EMA,
        freezing); None: ``optimizer`` at a constant ``learning_rate``.
      remat_policy: the config's ``remat_policy`` (`replicator.step.remat`); an experiment
        whose model names no tensors refuses anything but None.
      pipeline_microbatches: the config's ``pipeline_microbatches``: how many
        pieces a layer stack's pipeline (`rp.pipeline`, over the mesh's ``stage``
        axis) cuts the batch into; None: one per stage.
      pipeline_repeats: the config's ``pipeline_repeats``: 1 for GPipe, more for a
        circular schedule. An experiment whose model is not a layer stack refuses
        a ``stage`` axis.
      context_strategy: the config's ``context_strategy`` ('gather' or 'ring'): how
        attention runs over a sequence split on the mesh's ``context`` axis
        (`rp.context_attention`).
      context_load_balance: the config's ``context_load_balance``: sequences reordered
        so that the ``context`` shards share the causal work evenly. An experiment
        whose model has no attention over a sequence refuses a ``context`` axis.
      tokenizer: the config's ``tokenizer`` (a language model's: ``"bytes"`` or a
        tokenizer file); None where no config gave one.
      dataset: the config's ``dataset``, for an experiment that checks what its data
        holds (the LM: which tokenizer made it); None where no config gave one.
      pack_documents: the config's ``pack_documents``: a language model's windows
        hold several documents, each attended to, positioned and predicted alone.
    """

    repl: Replicator
    model: Mapping[str, Any]
    learning_rate: float
    optimizer: str
    num_train_steps: int
    grad_accum_steps: int
    seed: int
    sync: DiLoCo | None = None
    optimizer_spec: OptimizerSpec | None = None
    remat_policy: str | None = None
    pipeline_microbatches: int | None = None
    pipeline_repeats: int = 1
    context_strategy: str = "gather"
    context_load_balance: bool = False
    tokenizer: str | None = None
    dataset: str | None = None
    pack_documents: bool = False

    def refuse_pipeline(self, experiment: str) -> None:
        """Raises a one-line `ConfigError` when the config asks ``experiment``, whose
        model is no stack of layers, for a pipeline (a ``stage`` axis or its keys)."""
        asked = "stage" in self.repl.mesh.axis_names or self.pipeline_microbatches is not None
        if asked or self.pipeline_repeats != 1:
            raise ConfigError(
                f"a pipeline (mesh axis 'stage', pipeline_microbatches, pipeline_repeats): "
                f"the model of {experiment} is no stack of layers to split over stages; "
                "pipelines apply to the LM (experiments.lm)"
            )

    def refuse_context(self, experiment: str) -> None:
        """Raises a one-line `ConfigError` when the config asks ``experiment``, whose
        model attends over no sequence, for context parallelism (a ``context`` axis)."""
        if "context" in self.repl.mesh.axis_names:
            raise ConfigError(
                f"mesh axis 'context' splits a sequence's attention, but the model of "
                f"{experiment} has none; context parallelism applies to the LM (experiments.lm)"
            )

    @property
    def spec(self) -> OptimizerSpec:
        """The optimizer keys (`OptimizerSpec`), from the config or the fields above."""
        if self.optimizer_spec is not None:
            return self.optimizer_spec
        return OptimizerSpec(
            name=self.optimizer,
            learning_rate=self.learning_rate,
            num_train_steps=self.num_train_steps,
        )

    def make_optimizer(self, learning_rate: float | None = None) -> optax.GradientTransformation:
        """The configured optimizer (`replicator.trainer.optimizer.make_optimizer`: the alias
        on its schedule, weight decay, freezing, EMA), wrapped for the replicas
        (`repl.wrap_optimizer`: the gradients summed, their norm kept and clipped).

        Args:
          learning_rate: the peak rate instead of the config's (e.g. a GAN's second
            optimizer); the schedule's shape stays the config's.
        """
        spec = self.spec
        reduce = None if spec.grad_reduce_dtype is None else rp.narrow_sum(jnp.bfloat16)
        return self.repl.wrap_optimizer(
            make_optimizer(spec, learning_rate),
            sync=self.sync,
            aggregate=reduce,
            clip_norm=spec.grad_clip_norm,
            track_norm=True,
        )


@dataclasses.dataclass(frozen=True)
class Experiment:
    """A task, as the trainer runs it.

    Attributes:
      preprocess: ``preprocess(batch) -> batch`` on the host, numpy in, numpy out,
        on a batch of examples stacked along axis 0.
      init_state: ``init_state(rng, example) -> state``: the initial train state
        (any pytree; usually an `rp.TrainState`, or several), shaped by one
        preprocessed example. Traced once, with its output placed mirrored.
      train_step: ``train_step(state, batch) -> (state, sums)``, written per
        replica; ``sums`` leaves are sums over this replica's examples.
      eval_step: ``eval_step(eval_state, batch) -> sums`` over the examples whose
        ``batch["mask"]`` is 1.
      summarize: ``summarize(sums) -> {name: float}`` on the host, for the train
        step's sums (train records) and the eval step's (eval records).
      metric_names: the names ``summarize`` reports for eval sums; the config's
        ``best_metric`` must be one of them.
      eval_state: ``eval_state(state) -> dict`` of the top-level fields eval
        needs (e.g. ``{"params": ..., "model_state": ...}``): ``eval`` restores
        only those from a checkpoint.
      units: what ``examples_per_sec`` counts per example, e.g. ``("tokens",
        1024)`` for a language model (``tokens_per_sec`` then too).
      after_eval: optional ``after_eval(eval_state, workdir, step)``, called on
        process 0 after each eval (e.g. a GAN writes a grid of samples).
    """

    preprocess: Callable[[Batch], Batch]
    init_state: Callable[[Any, Batch], PyTree]
    train_step: Callable[[PyTree, Batch], tuple[PyTree, PyTree]]
    eval_step: Callable[[PyTree, Batch], PyTree]
    summarize: Callable[[Mapping[str, Any]], dict[str, float]]
    metric_names: tuple[str, ...]
    eval_state: Callable[[PyTree], dict] = lambda state: {
        "params": state.params,
        "model_state": state.model_state,
    }
    units: tuple[str, int] = ("examples", 1)
    after_eval: Callable[[PyTree, str, int], None] | None = None
