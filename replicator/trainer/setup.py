"""From a config to a `Run`: the Replicator, the experiment, its steps and data.

Everything that can fail on bad input (an unknown experiment, a ranking metric
it does not report, a batch that does not split over the replicas) fails here,
before anything is compiled or written.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import logging
import math
import re
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

import replicator as rp
from replicator.errors import ConfigError, UserError
from replicator.parallel import diloco as diloco
from replicator.parallel import groups as groups
from replicator.parallel import mesh as mesh_lib
from replicator.parallel import sharding as sharding
from replicator.replicator import ReduceOp, Replicator
from replicator.spmd.context import get_replica_context, varying_axes
from replicator.step import offload as offload
from replicator.step.state import TrainState
from replicator.trainer import config as config_lib
from replicator.trainer import data, optimizer
from replicator.trainer.experiment import Experiment, Settings
from replicator.trainer.optimizer import OptimizerSpec
from replicator.trainer.parameter_table import coverage_warnings, parameter_rows, path_hint

log = logging.getLogger("replicator")

# For programs that run once, like the state's initialisation, on CPU: XLA's
# optimisations cost more than they save (the digits CNN's init compiles in 0.4 s
# instead of 1.3-2.7 s and runs in 5 ms either way).
_RUN_ONCE = {"xla_backend_optimization_level": 0}


@dataclasses.dataclass
class Run:
    """What `setup` builds from a config: the pieces both train and eval need.

    Attributes:
      config: the validated config.
      repl: the Replicator.
      experiment: the experiment.
      train_step: ``(state, batch) -> (state, sums, status)``, sums reduced.
      eval_step: ``(eval_state, batch) -> (sums, num_examples)``, reduced.
      abstract_state: the train state's shapes and dtypes (``jax.eval_shape``).
      eval_source: the eval split.
      eval_batch_size: the global eval batch, rounded up to split evenly.
    """

    config: ml_collections.ConfigDict
    repl: Replicator
    experiment: Experiment
    train_step: Callable
    eval_step: Callable
    abstract_state: Any
    eval_source: Any
    eval_batch_size: int
    state_shardings: Any
    _init: Callable
    _sources: list = dataclasses.field(default_factory=list)
    settings: Settings | None = None  # what the experiment was made from (its hooks take it)

    def init_state(self) -> Any:
        """A fresh train state, created directly in its shardings (mirrored under data
        parallelism; parameters and optimizer state sharded by the rules otherwise)."""
        cpu = self.repl.mesh.devices.flat[0].platform == "cpu"
        init = self.repl.compile(
            self._init,
            out_shardings=self.state_shardings,
            compiler_options=_RUN_ONCE if cpu else None,
        )
        return init()

    def init_eval_state(self) -> Any:
        """`init_state`'s eval view only (`eval_state`): the optimizer state is never made."""
        init = self.repl.compile(
            lambda: self.eval_state(self._init()),
            out_shardings=self.eval_state(self.state_shardings),
        )
        return init()

    def eval_state(self, state: Any) -> Any:
        """What eval needs of a train state (under DiLoCo: of its outer parameters)."""
        return self.experiment.eval_state(diloco.outer_view(state))

    def train_iterator(self) -> data.TrainIterator:
        """This process's stream of training batches; decoding starts now, on threads."""
        config = self.config
        source = data.load_data_source(
            config.dataset, config.train_split, data_dir=config.data_dir, fill_in_background=True
        )
        self._sources.append(source)
        return data.make_train_iterator(
            source,
            global_batch_size=config.batch_size,
            preprocess=self.experiment.preprocess,
            seed=config.seed,
            process_index=jax.process_index(),
            process_count=jax.process_count(),
        )

    @property
    def optimizer_spec(self) -> OptimizerSpec:
        """The config's optimizer keys, the experiment's own freezing with them
        (`config.optimizer_spec`): what the experiment's optimizer is built from."""
        return self.settings.spec

    def per_step_units(self) -> tuple[int, str]:
        """How many units (examples, tokens) a train step consumes, and their name."""
        unit, per_example = self.experiment.units
        return self.config.batch_size * per_example, unit

    def close(self) -> None:
        """Stops the background decoding of the splits."""
        for source in self._sources:
            if isinstance(source, data.CachedSource):
                source.stop_filling()


