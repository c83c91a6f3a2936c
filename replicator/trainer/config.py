"""The training config: one table of keys with their defaults, validated before anything runs.

Configs are plain Python files whose ``get_config()`` starts from `base_config`
(every key below with its default, so every key can be overridden from the
command line on every config) and sets what its experiment needs. `SCHEMA` holds
the keys every experiment shares; an experiment declares its own (top-level
keys, the keys of its ``model`` dict, the mesh axes it uses) as
`replicator.trainer.ConfigKeys` in its module's ``CONFIG_KEYS``, and `complete`
adds them, with their defaults, to a config as it is read, so that
``--config.model.num_experts=4`` or ``--config.mesh.stage=2`` can be given for
any of them. absl's ``--config.key=value`` overrides are type-checked by
ml_collections. `validate` checks the rest, the trainer's keys and the
experiment's together: every required key is set, no key is unknown (a typo must
not silently fall back to a default), every value has the right type and range,
and the experiment's own ``check`` passes. Only the trainer reads configs.
"""

from __future__ import annotations

import difflib
import importlib.util
import inspect
import json
import os
import re
from collections.abc import Callable
from typing import Any

import ml_collections
from ml_collections.config_dict import placeholder

from replicator import storage
from replicator.errors import ConfigError as ConfigError
from replicator.parallel import mesh as mesh_lib
from replicator.parallel import sharding as sharding
from replicator.trainer.experiment import ConfigKeys, KeyTable, declared_beside, load_config_keys
from replicator.trainer.optimizer import OptimizerSpec

_REQUIRED = object()


