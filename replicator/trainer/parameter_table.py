"""A model's parameters as the optimizer keys see them: the rows of
``python -m replicator params`` (`replicator.trainer.params_command`), and what the
trainer's setup warns of (a ``freeze`` or ``lr_mults`` that takes every parameter)
or says of a regex written for the train state's paths.

Paths: ``freeze``, ``lr_mults`` and ``weight_decay_mask`` see a parameter's keys
joined by ``/`` within the parameters (``Conv_0/kernel``); ``init_from_rules`` and
``init_from_skip`` see the whole train state's paths, which start with its field
(``params/Conv_0/kernel``, ``model_state/...``).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import jax
import ml_collections
import numpy as np

from replicator.step.state import TrainState
from replicator.trainer import config as config_lib
from replicator.trainer import optimizer
from replicator.trainer.optimizer import OptimizerSpec


@dataclasses.dataclass(frozen=True)
class Row:
    """One parameter array: its path (within its train state's parameters), shape,
    dtype, and what the optimizer keys do to it."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    frozen: bool
    lr_mult: float
    decayed: bool

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


def parameter_rows(params: Any, spec: OptimizerSpec) -> list[Row]:
    """The rows of one train state's ``params`` (abstract or real) under ``spec``.

    >>> import jax.numpy as jnp
    >>> params = {"Dense_0": {"kernel": jnp.zeros((3, 4)), "bias": jnp.zeros(4)}}
    >>> [(r.path, r.frozen) for r in parameter_rows(params, OptimizerSpec(freeze="bias"))]
    [('Dense_0/bias', True), ('Dense_0/kernel', False)]
    """
    leaves = jax.tree.leaves(params)
    frozen = jax.tree.leaves(optimizer.matching(spec.freeze, params))
    decayed = jax.tree.leaves(
        optimizer.matching(spec.weight_decay_mask, params, optimizer.decays_by_default)
    )
    pairs = tuple(spec.lr_mults)
    rows = []
    for name, x, f, d in zip(optimizer.path_names(params), leaves, frozen, decayed):
        found = optimizer.first_match(pairs, name)
        rows.append(Row(
            name, tuple(np.shape(x)), str(np.dtype(x.dtype)), bool(f),
            1.0 if found is None else float(pairs[found][1]),
            bool(d) and bool(spec.weight_decay) and not f,  # (a frozen one: nothing to decay)
        ))  # fmt: skip
    return rows


def coverage_warnings(spec: OptimizerSpec, rows: list[Row]) -> list[str]:
    """A line for a ``freeze`` that freezes every parameter, and for an ``lr_mults``
    pair that takes every one (none taking any is the config check's error): such a
    regex is almost always a path written for another model.

    >>> rows = [Row("Conv_0/kernel", (3, 3), "float32", True, 1.0, False)]
    >>> coverage_warnings(OptimizerSpec(freeze="^(?!head/)"), rows)[0][:56]
    "config.freeze='^(?!head/)' freezes every parameter (9 of"
    """
    total = sum(r.size for r in rows)
    lines = []
    if spec.freeze is not None and rows and all(r.frozen for r in rows):
        lines.append(
            f"{spec.freezing} freezes every parameter ({total:,} of {total:,} "
            f"in {len(rows)} arrays): nothing trains. `python -m replicator params --config "
            "...` lists the paths (e.g. " + ", ".join(r.path for r in rows[:3]) + ")"
        )
    for i, (regex, factor) in enumerate(spec.lr_mults):
        taken = [r for r in rows if optimizer.first_match(spec.lr_mults, r.path) == i]
        if rows and len(taken) == len(rows):
            lines.append(
                f"config.lr_mults: ({regex!r}, {factor!r}) takes every parameter ({total:,} "
                f"in {len(rows)} arrays): it scales the whole learning rate; "
                "`python -m replicator params --config ...` lists the paths"
            )
    return lines


def state_rows(abstract_state: Any, spec: OptimizerSpec) -> dict[str, list[Row]]:
    """``{where: rows}`` for every `rp.TrainState` in the state (``where`` is its path
    in the state, '' for a state that is one)."""
    is_state = lambda x: isinstance(x, TrainState)
    found = jax.tree_util.tree_flatten_with_path(abstract_state, is_leaf=is_state)[0]
    return {
        optimizer.path_name(path): parameter_rows(x.params, spec)
        for path, x in found
        if is_state(x)
    }


def model_state_paths(abstract_state: Any) -> list[tuple[str, tuple[int, ...]]]:
    """The state's arrays that are model state (batch statistics and the like): their
    paths in the whole state, as ``init_from_skip`` sees them, and shapes."""
    leaves = jax.tree_util.tree_flatten_with_path(abstract_state)[0]
    named = [(optimizer.path_name(path), np.shape(x)) for path, x in leaves]
    return [(name, tuple(shape)) for name, shape in named if "model_state/" in f"/{name}"]


def table(rows: list[Row], spec: OptimizerSpec) -> list[str]:
    """The rows as aligned text: a column for each optimizer key the config sets."""
    head = ["PATH", "SHAPE", "DTYPE", "SIZE"]
    columns = [
        (spec.freeze is not None, "FROZEN", lambda r: "frozen" if r.frozen else ""),
        (bool(spec.lr_mults), "LR_MULT", lambda r: f"x{r.lr_mult:g}"),
        (bool(spec.weight_decay), "DECAYED", lambda r: "decayed" if r.decayed else ""),
    ]
    shown = [(name, cell) for on, name, cell in columns if on]
    cells = [
        [r.path, str(r.shape), r.dtype, f"{r.size:,}", *(cell(r) for _, cell in shown)]
        for r in rows
    ]
    head += [name for name, _ in shown]
    widths = [max(len(line[i]) for line in (head, *cells)) for i in range(len(head))]
    right = {3}  # sizes align right

    def line(values: list[str]) -> str:
        parts = [v.rjust(w) if i in right else v.ljust(w) for i, (v, w) in
                 enumerate(zip(values, widths))]  # fmt: skip
        return "  ".join(parts).rstrip()

    return [line(head), *(line(c) for c in cells)]


def summary(rows: list[Row], spec: OptimizerSpec) -> str:
    """One line: how many parameters, trained and frozen.

    >>> summary([Row("a", (2, 3), "float32", False, 1.0, False)], OptimizerSpec())
    '6 parameters in 1 arrays'
    """
    total = sum(r.size for r in rows)
    line = f"{total:,} parameters in {len(rows)} arrays"
    if spec.freeze is not None:
        frozen = sum(r.size for r in rows if r.frozen)
        line += f": {total - frozen:,} trained, {frozen:,} frozen by {spec.freezing}"
    return line


def report(config: ml_collections.ConfigDict, abstract_state: Any) -> list[str]:
    """What the command prints for a config's abstract state."""
    spec = config_lib.optimizer_spec(config)
    states, lines = state_rows(abstract_state, spec), []
    for where, rows in states.items():
        title = f"{config.experiment}" + (f", {where}" if where else "") + ": "
        lines += [title + summary(rows, spec), *table(rows, spec), ""]
    model_state = model_state_paths(abstract_state)
    if model_state:
        lines.append(f"model state (not trained; init_from loads it): {len(model_state)} arrays")
        width = max(len(name) for name, _ in model_state)
        lines += [f"  {name:<{width}}  {shape}" for name, shape in model_state] + [""]
    where = next(iter(states), "")
    prefix = f"{where}/params/" if where else "params/"
    first = next((rows[0].path for rows in states.values() if rows), "...")
    lines.append(
        "Paths as freeze, lr_mults and weight_decay_mask see them (a regex matches where "
        "re.search finds it); init_from_rules and init_from_skip see the whole state's, "
        f"under {prefix!r} (e.g. {prefix}{first})."
    )
    return lines


def path_hint(regex: str) -> str:
    """For a ``freeze``, ``lr_mults`` or ``weight_decay_mask`` regex that finds no path:
    a hint where it was written for the train state's paths (``params/...``).

    >>> path_hint("^params/head/")
    " (these keys see paths within the parameters, without 'params/': '^head/')"
    >>> path_hint("^(?!head/)")
    ''
    """
    if not re.search(r"(^|[\^(|])params/", regex):
        return ""
    mended = re.sub(r"(^|[\^(|])params/", r"\1", regex)
    return f" (these keys see paths within the parameters, without 'params/': {mended!r})"