def setup(
    config: ml_collections.ConfigDict, *, devices=None, training: bool = True, eval_source=None,
    shapes_only: bool = False,
) -> Run:  # fmt: skip
    """Validates ``config`` and builds the Replicator, experiment, steps and eval data.

    ``eval_source`` stands in for the eval split where given: ``compile`` passes one
    example shaped from the dataset's metadata, so that nothing reads the data; and
    ``shapes_only`` (`Settings.shapes_only`), so that the experiment reads no file
    that changes no shape (the LM's tokenizer).

    ``training=False`` (eval) skips the checks only training needs, such as the
    train batch splitting over these devices, and fits the mesh to the devices
    there are (`_eval_mesh`); training asks for exactly the config's mesh.
    """
    config = config_lib.validate(config)
    sync = sync_policy(config)
    repl = _replicator(config, devices, training)
    spec = config_lib.optimizer_spec(config)
    settings = Settings(
        repl=repl,
        model=config.model.to_dict(),
        learning_rate=config.learning_rate,
        optimizer=config.optimizer,
        num_train_steps=config.num_train_steps,
        grad_accum_steps=config.grad_accum_steps,
        seed=config.seed,
        sync=sync,
        optimizer_spec=spec,
        dataset=config.dataset,
        options={key: config[key] for key in config_lib.experiment_keys(config.experiment).options},
        shapes_only=shapes_only,
    )
    experiment = load_experiment(config.experiment, settings)
    if training:
        _check_training(config, repl)
    if config.best_metric is not None and config.best_metric not in experiment.metric_names:
        raise ConfigError(
            f"config.best_metric={config.best_metric!r} is not a metric {config.experiment} "
            f"reports; it reports {list(experiment.metric_names)}."
        )
    if eval_source is None:
        eval_source = data.load_data_source(
            config.dataset, config.eval_split, data_dir=config.data_dir, fill_in_background=True
        )
    example = jax.tree.map(lambda x: x[0], experiment.preprocess(data.read_batch(eval_source, [0])))
    init = _frozen_in(
        functools.partial(experiment.init_state, jax.random.key(config.seed), example),
        spec.freeze,
    )
    abstract = jax.eval_shape(init)
    _check_optimizer_keys(config, abstract, spec)
    if sync is None:
        with warnings.catch_warnings():
            if not training:
                # Eval reads the parameters onto whatever devices there are: that the
                # training mesh shards some of them less here (say, 128 over 3 devices)
                # was said when training, and asks nothing of the user now.
                warnings.simplefilter("ignore", sharding.ShardingWarning)
            shardings = _state_shardings(repl, abstract)
    else:  # DiLoCo: parameters and inner state in rows, one per group (parallel/groups.py)
        init, shardings = _diloco_layout(repl, sync, init, abstract)
        abstract = jax.eval_shape(init)
    if config.offload_optimizer_state:  # between steps in host memory: TrainState's update
        shardings = _offloaded(shardings)  # fetches it into HBM (offload.in_device_memory)
    train_step, eval_step = _make_steps(repl, experiment, config, shardings)
    unit = _batch_unit(repl)
    eval_batch_size = -(-(config.eval_batch_size or config.batch_size) // unit) * unit
    return Run(
        config, repl, experiment, train_step, eval_step,
        sharding.attach_shardings(abstract, shardings), eval_source, eval_batch_size, shardings,
        init, [eval_source], settings,
    )  # fmt: skip


def _check_training(config: ml_collections.ConfigDict, repl: Replicator) -> None:
    """What only training asks of the devices: the batch splits over the replicas; and a
    warning where a mixture of experts makes a 'context' axis under `run` save nothing."""
    _check_train_batch(config, repl)
    moe = bool(config.get("model", {}).get("num_experts"))
    if config.step_path == "run" and repl.mesh.shape.get("context", 1) > 1 and moe:
        log.warning(
            "step_path='run' with mesh axis 'context' and model.num_experts: a mixture "
            "of experts keeps each replica's whole sequences (its capacity is per "
            "sequence), so the context devices compute alike (exact, but no memory "
            "saving); step_path='compile' splits the sequence over them."
        )


def train_params(state: Any) -> list[Any]:
    """The parameters of every `rp.TrainState` in ``state``."""
    is_state = lambda x: isinstance(x, TrainState)
    return [x.params for x in jax.tree.leaves(state, is_leaf=is_state) if is_state(x)]


def _frozen_in(init: Callable, regex: str | None) -> Callable:
    """``init`` whose train states know what the run freezes (``config.freeze`` and the
    experiment's own: `config.optimizer_spec`; `optimizer.mark_frozen`: their steps
    differentiate the rest only)."""
    if regex is None:
        return init
    return lambda: optimizer.mark_frozen(init(), regex)


def _check_optimizer_keys(config, abstract: Any, spec: OptimizerSpec) -> None:
    """The optimizer keys that need the state to check: a ``freeze``,
    ``weight_decay_mask`` or ``lr_mults`` regex that matches nothing is a typo, not a
    choice; an EMA needs parameters (and no DiLoCo); a bf16 sum needs the per-replica
    path."""
    names = [name for params in train_params(abstract) for name in optimizer.path_names(params)]
    shown = ", ".join(names[:8]) + (f", ... ({len(names)} in all)" if len(names) > 8 else "")
    for key in ("freeze", "weight_decay_mask"):
        regex = config[key]
        if regex is None or any(re.search(regex, name) for name in names):
            continue
        raise ConfigError(
            f"config.{key}={regex!r} matches no parameter path{path_hint(regex)}; the paths: "
            f"{shown}"
        )
    pairs = tuple(config.lr_mults or ())
    taken = {optimizer.first_match(pairs, name) for name in names}
    for i, (regex, factor) in enumerate(pairs):
        if i not in taken:
            raise ConfigError(
                f"config.lr_mults: ({regex!r}, {factor!r}) takes no parameter (the first pair "
                f"whose regex finds a path takes it){path_hint(regex)}; the paths: {shown}"
            )
    for params in train_params(abstract):  # every parameter frozen or scaled: a warning
        for line in coverage_warnings(spec, parameter_rows(params, spec)):
            log.warning("%s", line)
    if config.grad_reduce_dtype is not None and config.step_path == "compile":
        log.warning(
            "config.grad_reduce_dtype=%r changes nothing under step_path='compile' (XLA sums "
            "the gradients in the backward pass, in their dtype); step_path='run' sums them "
            "in it",
            config.grad_reduce_dtype,
        )
    if config.offload_optimizer_state and config.diloco is not None:
        raise ConfigError(
            "config.offload_optimizer_state with config.diloco: DiLoCo's groups keep their "
            "state in rows on the devices; drop one of them"
        )
    if config.ema_decay is not None and config.diloco is not None:
        raise ConfigError(
            "config.ema_decay with config.diloco: the groups' parameters part between "
            "meetings; average the outer parameters in a custom loop instead"
        )
    if config.ema_decay is not None and not names:
        raise ConfigError(
            f"config.ema_decay: {config.experiment}'s state has no rp.TrainState whose "
            "parameters it could average"
        )


def _replicator(config, devices, training: bool) -> Replicator:
    """The config's Replicator: its mesh exactly (training) or refitted to the devices
    there are (eval); a mesh, DCN mesh or rules that do not fit are a `ConfigError`."""
    mesh = dict(config.mesh)
    dcn_mesh = None if config.dcn_mesh is None else dict(config.dcn_mesh)
    if training:
        _check_mesh_fits(mesh, dcn_mesh, devices)
    else:
        mesh, dcn_mesh = _eval_mesh(mesh, dcn_mesh, devices)
    try:
        return Replicator(
            devices=devices,
            mesh=mesh,
            precision=config.precision,
            rules=None if config.rules is None else [tuple(rule) for rule in config.rules],
            dcn_mesh=dcn_mesh,
            min_size=config.fsdp_min_size,
        )
    except ValueError as e:  # the config's mesh, dcn_mesh or rules do not fit these devices
        if isinstance(e, UserError):
            raise
        raise ConfigError(str(e)) from e


def _check_train_batch(config, repl: Replicator) -> None:
    _check_divisible("batch_size", config.batch_size, repl)
    per_replica, accum = config.batch_size // repl.num_replicas, config.grad_accum_steps
    if per_replica % accum:
        raise ConfigError(
            f"config.grad_accum_steps={accum} does not divide the per-replica batch of "
            f"{per_replica} (config.batch_size={config.batch_size} over "
            f"{repl.num_replicas} replicas); use a batch size that is a multiple of "
            f"{accum * repl.num_replicas}."
        )


def _eval_mesh(
    mesh: dict[str, int], dcn_mesh: dict[str, int] | None, devices=None
) -> tuple[dict[str, int], dict[str, int] | None]:
    """The mesh (and DCN mesh) to evaluate on: the run's where it fits these devices,
    else refitted to them (`replicator.parallel.mesh.refit_axis_sizes`) with one line saying so.

    Eval's numbers do not depend on the mesh (every example counts once), so a run
    trained on 8 devices evaluates on 1 or 3 without flags. A multi-slice layout that
    no longer fits the slices (or hosts) there are becomes one flat mesh of both.
    """
    num_devices = jax.device_count() if devices is None else len(devices)
    saved = f"{mesh}" if dcn_mesh is None else f"{mesh} per slice x {dcn_mesh} across slices"
    if dcn_mesh is not None:
        try:
            mesh_lib.hybrid_mesh_devices(mesh, dcn_mesh, devices)
            return mesh, dcn_mesh
        except ValueError:
            mesh = _flat_axes(mesh, dcn_mesh)
    elif _fits(mesh, num_devices):
        return mesh, None
    fitted = mesh_lib.refit_axis_sizes(mesh, num_devices)
    plural = "s" if num_devices > 1 else ""
    log.info(
        "eval on mesh %s (saved: %s; refitted to %d device%s)", fitted, saved, num_devices, plural
    )
    return fitted, None


def _flat_axes(mesh: dict[str, int], dcn_mesh: dict[str, int]) -> dict[str, int]:
    """The axis sizes of ``mesh`` within slices times ``dcn_mesh`` across them; a -1
    within slices stays the one -1 (a -1 across them then counts as 1)."""
    free_within = -1 in mesh.values()
    flat = {}
    for name in mesh_lib.AXES:
        within, across = mesh.get(name, 1), dcn_mesh.get(name, 1)
        if within == -1 or (across == -1 and not free_within):
            flat[name] = -1
        else:
            flat[name] = within * abs(across)
    return flat


def _check_mesh_fits(mesh: dict[str, int], dcn_mesh: dict[str, int] | None, devices) -> None:
    """A train run gets exactly its mesh: one that does not fit the devices is one line
    naming what to pass instead (an invalid or multi-slice mesh fails in build_mesh)."""
    num_devices = jax.device_count() if devices is None else len(devices)
    if dcn_mesh is not None or _fits(mesh, num_devices):
        return
    try:
        fitted = mesh_lib.refit_axis_sizes(mesh, num_devices)
    except ValueError:
        return  # not a mesh at all: build_mesh names the mistake
    needed = math.prod(size for size in mesh.values() if size != -1)
    cpu = (jax.devices() if devices is None else devices)[0].platform == "cpu"
    where = f" (--cpu_devices={needed} on a CPU host)" if cpu else ""
    raise ConfigError(
        f"config.mesh={mesh} needs {'a multiple of ' if -1 in mesh.values() else ''}"
        f"{needed} devices but {num_devices} {'is' if num_devices == 1 else 'are'} available. "
        f"Training uses exactly its mesh: train on {needed} devices{where}, or pass a mesh "
        f'for these, e.g. --config.mesh="{fitted}".'
    )


def _fits(mesh: dict[str, int], num_devices: int) -> bool:
    try:
        mesh_lib.resolve_axis_sizes(mesh, num_devices)
    except ValueError:
        return False
    return True


def sync_policy(config: ml_collections.ConfigDict) -> diloco.DiLoCo | None:
    """The optimizer's synchronisation from ``config.diloco`` (None: every step)."""
    if config.diloco is None:
        return None
    options = dict(config.diloco)
    rate = options.pop("outer_learning_rate", None)
    momentum = options.pop("outer_momentum", None)
    known = {f.name for f in dataclasses.fields(diloco.DiLoCo)} - {"outer_optimizer"}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ConfigError(
            f"config.diloco has unknown keys {unknown}; the keys are "
            f"{sorted(known | {'outer_learning_rate', 'outer_momentum'})}."
        )
    if "inner_steps" not in options:
        raise ConfigError("config.diloco needs inner_steps, e.g. dict(inner_steps=50).")
    if options.get("elastic"):
        raise ConfigError(
            "config.diloco.elastic: the trainer's checkpoints and stop agreement wait for "
            "every process, so elastic islands run in a custom loop "
            "(rp.diloco.ElasticIslands; see the guide)."
        )
    if rate is not None or momentum is not None:
        options["outer_optimizer"] = optax.sgd(
            0.7 if rate is None else rate, momentum=0.9 if momentum is None else momentum,
            nesterov=True,
        )  # fmt: skip
    try:
        return diloco.DiLoCo(**options)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"config.diloco: {e}") from e