# key -> (allowed types, default or _REQUIRED, meaning). None in the types allows None.
SCHEMA: dict[str, tuple[tuple, Any, str]] = {
    # What to train.
    "experiment": ((str,), _REQUIRED, "dotted module path of the experiment"),
    "model": (
        (dict,),
        _REQUIRED,
        "the experiment's model keys (train --help --config FILE lists them)",
    ),
    "dataset": (
        (str,),
        _REQUIRED,
        "tfds name (with /config), 'module:function' returning a split's examples, or "
        "'array_record:PATTERN' with {split}",
    ),
    "data_dir": (
        (str, None),
        None,
        "tfds data_dir (None: $TFDS_DATA_DIR or ~/tensorflow_datasets); passed to a data "
        "function that takes data_dir",
    ),
    "train_split": ((str,), "train", "split to train on"),
    "eval_split": ((str,), "test", "split to evaluate on"),
    # How long and how fast.
    "batch_size": ((int,), _REQUIRED, "global batch, across all replicas and processes"),
    "eval_batch_size": ((int, None), None, "global eval batch (None: batch_size)"),
    "num_train_steps": ((int,), _REQUIRED, "training steps"),
    "learning_rate": ((float,), _REQUIRED, "peak learning rate (at lr_base_batch_size, if set)"),
    "lr_base_batch_size": (
        (int, None),
        None,
        "the batch size learning_rate is meant for; with lr_batch_scaling the rate follows "
        "batch_size",
    ),
    "lr_batch_scaling": (
        (str, None),
        None,
        "None, 'linear' or 'sqrt': learning_rate times (batch_size / lr_base_batch_size) "
        "or its square root",
    ),
    "lr_mults": (
        (tuple, list, None),
        None,
        "(regex, factor) pairs: a parameter's learning rate times the factor of the first "
        "regex that finds its path, e.g. (('backbone/', 0.1),)",
    ),
    "optimizer": ((str,), "adam", "an optax alias taking learning_rate"),
    "optimizer_args": (
        (dict, None),
        None,
        "keyword arguments of the optax alias, e.g. {'b2': 0.95} or {'momentum': 0.9}",
    ),
    "lr_schedule": ((str,), "constant", "'constant', 'cosine', 'linear' or 'rsqrt' (after warmup)"),
    "warmup_steps": ((int,), 0, "steps of linear warmup from 0 to learning_rate"),
    "lr_end_fraction": (
        (float,),
        0.0,
        "the final learning rate of 'cosine' and 'linear', as a fraction of learning_rate",
    ),
    "weight_decay": ((float,), 0.0, "decoupled weight decay, scaled by the learning rate"),
    "weight_decay_mask": (
        (str, None),
        None,
        "regex over parameter paths to decay (None: weights of 2+ dimensions per layer, no bias)",
    ),
    "grad_clip_norm": (
        (float, None),
        None,
        "clip by the global norm of the summed gradient (None: no clipping)",
    ),
    "grad_reduce_dtype": (
        (str, None),
        None,
        "None (sum gradients in their dtype) or 'bf16' (half the bytes on the wire)",
    ),
    "ema_decay": (
        (float, None),
        None,
        "an EMA of the parameters, evaluated beside them (ema_ metrics), e.g. 0.999",
    ),
    "freeze": (
        (str, None),
        None,
        "regex over parameter paths that get no update, no gradient and no backward pass",
    ),
    "init_from": (
        (str, None),
        None,
        "a run's workdir or checkpoints directory (PATH or PATH:STEP) to load parameters from, "
        "or hf:DIR, a Hugging Face checkpoint (its config.json sets the model's shape)",
    ),
    "init_from_rules": (
        (tuple, list, None),
        None,
        "(regex, replacement) pairs renaming checkpoint paths to model paths",
    ),
    "init_from_skip": (
        (str, None),
        None,
        "regex over the state's paths (params/head/kernel) that init_from does not load: "
        "they start freshly initialised",
    ),
    "seed": ((int,), 0, "seed of initialisation, data order and randomness"),
    "grad_accum_steps": ((int,), 1, "microbatches each replica's batch is split into"),
    # Where and how precisely.
    "mesh": ((dict,), {"data": -1}, "mesh axis sizes, e.g. {'data': -1} or {'fsdp': 8}"),
    "dcn_mesh": (
        (dict, None),
        None,
        "axis sizes across TPU slices (or hosts), e.g. {'data': 2}; mesh is then per slice",
    ),
    "rules": (
        (tuple, list, None),
        None,
        "parameter sharding rules, e.g. (('embed', 'fsdp'),) (None: FSDP + Megatron)",
    ),
    "fsdp_min_size": (
        (int,),
        sharding.MIN_SHARD_SIZE,
        "parameters with fewer elements per layer get no automatic FSDP (0: shard all)",
    ),
    "precision": ((str, None), None, "None (fp32), 'bf16' or 'fp16' (dynamic loss scale)"),
    "offload_optimizer_state": (
        (bool,),
        False,
        "keep the optimizer state in host memory between steps (step_path='compile')",
    ),
    "matmul_precision": ((str, None), None, "jax.default_matmul_precision, e.g. 'tensorfloat32'"),
    "nonfinite": ((str,), "halt", "a non-finite update: 'halt' the run or 'skip' it"),
    "step_path": ((str,), "run", "'run' (per replica) or 'compile' (global view)"),
    "diloco": (
        (dict, None),
        None,
        "DiLoCo islands, e.g. {'inner_steps': 50, 'axis': 'data'}: rp.DiLoCo's arguments, "
        "outer_learning_rate/outer_momentum for its Nesterov SGD (None: synchronous)",
    ),
    # Periodic work.
    "log_every_steps": ((int,), 10, "steps between train records"),
    "eval_every_steps": ((int,), _REQUIRED, "steps between evaluations"),
    "checkpoint_every_steps": ((int,), _REQUIRED, "steps between checkpoints"),
    "profile_steps": ((str, None), None, "'START,END': a JAX profiler trace of those steps"),
    "profile_port": (
        (int, None),
        None,
        "on-demand profiling: process i runs a JAX profiler server on port profile_port+i",
    ),
    "keep_checkpoints": ((int,), 3, "keep the latest N checkpoints"),
    "keep_best_checkpoints": ((int,), 0, "also keep the best N by best_metric"),
    "best_metric": ((str, None), None, "the eval metric that ranks checkpoints"),
    "best_mode": ((str,), "max", "'max' or 'min' of best_metric"),
    "writers": (
        (tuple, list),
        ("tensorboard",),
        "record writers besides metrics.jsonl: 'tensorboard', 'wandb'",
    ),
}

