"""The Experiment protocol: the one seam between the trainer and a task.

A config names its experiment by dotted module path (``experiments.classify``);
the module has ``make_experiment(settings) -> Experiment``. The trainer never
imports ``experiments/`` itself and knows no metric by name: the experiment
supplies its preprocessing, its initial state (one or several parameter sets
and optimizers: a GAN has two), its train and eval steps, and how the steps'
*sums* become the reported metrics. Its config keys beyond the trainer's (the
LM's ``remat_policy``, its ``model`` keys, the mesh axes it can use) it declares
itself, as `ConfigKeys`: the trainer knows no task's key by name either.

Sums are what make metrics exact on any number of devices, processes and
batches: every leaf a step returns is a sum over examples (a total loss, a count
of correct predictions, a count of real tokens), so the trainer can add them up
across replicas (``repl.reduce(SUM)``), batches and processes, and only then
divide, on the host, in `Experiment.summarize`. Padded eval examples carry
``mask == 0`` and must add nothing.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
import re
from collections.abc import Callable, Mapping
from typing import Any

import jax.numpy as jnp
import optax

import replicator as rp
from replicator.parallel.diloco import DiLoCo
from replicator.replicator import Replicator
from replicator.trainer.optimizer import OptimizerSpec, make_optimizer

PyTree = Any
Batch = Mapping[str, Any]


# A key's declaration: (allowed types, default, meaning); None in the types allows None.
KeyTable = Mapping[str, tuple[tuple, Any, str]]


@dataclasses.dataclass(frozen=True)
class ConfigKeys:
    """The config keys an experiment adds to the trainer's, in one place.

    An experiment module declares them as ``CONFIG_KEYS = ConfigKeys(...)``;
    `replicator.trainer.config` reads it to fill in defaults (so that every key,
    ``model``'s included, can be overridden on the command line), to check every
    key's type, to refuse keys and mesh axes the experiment does not know, and to
    run ``check``: all before anything is written. A module without ``CONFIG_KEYS``
    adds no key, uses no mesh axis beyond the trainer's, and checks its ``model``
    dict itself.

    Attributes:
      options: the top-level keys the experiment adds, ``{name: (types, default,
        meaning)}`` as in the trainer's ``SCHEMA``; `make_experiment` reads their
        values in ``settings.options``.
      model: the keys of ``config.model``, in the same form; None leaves the dict
        to the experiment (any keys).
      mesh_axes: the mesh axes it uses beyond ``data``, ``fsdp`` and ``tensor``
        (``stage``, ``context``, ``expert``); the others are refused.
      check: ``check(values) -> problems``: one line per mistake in the config's
        values (every key present, of its type), e.g. a model the mesh cannot split.
      frozen: ``frozen(values) -> (regex, reason)`` or None: the parameters the
        experiment itself freezes for these values (the LM's base weights under LoRA),
        beside ``config.freeze``; the trainer freezes both in one mechanism
        (`replicator.trainer.optimizer`), ``reason`` names them in its lines.

    >>> ConfigKeys(options={"depth": ((int,), 2, "layers")}).options["depth"][1]
    2
    """

    options: KeyTable = dataclasses.field(default_factory=dict)
    model: KeyTable | None = None
    mesh_axes: tuple[str, ...] = ()
    check: Callable[[Mapping[str, Any]], list[str]] | None = None
    frozen: Callable[[Mapping[str, Any]], tuple[str, str] | None] | None = None


def load_config_keys(experiment: Any) -> ConfigKeys:
    """The `ConfigKeys` of the module named ``experiment`` (its ``CONFIG_KEYS``); none
    where it declares none or cannot be found (the config's validation says so).

    >>> load_config_keys("experiments.gan").mesh_axes
    ()
    """
    if not isinstance(experiment, str) or not re.fullmatch(r"[\w.]+", experiment):
        return ConfigKeys()
    try:
        module = importlib.import_module(experiment)
    except ModuleNotFoundError as e:
        if e.name is None or not f"{experiment}.".startswith(f"{e.name}."):
            raise  # the experiment imports something missing: a real bug
        return ConfigKeys()
    keys = getattr(module, "CONFIG_KEYS", ConfigKeys())
    if not isinstance(keys, ConfigKeys):
        raise TypeError(f"{experiment}.CONFIG_KEYS is no replicator.trainer.ConfigKeys")
    return keys


def declared_beside(experiment: str, name: str, field: str = "options") -> list[str]:
    """The modules beside ``experiment`` (in its package) whose `ConfigKeys` have ``name``
    in ``field`` (``options``, ``mesh_axes``): where a key or mesh axis that
    ``experiment`` does not know belongs, for its error's hint.

    >>> declared_beside("experiments.classify", "tokenizer")
    ['experiments.lm']
    """
    parent = experiment.rpartition(".")[0]
    try:
        found = pkgutil.iter_modules(importlib.import_module(parent).__path__, f"{parent}.")
        names = sorted(info.name for info in found if info.name != experiment)
    except (ImportError, AttributeError, ValueError):
        return []
    owners = []
    for module in names:
        try:
            if name in getattr(load_config_keys(module), field):
                owners.append(module)
        except Exception:  # noqa: BLE001  (a hint only: a module that fails owns nothing)
            continue
    return owners


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
      dataset: the config's ``dataset``, for an experiment that checks what its data
        holds (the LM: which tokenizer made it); None where no config gave one.
      options: the values of the top-level keys the experiment declares
        (`ConfigKeys.options`), e.g. the LM's ``{"remat_policy": "full", ...}``;
        a key left out is at its declared default.
      shapes_only: the steps are only compiled (``python -m replicator compile``):
        nothing runs, so the experiment reads no file that changes no shape (the
        LM: no tokenizer; ``model.vocab_size`` gives the shapes).
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
    dataset: str | None = None
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    shapes_only: bool = False

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
      copies: ``(target, source)`` pairs of path prefixes in the state (``"params/
        reference/"``, ``"params/"``): a fresh state's leaves under ``target`` are set to
        the leaves under ``source`` once its parameters are in place (after
        ``init_from``), and ``init_from`` neither loads nor counts them (the LM's DPO
        reference: a frozen copy of the starting weights). A leaf under both prefixes
        is a target only.
      notes: lines ``compile`` adds to its report of the train step: what the program
        does that its figures do not show (the LM's share of FLOPs on a mixture of
        experts' empty slots).
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
    copies: tuple[tuple[str, str], ...] = ()
    notes: tuple[str, ...] = ()