def _diloco_layout(repl: Replicator, sync: diloco.DiLoCo, init: Callable, abstract: Any):
    """DiLoCo's state, created in rows, and its shardings (`parallel.groups.initial_rows`)."""
    if repl.mesh.shape["tensor"] > 1:
        raise ConfigError(
            "config.diloco keeps the parameters replicated: use a mesh without tensor."
        )
    return groups.initial_rows(repl.mesh, sync.axis, init, abstract)


def _state_shardings(repl: Replicator, abstract: Any) -> Any:
    """Mirrored under pure data parallelism; else by the Replicator's rules."""
    if repl.mesh.shape["fsdp"] == repl.mesh.shape["tensor"] == 1:
        return jax.tree.map(lambda _: repl.mirrored_sharding, abstract)
    return sharding.state_shardings(abstract, repl.param_shardings, mesh=repl.mesh)


def load_experiment(path: str, settings: Settings) -> Experiment:
    """Imports ``path`` (a module with ``make_experiment``) and makes its experiment."""
    try:
        module = importlib.import_module(path)
    except ModuleNotFoundError as e:
        if e.name is None or not path.startswith(e.name):
            raise  # the experiment itself imports something missing: a real bug
        raise ConfigError(f"config.experiment={path!r} cannot be imported: {e}.") from e
    make = getattr(module, "make_experiment", None)
    if not callable(make):
        raise ConfigError(
            f"config.experiment={path!r} has no make_experiment(settings) function; an "
            "experiment module returns a replicator.trainer.Experiment from it."
        )
    try:
        experiment = make(settings)
    except TypeError as e:
        if "Experiment.__init__()" in str(e):  # the experiment's code, not the config
            raise ConfigError(f"{path}.make_experiment builds an incomplete Experiment: {e}") from e
        raise ConfigError(f"config.model does not fit {path}.make_experiment: {e}") from e
    if not isinstance(experiment, Experiment):
        raise ConfigError(
            f"{path}.make_experiment returned {type(experiment).__name__}, not a "
            "replicator.trainer.Experiment."
        )
    missing = [
        field.name
        for field in dataclasses.fields(Experiment)
        if field.name not in ("after_eval", "metric_names", "units", "copies", "notes")
        and not callable(getattr(experiment, field.name))
    ]
    if missing:
        raise ConfigError(f"{path}.make_experiment's Experiment has no {', '.join(missing)}.")
    names = experiment.metric_names
    if not names or isinstance(names, str) or not all(isinstance(n, str) for n in names):
        raise ConfigError(
            f"{path}.make_experiment's Experiment has metric_names={names!r}; it needs a tuple "
            "of the names its summarize reports for eval sums, e.g. ('loss', 'accuracy')."
        )
    return experiment