MINIMUM = {
    "batch_size": 1, "eval_batch_size": 1, "num_train_steps": 1, "grad_accum_steps": 1,
    "log_every_steps": 1, "eval_every_steps": 1, "checkpoint_every_steps": 1,
    "keep_checkpoints": 1, "keep_best_checkpoints": 0, "seed": 0, "fsdp_min_size": 0,
    "warmup_steps": 0, "weight_decay": 0.0, "lr_base_batch_size": 1,
}  # fmt: skip

CHOICES = {
    "step_path": ("run", "compile"),
    "precision": (None, "fp32", "bf16", "fp16"),
    "best_mode": ("max", "min"),
    "lr_schedule": ("constant", "cosine", "linear", "rsqrt"),
    "lr_batch_scaling": (None, "linear", "sqrt"),
    "grad_reduce_dtype": (None, "bf16"),
    "nonfinite": ("halt", "skip"),
    "matmul_precision": (
        None,
        "default",
        "high",
        "highest",
        "bfloat16",
        "tensorfloat32",
        "float32",
    ),  # fmt: skip
}


def base_config(mode: str = "", modes: tuple[str, ...] = ("smoke",)) -> ml_collections.ConfigDict:
    """Every optional key with its default; a config file sets the required ones.

    Args:
      mode: the ``FILE:MODE`` the config was asked for ("" when none).
      modes: the modes the config file knows; any other is an error, so a
        misspelt ``:smok`` never trains the full run by mistake.

    >>> c = base_config()
    >>> c.optimizer, c.precision, c.keep_checkpoints
    ('adam', None, 3)
    """
    if mode and mode not in modes:
        raise ConfigError(f"unknown config mode {mode!r}; this config's modes: {', '.join(modes)}")
    c = ml_collections.ConfigDict()
    _add_keys(c, {key: row for key, row in SCHEMA.items() if row[1] is not _REQUIRED})
    return c


def diloco_settings(**values: Any) -> ml_collections.ConfigDict:
    """``config.diloco`` with every key and its default, ``values`` on top, so each
    can be overridden (``--config.diloco.inner_steps=50``): `rp.DiLoCo`'s
    arguments, with ``outer_learning_rate`` and ``outer_momentum`` for its
    Nesterov outer step.

    >>> diloco_settings(inner_steps=20).fragments
    1
    """
    settings = ml_collections.ConfigDict(
        {
            "inner_steps": placeholder(int),
            "axis": "data",
            "outer_learning_rate": 0.7,
            "outer_momentum": 0.9,
            "fragments": 1,
            "overlap_steps": 0,
            "mix": 0.5,
            "outer_dtype": placeholder(str),  # None: float32; "bfloat16" halves the bytes
        }
    )
    settings.update(values)
    return settings


