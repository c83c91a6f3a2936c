"""The experiment config: its schema, validated before anything compiles.

Configs are plain Python files with ``get_config()`` returning an
`ml_collections.ConfigDict`; absl's ``--config.key=value`` overrides are
type-checked by ml_collections. This module checks the rest: every required key
is there, no key is unknown (a typo must not silently fall back to a default),
and every value has the right type. Only the trainer reads configs.
"""

from __future__ import annotations

import difflib
import importlib.util
import json
from typing import Any

import ml_collections

# key -> (allowed types, default or _REQUIRED). None in the types allows None.
_REQUIRED = object()
SCHEMA: dict[str, tuple[tuple, Any]] = {
    # What to train.
    "experiment": ((str,), _REQUIRED),  # dotted module path, e.g. "experiments.classify"
    "model": ((dict,), _REQUIRED),  # keyword arguments of the experiment's model
    "dataset": ((str,), _REQUIRED),  # tfds name
    "data_dir": ((str, None), None),
    "train_split": ((str,), "train"),
    "eval_split": ((str,), "test"),
    # How long and how fast.
    "batch_size": ((int,), _REQUIRED),  # global, across all replicas
    "eval_batch_size": ((int, None), None),  # None: batch_size
    "num_train_steps": ((int,), _REQUIRED),
    "learning_rate": ((float,), _REQUIRED),
    "optimizer": ((str,), "adam"),  # any optax alias taking learning_rate
    "seed": ((int,), _REQUIRED),
    "grad_accum_steps": ((int,), _REQUIRED),
    # Where and how precisely.
    "mesh": ((dict,), _REQUIRED),
    "precision": ((str, None), _REQUIRED),
    "matmul_precision": ((str, None), None),  # jax.default_matmul_precision, e.g. "tensorfloat32"
    "nonfinite": ((str,), "halt"),  # a non-finite update: "halt" the run or "skip" it
    "step_path": ((str,), "run"),  # "run" (per-replica) or "compile" (global view)
    # Periodic work.
    "log_every_steps": ((int,), 10),
    "eval_every_steps": ((int,), _REQUIRED),
    "checkpoint_every_steps": ((int,), _REQUIRED),
    "profile_steps": ((str, None), None),  # "START,END": a JAX profiler trace of those steps
    "keep_checkpoints": ((int,), 3),  # the latest N
    "keep_best_checkpoints": ((int,), 0),  # plus the best N by best_metric
    "best_metric": ((str,), "accuracy"),
    "best_mode": ((str,), "max"),
}

MINIMUM = {
    "batch_size": 1,
    "eval_batch_size": 1,
    "num_train_steps": 1,
    "grad_accum_steps": 1,
    "log_every_steps": 1,
    "eval_every_steps": 1,
    "checkpoint_every_steps": 1,
    "keep_checkpoints": 1,
    "keep_best_checkpoints": 0,
}

CHOICES = {
    "step_path": ("run", "compile"),
    "precision": (None, "fp32", "bf16", "fp16"),
    "best_mode": ("max", "min"),
    "nonfinite": ("halt", "skip"),
    "matmul_precision": (
        None,
        "default",
        "high",
        "highest",
        "bfloat16",
        "tensorfloat32",
        "float32",
    ),
    "best_metric": ("accuracy", "loss"),
}


def validate(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """Checks ``config`` against `SCHEMA` and fills in the optional keys' defaults.

    Args:
      config: a training config.

    Returns:
      A copy with defaults filled in.

    Raises:
      ValueError: naming every unknown, missing or mistyped key (with the closest
        known key for a likely typo) and every out-of-range value.
    """
    values = config.to_dict()
    problems = []
    for key in sorted(set(values) - set(SCHEMA)):
        close = difflib.get_close_matches(key, SCHEMA, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        problems.append(f"unknown key {key!r}{hint}")
    for key, (types, default) in SCHEMA.items():
        if key not in values:
            if default is _REQUIRED:
                problems.append(f"missing required key {key!r}")
            else:
                values[key] = default
            continue
        problem = _type_problem(key, values[key], types)
        if problem:
            problems.append(problem)
    if not problems:
        problems += _range_problems(values)
    if problems:
        raise ValueError("Invalid config:\n  - " + "\n  - ".join(problems))
    return ml_collections.ConfigDict(values)


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
    if importlib.util.find_spec(values["experiment"].split(".")[0]) is None:
        problems.append(f"'experiment'={values['experiment']!r} cannot be imported")
    return problems


def to_json(config: ml_collections.ConfigDict) -> str:
    """The resolved config as JSON, for the workdir and checkpoints."""
    return json.dumps(config.to_dict(), indent=2, sort_keys=True, default=str)