def _make_steps(
    repl: Replicator, experiment: Experiment, config, state_shardings: Any
) -> tuple[Callable, Callable]:
    """The experiment's steps on the configured path, their sums reduced across replicas.

    Both keep the state in its shardings from step to step: ``compile`` through
    them (XLA partitions the step), ``run`` as ZeRO (`replicator.parallel.zero`:
    parameters gathered for the step, each device updating its slice).
    """
    train_fn = _with_matmul_precision(experiment.train_step, config.matmul_precision)
    eval_fn = _with_matmul_precision(experiment.eval_step, config.matmul_precision)

    def train_step(state, batch):
        new_state, sums = train_fn(state, batch)
        # Sums of each replica's examples, added up inside the step (one all-reduce;
        # under compile there is one replica and this is the identity).
        return new_state, repl.reduce(ReduceOp.SUM, sums), _status(state, new_state)

    def eval_step(eval_state, batch):
        sums = eval_fn(eval_state, batch), jnp.sum(batch["mask"].astype(jnp.int32))
        return repl.reduce(ReduceOp.SUM, sums)

    if config.step_path == "compile":
        mirrored = repl.mirrored_sharding
        keep = dict(
            in_shardings=(state_shardings, repl.batch_sharding),
            out_shardings=(state_shardings, mirrored, mirrored),
        )
        return repl.compile(train_step, donate_argnums=(0,), **keep), repl.compile(eval_step)

    def train_replicas(state, batch):
        return repl.run(train_step, state, batch, donate_argnums=(0,))

    def eval_replicas(eval_state, batch):
        return repl.run(eval_step, eval_state, batch)

    train_replicas.lower = lambda state, batch: repl.lower(
        train_step, state, batch, donate_argnums=(0,)
    )
    eval_replicas.lower = lambda eval_state, batch: repl.lower(eval_step, eval_state, batch)
    return train_replicas, eval_replicas