def config_beside(config_file: str, name: str, mode: str = "") -> ml_collections.ConfigDict:
    """The config of the file ``name`` in ``config_file``'s directory, for a config
    that varies another: ``config_beside(__file__, "digits_cnn.py", mode)``."""
    path = os.path.join(os.path.dirname(os.path.abspath(config_file)), name)
    spec = importlib.util.spec_from_file_location(os.path.splitext(name)[0], path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(mode)


def experiment_keys(experiment: Any) -> ConfigKeys:
    """The `ConfigKeys` the module named ``experiment`` declares (`load_config_keys`),
    which may not redeclare a key of the trainer's.

    >>> sorted(experiment_keys("experiments.lm").mesh_axes)
    ['context', 'expert', 'stage']
    """
    keys = load_config_keys(experiment)
    if set(keys.options) & set(SCHEMA):
        raise TypeError(f"{experiment}.CONFIG_KEYS declares the trainer's own keys")
    return keys


def optimizer_spec(config: ml_collections.ConfigDict) -> OptimizerSpec:
    """The config's optimizer keys (`OptimizerSpec`), freezing what ``config.freeze`` names
    and what the experiment freezes itself (`ConfigKeys.frozen`: the LM's base weights
    under LoRA): one mechanism for both."""
    spec = OptimizerSpec.from_config(config)
    keys = experiment_keys(config.experiment)
    own = None if keys.frozen is None else keys.frozen(config.to_dict())
    return spec if own is None else spec.also_freezing(*own)


def complete(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """Adds to ``config`` (in place, unlocked for it) every key its experiment declares
    and the config lacks, at its default, ``model``'s included, and every mesh axis the
    experiment declares (``stage``, ...; size 1: none), so that the command line can
    override each; a declared key at None gets its type (a `placeholder`). Returns
    ``config``.

    >>> c = base_config()
    >>> c.experiment, c.model = "experiments.lm", {"num_layers": 2}
    >>> c = complete(c)
    >>> c.remat_policy, c.model.num_layers, c.model.num_heads, c.mesh.to_dict()
    (None, 2, 12, {'context': 1, 'data': -1, 'expert': 1, 'stage': 1})
    """
    keys = experiment_keys(config.get("experiment"))
    with config.unlocked():
        _add_keys(config, keys.options)
        if keys.model is not None and isinstance(config.get("model"), ml_collections.ConfigDict):
            _add_keys(config.model, keys.model)
        if isinstance(config.get("mesh"), ml_collections.ConfigDict):
            for axis in keys.mesh_axes:
                if axis not in config.mesh:
                    config.mesh[axis] = 1  # (no axis: `validate` drops it again)
    return config


def _add_keys(config: ml_collections.ConfigDict, table: KeyTable) -> None:
    """Adds each key of ``table`` that ``config`` lacks, at its default. A key at None gets
    a type (a `placeholder`) for an override to be read as: its own, or any for a dict or
    tuple key (given as a Python literal, --config.k="{'sub': 1}", or set by a file as a
    dict whose keys --config.k.sub=v then overrides)."""
    for key, (types, default, _) in table.items():
        if config.get(key, default) is not None:
            if key not in config:
                config[key] = default
            continue
        kind = object if dict in types or tuple in types else next(t for t in types if t)
        try:
            config[key] = placeholder(kind)
        except TypeError:
            pass  # typed already: a placeholder of the file's


def describe_keys(keys: ConfigKeys | None = None) -> list[tuple[str, str, str]]:
    """``(key, default, meaning)`` for every key of the trainer's, for ``train --help``, and
    with an experiment's ``keys`` its own (``model.KEY`` for its model's) after them."""
    tables = [("", SCHEMA)]
    if keys is not None:
        tables += [("", keys.options), ("model.", keys.model or {})]
    return [
        (prefix + key, "(required)" if default is _REQUIRED else repr(default), meaning)
        for prefix, table in tables
        for key, (_, default, meaning) in table.items()
    ]


def validate(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """Checks ``config`` against `SCHEMA` and its experiment's `ConfigKeys`, and fills in
    the optional keys' defaults.

    Args:
      config: a training config.

    Returns:
      A copy with defaults filled in (the experiment's keys and model keys too).

    Raises:
      ConfigError: naming every unknown, missing or mistyped key (with the closest
        known key for a likely typo, or the experiment beside that declares it), every
        out-of-range value, a mesh axis the experiment does not use, and what the
        experiment's ``check`` finds.
    """
    values = config.to_dict()
    keys = experiment_keys(values.get("experiment"))
    problems = _table_problems(values, {**SCHEMA, **keys.options}, "", values.get("experiment"))
    if keys.model is not None and isinstance(values.get("model"), dict):
        problems += _table_problems(values["model"], keys.model, "model.", None)
    if not problems:
        problems += _range_problems(values) + _library_problems(values)
    if not problems:
        problems += _mesh_problems(values, keys) + list(keys.check(values) if keys.check else ())
    if problems:
        raise ConfigError("Invalid config:\n  - " + "\n  - ".join(problems))
    # An optional axis of size 1 is no axis (`complete` adds them, to be overridden).
    optional = mesh_lib.OPTIONAL_AXES
    values["mesh"] = {a: n for a, n in values["mesh"].items() if a not in optional or n != 1}
    return ml_collections.ConfigDict(values)


def _table_problems(values: dict, table: KeyTable, prefix: str, experiment: Any) -> list[str]:
    """Unknown, missing and mistyped keys of ``values`` (defaults filled in, in place)."""
    problems = []
    for key in sorted(set(values) - set(table)):
        close = difflib.get_close_matches(key, table, n=1)
        owned = not close and isinstance(experiment, str)
        found = declared_beside(experiment, key) if owned else []
        hint = f" (did you mean {prefix + close[0]!r}?)" if close else ""
        hint = f" ({experiment} has no such key; {', '.join(found)} has)" if found else hint
        problems.append(f"unknown key {prefix + key!r}{hint}")
    for key, (types, default, _) in table.items():
        if None in types and values.get(key) == "None":
            values[key] = None  # --config.precision=None: a str key's override is a str
        if key not in values:
            if default is _REQUIRED:
                problems.append(f"missing required key {prefix + key!r}")
            else:
                values[key] = default
            continue
        problem = _type_problem(prefix + key, values[key], types)
        if problem:
            problems.append(problem)
    return problems


def _mesh_problems(values: dict[str, Any], keys: ConfigKeys) -> list[str]:
    """Mesh axes (beyond data, fsdp, tensor) the experiment does not declare, above size 1."""
    usable = (*mesh_lib.MESH_AXES, *keys.mesh_axes)
    problems = []
    for name in ("mesh", "dcn_mesh"):
        for axis, size in (values[name] or {}).items():
            if axis in usable or size == 1:
                continue
            found = declared_beside(values["experiment"], axis, "mesh_axes")
            hint = f"; {', '.join(found)} does" if found else ""
            problems.append(
                f"{name!r} has axis {axis!r} of size {size}, which {values['experiment']} does "
                f"not use (its axes: {', '.join(usable)}){hint}"
            )
    return problems


def _type_problem(key: str, value: Any, types: tuple) -> str | None:
    if value is None:
        return None if None in types else f"{key!r} is None; expected {_names(types)}"
    real_types = tuple(t for t in types if t is not None)
    if isinstance(value, bool) and bool not in real_types:
        return f"{key!r}={value!r} is a bool; expected {_names(types)}"
    if float in real_types and isinstance(value, int):
        return None  # an int learning rate is fine
    if not isinstance(value, real_types):
        return f"{key!r}={value!r} has type {type(value).__name__}; expected {_names(types)}"
    return None


def _names(types: tuple) -> str:
    return " or ".join("None" if t is None else t.__name__ for t in types)


def _range_problems(values: dict[str, Any]) -> list[str]:
    problems = []
    for key, low in MINIMUM.items():
        if values[key] is not None and values[key] < low:
            problems.append(f"{key!r} must be >= {low}, got {values[key]}")
    if values["learning_rate"] <= 0:
        problems.append(f"'learning_rate' must be > 0, got {values['learning_rate']}")
    for key, choices in CHOICES.items():
        if values[key] not in choices:
            problems.append(f"{key!r}={values[key]!r} is not one of {list(choices)}")
    if values["profile_steps"] is not None:
        try:
            start, end = (int(x) for x in values["profile_steps"].split(","))
            assert 1 <= start <= end
        except (ValueError, AssertionError):
            problems.append(
                f"'profile_steps'={values['profile_steps']!r} must be 'START,END' with "
                "1 <= START <= END"
            )
    if values["profile_port"] is not None and not 0 < values["profile_port"] < 65536:
        problems.append(f"'profile_port' must be a port, 1 to 65535, got {values['profile_port']}")
    if values["keep_best_checkpoints"] and values["best_metric"] is None:
        problems.append("'keep_best_checkpoints' > 0 needs 'best_metric' (an eval metric)")
    problems += _optimizer_problems(values)
    if importlib.util.find_spec(values["experiment"].split(".")[0]) is None:
        problems.append(f"'experiment'={values['experiment']!r} cannot be imported")
    return problems


def _optimizer_problems(values: dict[str, Any]) -> list[str]:
    """The ranges of the schedule, decay, clipping, EMA and fine-tuning keys."""
    problems = []
    if values["warmup_steps"] > values["num_train_steps"]:
        problems.append(
            f"'warmup_steps'={values['warmup_steps']} is more than "
            f"'num_train_steps'={values['num_train_steps']}"
        )
    if not 0.0 <= values["lr_end_fraction"] <= 1.0:
        problems.append(f"'lr_end_fraction' must be in [0, 1], got {values['lr_end_fraction']}")
    if values["offload_optimizer_state"] and values["step_path"] != "compile":
        problems.append(
            "'offload_optimizer_state' needs step_path='compile' (the global view moves the "
            "state between host and device memory inside the step)"
        )
    if values["grad_clip_norm"] is not None and values["grad_clip_norm"] <= 0:
        problems.append(f"'grad_clip_norm' must be > 0 (or None), got {values['grad_clip_norm']}")
    if values["ema_decay"] is not None and not 0.0 < values["ema_decay"] < 1.0:
        problems.append(f"'ema_decay' must be in (0, 1) (or None), got {values['ema_decay']}")
    if values["weight_decay_mask"] is not None and not values["weight_decay"]:
        problems.append("'weight_decay_mask' is set but 'weight_decay' is 0: nothing is decayed")
    for key in ("weight_decay_mask", "freeze", "init_from_skip"):
        if values[key] is not None:
            try:
                re.compile(values[key])
            except re.error as e:
                problems.append(f"{key!r}={values[key]!r} is not a regex: {e}")
    rules = values["init_from_rules"]
    if rules is not None and not all(
        isinstance(r, (tuple, list)) and len(r) == 2 and all(isinstance(x, str) for x in r)
        for r in rules
    ):
        problems.append(
            f"'init_from_rules'={rules!r} must be (regex, replacement) pairs, e.g. "
            "(('^params/encoder/', 'params/'),)"
        )
    else:
        for regex, replacement in rules or ():
            try:
                re.compile(regex).sub(replacement, "")
            except (re.error, IndexError) as e:
                problems.append(f"'init_from_rules' has {(regex, replacement)!r}: {e}")
    problems += _fine_tuning_problems(values)
    unknown = sorted(set(values["writers"]) - {"tensorboard", "wandb"})
    if unknown:
        problems.append(f"'writers' has {unknown}; the writers are 'tensorboard' and 'wandb'")
    return problems


def _fine_tuning_problems(values: dict[str, Any]) -> list[str]:
    """``lr_mults`` as (regex, factor > 0) pairs; ``lr_batch_scaling`` with its base."""
    problems = []
    if values["lr_batch_scaling"] is not None and values["lr_base_batch_size"] is None:
        problems.append(
            f"'lr_batch_scaling'={values['lr_batch_scaling']!r} needs 'lr_base_batch_size', "
            "the batch size 'learning_rate' is meant for"
        )
    mults = values["lr_mults"]
    if mults is None:
        return problems
    pairs = all(
        isinstance(m, (tuple, list)) and len(m) == 2 and isinstance(m[0], str)
        and isinstance(m[1], (int, float)) and not isinstance(m[1], bool)
        for m in mults
    )  # fmt: skip
    if not pairs:
        return problems + [
            f"'lr_mults'={mults!r} must be (regex, factor) pairs, e.g. (('backbone/', 0.1),)"
        ]
    for regex, factor in mults:
        try:
            re.compile(regex)
        except re.error as e:
            problems.append(f"'lr_mults' has {regex!r}, not a regex: {e}")
        if not factor > 0:
            problems.append(
                f"'lr_mults' has {(regex, factor)!r}: a factor must be > 0 (to train nothing "
                "there, use 'freeze')"
            )
    return problems


def _library_problems(values: dict[str, Any]) -> list[str]:
    """What the library would refuse later, said now: the optimizer, the mesh's axes."""
    import optax

    from replicator.parallel import mesh as mesh_lib

    problems = []
    alias = getattr(optax, values["optimizer"], None)
    if not callable(alias):
        problems.append(
            f"'optimizer'={values['optimizer']!r} is not an optax optimizer (e.g. 'adam')"
        )
    else:
        problems += _alias_problems(values["optimizer"], alias, values["optimizer_args"])
    for key in ("mesh", "dcn_mesh"):
        if values[key] is None:
            continue
        try:  # refitting to one device checks the axes' names and sizes, and only those
            mesh_lib.refit_axis_sizes(values[key], 1)
        except (TypeError, ValueError) as e:
            problems.append(f"{key!r}={values[key]!r}: {e}")
    return problems


def _alias_problems(name: str, alias: Callable, args: dict | None) -> list[str]:
    """``optimizer_args`` the optax alias does not take (the trainer passes learning_rate,
    and weight_decay to adamw, itself)."""
    parameters = inspect.signature(alias).parameters
    own = {"learning_rate", *(("weight_decay", "mask") if "weight_decay" in parameters else ())}
    takes = [p for p in parameters if p not in own]
    wrong = sorted(set(args or {}) - set(takes))
    if not wrong:
        return []
    why = [k for k in wrong if k in own]
    said = f" ({', '.join(why)}: a config key of its own)" if why else ""
    return [f"'optimizer_args' has {wrong}{said}; optax.{name} takes {takes}"]


def read_saved(workdir: str) -> dict | None:
    """The config a run in ``workdir`` saved (``config.json``), or None if there is none."""
    path = storage.join(workdir, "config.json")
    try:
        saved = json.loads(storage.read_text(path))
    except FileNotFoundError:
        return None
    except storage.StorageError:
        raise
    except (OSError, ValueError) as e:  # ValueError: not JSON, or not text at all
        raise ConfigError(
            f"{path} cannot be read as a run's config ({type(e).__name__}: {e}); restore it "
            "from a copy, or move it aside"
        ) from None
    if not isinstance(saved, dict):
        raise ConfigError(f"{path} holds a {type(saved).__name__}, not a run's config")
    return saved


# Keys every config had, at these defaults, before they became the LM's own: a run saved
# then holds them whatever its experiment (`from_saved` drops them where it has none).
_NOW_THE_LMS = {
    "tokenizer": "bytes", "pack_documents": False, "remat_policy": None,
    "pipeline_microbatches": None, "pipeline_repeats": 1, "context_strategy": "gather",
    "context_load_balance": False,
}  # fmt: skip


def from_saved(saved: dict) -> ml_collections.ConfigDict:
    """A run's saved config (`read_saved`) as a config whose every key can be overridden
    as in a config file: `base_config`'s and the experiment's keys keep their types
    when saved as None (`complete`).

    >>> config = from_saved({"experiment": "experiments.gan", "model": {}, "tokenizer": "bytes"})
    >>> "tokenizer" in config, config.model.noise
    (False, 'replica')
    """
    config = base_config()
    declared = experiment_keys(saved.get("experiment")).options
    for key, value in saved.items():
        if key in _NOW_THE_LMS and key not in declared and value == _NOW_THE_LMS[key]:
            continue
        if value is not None or key not in config:
            config[key] = value
    return complete(config)


def to_json(config: ml_collections.ConfigDict) -> str:
    """The resolved config as JSON, for the workdir and checkpoints."""
    return json.dumps(config.to_dict(), indent=2, sort_keys=True, default=str)


def write_json(config: ml_collections.ConfigDict, path: str) -> None:
    """Writes `to_json` to ``path`` (local or a bucket) on process 0, atomically."""
    import jax

    if jax.process_index() != 0:
        return
    storage.write_text(path, to_json(config))


def config_differences(
    saved: dict, current: dict, prefix: str = "", *, added_ok: Callable[[str], bool] | None = None
) -> list[str]:
    """Lists the keys whose values differ between two config dicts; a key that
    ``saved`` lacks is no difference where ``added_ok(key)`` says so (a key a
    newer config file brought, left at its value).

    >>> config_differences({"a": 1, "m": {"b": 2}}, {"a": 1, "m": {"b": 3}, "c": 0})
    ['c: (absent) -> 0', 'm.b: 2 -> 3']
    >>> config_differences({"m": {"b": 2}}, {"m": {"b": 2, "c": 0}}, added_ok=lambda k: True)
    []
    """
    out = []
    for key in sorted(saved.keys() | current.keys()):
        old, new = saved.get(key, "(absent)"), current.get(key, "(absent)")
        if isinstance(old, dict) and isinstance(new, dict):
            out += config_differences(old, new, f"{prefix}{key}.", added_ok=added_ok)
        elif old == "(absent)" and added_ok is not None and added_ok(f"{prefix}{key}"):
            continue
        elif _normalize(old) != _normalize(new):
            out.append(f"{prefix}{key}: {old} -> {new}")
    return out


def _normalize(value: Any) -> Any:
    # JSON turns tuples into lists; compare them as equal.
    return json.loads(json.dumps(value, default=str)) if value != "(absent)" else value