def _offloaded(shardings: Any) -> Any:
    """``shardings`` with every `TrainState`'s optimizer state in pinned host memory."""
    is_state = lambda x: isinstance(x, TrainState)
    return jax.tree.map(
        lambda x: x.replace(opt_state=offload.host_shardings(x.opt_state)) if is_state(x) else x,
        shardings,
        is_leaf=is_state,
    )


def _status(old: Any, new: Any) -> dict[str, jax.Array]:
    """Updates skipped this step, and the loss scale, over every `TrainState` in the state."""
    is_state = lambda x: isinstance(x, TrainState)
    olds = [x for x in jax.tree.leaves(old, is_leaf=is_state) if is_state(x)]
    news = [x for x in jax.tree.leaves(new, is_leaf=is_state) if is_state(x)]
    skipped = sum((n.skipped_steps - o.skipped_steps for o, n in zip(olds, news)), jnp.int32(0))
    status = {"skipped": skipped}
    scales = [n.loss_scale.scale for n in news if n.loss_scale is not None]
    if scales:
        status["loss_scale"] = scales[0]
    if olds:  # the first state's: the update count its schedule is at, its gradient's norm
        # (Under DiLoCo one per group of replicas: mirrored, as the max and the mean.)
        status["updates"] = _mirrored(jax.lax.pmax, olds[0].step - olds[0].skipped_steps)
        norm = rp.grad_norm(news[0].opt_state)
        if norm is not None:
            status["grad_norm"] = _mirrored(jax.lax.pmean, norm)
    return status


def _mirrored(reduce: Callable, x: jax.Array) -> jax.Array:
    """``x`` reduced over the replica axes it varies over, so that every process can
    read it (under `Replicator.run`; `compile` hands over the global value)."""
    context = get_replica_context()
    axes = () if context is None else varying_axes(x, context.axis_name)
    return reduce(x, axes) if axes else x


def _with_matmul_precision(fn: Callable, precision: str | None) -> Callable:
    if precision is None:
        return fn

    @functools.wraps(fn)
    def traced_with_precision(*args):
        with jax.default_matmul_precision(precision):
            return fn(*args)

    return traced_with_precision


def _batch_unit(repl: Replicator) -> int:
    processes = jax.process_count()
    return repl.num_replicas * processes // np.gcd(repl.num_replicas, processes)


def _check_divisible(name: str, size: int, repl: Replicator) -> None:
    unit = _batch_unit(repl)
    if size % unit:
        processes = jax.process_count()
        also = f" and {processes} processes" if processes > 1 else ""
        raise ConfigError(
            f"config.{name}={size} does not split evenly over {repl.num_replicas} replicas"
            f"{also}; use a multiple of {unit}."
        )
