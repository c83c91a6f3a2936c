"""Starting from another run's parameters: ``init_from`` (fine-tuning, warm starts).

``config.init_from`` names a run's workdir or its checkpoints directory (local
or ``gs://``), optionally ``PATH:STEP`` (default: the newest step). Its
parameters and model state (every saved array whose path has a ``params`` or
``model_state`` key) are loaded into the fresh state where a model path takes
them; the optimizer state, step and RNG start fresh. ``init_from_rules``, pairs
``(regex, replacement)`` applied in order with `re.sub`, rename the checkpoint's
paths to the model's (``('^params/backbone/', 'params/')``). ``init_from_skip``, a
regex over the model's paths (``params/head/``), names arrays not to load even where
the checkpoint has them (big_vision's ``dont_load``): they keep their fresh
initialisation, whatever their shape in the checkpoint.

`plan` reads only the checkpoint's metadata and fails, before anything is
written, on a source that is not there or of other shapes; `read` reads the
arrays the plan names onto the state's shardings (Orbax's partial restore:
nothing else is read), also before anything is written, so an unreadable source
fails then too; `place` puts them into the fresh state. A resumed run continues
from its own checkpoint and loads nothing.

``init_from='hf:DIR'`` names a Hugging Face checkpoint instead, mapped by the
experiment (`replicator.trainer.pretrained`, whose `load` reads either kind).
"""

from __future__ import annotations

import dataclasses
import logging
import re
from typing import Any

import jax
import jax.numpy as jnp

from replicator import storage
from replicator.checkpoints.checkpoint import (
    CheckpointMismatchError,
    Checkpoints,
    CorruptCheckpointError,
)
from replicator.errors import ConfigError

log = logging.getLogger("replicator")

_MODEL_KEYS = ("params", "model_state")


@dataclasses.dataclass(frozen=True)
class Plan:
    """What `load` reads: ``sources[model path] = checkpoint path``, and the report."""

    directory: str
    step: int | None  # None: a Hugging Face checkpoint (`replicator.trainer.pretrained`)
    sources: dict[str, str]
    fresh: list[str]
    unused: list[str]
    skipped: list[str] = dataclasses.field(default_factory=list)  # of fresh: init_from_skip's

    def report(self) -> str:
        """The console's line."""
        by_skip = f" ({len(self.skipped)} by init_from_skip)" if self.skipped else ""
        line = (
            f"init_from {self._source()}: loaded {len(self.sources)} arrays, "
            f"{len(self.fresh)} initialised fresh{by_skip}, {len(self.unused)} in the "
            "checkpoint unused"
        )
        return line + (" (listed in log.txt)" if self.fresh or self.unused else "")

    def details(self) -> str:
        """The log's lines: every path, by what happened to it."""
        lines = [f"init_from {self._source()}:"]
        fresh = [f"{p} (init_from_skip)" if p in self.skipped else p for p in self.fresh]
        for title, paths in (
            ("loaded", [f"{m} <- {c}" if m != c else m for m, c in self.sources.items()]),
            ("initialised fresh", fresh),
            ("in the checkpoint, unused", self.unused),
        ):
            lines.append(f"  {title} ({len(paths)}):")
            lines += [f"    {p}" for p in paths]
        return "\n".join(lines)

    def _source(self) -> str:
        return self.directory if self.step is None else f"{self.directory} step {self.step}"


def parse(spec: str) -> tuple[str, int | None]:
    """``PATH`` or ``PATH:STEP`` -> (path, step or None).

    >>> parse("gs://bucket/run:200"), parse("/runs/a"), parse("gs://bucket/run")
    (('gs://bucket/run', 200), ('/runs/a', None), ('gs://bucket/run', None))
    """
    path, colon, step = spec.rpartition(":")
    if colon and step.isdigit() and path and not path.endswith(":/"):
        return path, int(step)
    return spec, None


def checkpoints_dir(path: str) -> str:
    """A run's workdir -> its ``checkpoints`` directory; a checkpoints directory as it is."""
    path = storage.normalize(path)
    inner = storage.join(path, "checkpoints")
    return inner if storage.exists(inner) else path


def model_paths(abstract_state: Any, exclude: tuple[str, ...] = ()) -> dict[str, Any]:
    """The state's parameter and model-state leaves, by path (the checkpoint's naming);
    none under an ``exclude`` prefix (`Experiment.copies`' targets: set from others)."""
    flat = jax.tree_util.tree_flatten_with_path(abstract_state)[0]
    named = ((_name(p), x) for p, x in flat)
    return {n: x for n, x in named if _is_model(n) and not n.startswith(tuple(exclude))}


def copy_leaves(state: Any, copies: tuple[tuple[str, str], ...]) -> Any:
    """``state`` with each leaf under a ``target`` prefix set to (a copy of) the leaf at
    the same path under its ``source`` prefix (`Experiment.copies`).

    >>> import jax.numpy as jnp
    >>> state = {"params": {"w": jnp.ones(2), "reference": {"w": jnp.zeros(2)}}}
    >>> copy_leaves(state, (("params/reference/", "params/"),))["params"]["reference"]["w"]
    Array([1., 1.], dtype=float32)
    """
    if not copies:
        return state
    leaves = {_name(p): x for p, x in jax.tree_util.tree_flatten_with_path(state)[0]}

    def value(path, x):
        name = _name(path)
        for target, source in copies:
            if name.startswith(target):  # (a copy: a donated step must not find a buffer twice)
                return jnp.array(leaves[source + name[len(target) :]], copy=True)
        return x

    return jax.tree_util.tree_map_with_path(value, state)


def _name(path) -> str:
    return jax.tree_util.keystr(tuple(path), simple=True, separator="/")


def _is_model(name: str) -> bool:
    return any(key in _MODEL_KEYS for key in name.split("/"))


def plan(
    spec: str, rules: Any, abstract_state: Any, repl, skip: str | None = None,
    exclude: tuple[str, ...] = (),
) -> Plan:  # fmt: skip
    """Matches the checkpoint's arrays to the state's (reading metadata only).

    Args:
      spec: ``config.init_from``, ``PATH[:STEP]``.
      rules: ``config.init_from_rules``, (regex, replacement) pairs, or None.
      abstract_state: the fresh state's shapes.
      repl: the Replicator.
      skip: ``config.init_from_skip``: a regex over the state's paths not to load.
      exclude: path prefixes neither loaded nor counted (`model_paths`).

    Raises:
      ConfigError: no checkpoint there, an unreadable one, a rule that renames two
        saved arrays to one path, a ``skip`` that finds no path, or shapes that
        differ (every such path listed).
    """
    path, step = parse(spec)
    directory = checkpoints_dir(path)
    try:
        source = Checkpoints(directory, repl, read_only=True)
        steps = source.all_steps()
    except (OSError, ValueError) as e:  # a StorageError too
        raise ConfigError(f"config.init_from={spec!r} cannot be read: {e}") from None
    if not steps:
        raise ConfigError(f"config.init_from={spec!r}: {directory} holds no checkpoint")
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise ConfigError(
            f"config.init_from={spec!r}: no step {step} in {directory}; it has {steps}"
        )
    try:
        saved = source.saved_shapes(step)
    except CorruptCheckpointError as e:
        raise ConfigError(f"config.init_from={spec!r}: {e}") from None
    finally:
        source.close()
    wanted = model_paths(abstract_state, exclude)
    return _match(directory, step, saved, wanted, rules or (), skip)


def _match(
    directory, step, saved: dict[str, tuple], wanted: dict[str, Any], rules, skip=None
) -> Plan:
    names = [n for n in saved if _is_model(n)]
    for regex, _ in rules:
        if not any(re.search(regex, name) for name in names):
            shown = ", ".join(names[:6]) + (", ..." if len(names) > 6 else "")
            raise ConfigError(
                f"config.init_from_rules: {regex!r} matches no path of {directory} step "
                f"{step}; its paths: {shown}"
            )
    renamed: dict[str, str] = {}
    for name in names:
        new = name
        for regex, replacement in rules:
            new = re.sub(regex, replacement, new)
        if new in renamed:
            raise ConfigError(
                f"config.init_from_rules rename both {renamed[new]} and {name} to {new}"
            )
        renamed[new] = name
    skipped = skipped_paths(skip, wanted)
    sources = {m: renamed[m] for m in wanted if m in renamed and m not in skipped}
    wrong = [
        f"{m} {tuple(wanted[m].shape)} <- {c} {saved[c]}"
        for m, c in sources.items()
        if tuple(saved[c]) != tuple(wanted[m].shape)
    ]
    if wrong:
        raise ConfigError(
            f"config.init_from: {len(wrong)} arrays have other shapes in the checkpoint "
            f"(model <- checkpoint): {'; '.join(wrong)}"
        )
    if not sources:
        but = f" but the {len(skipped)} init_from_skip finds" if skipped else ""
        raise ConfigError(
            f"config.init_from: no array of {directory} step {step} fits the model's paths"
            f"{but} (saved e.g. {sorted(renamed)[:3]}, the model's e.g. {sorted(wanted)[:3]}); "
            "rename them with config.init_from_rules"
        )
    fresh = sorted(set(wanted) - set(sources))
    unused = sorted(set(renamed.values()) - set(sources.values()))
    return Plan(directory, step, sources, fresh, unused, sorted(skipped))


def skipped_paths(skip: str | None, wanted: dict[str, Any]) -> set[str]:
    """The model's paths ``skip`` finds (``re.search``); one that finds none is a typo."""
    if skip is None:
        return set()
    found = {m for m in wanted if re.search(skip, m)}
    if not found:
        names = sorted(wanted)
        shown = ", ".join(names[:6]) + (", ..." if len(names) > 6 else "")
        raise ConfigError(
            f"config.init_from_skip={skip!r} matches no path of the model; its paths: {shown}"
        )
    return found


def read(the_plan: Plan, abstract_state: Any, repl) -> dict:
    """The planned arrays, read from the checkpoint onto the shardings of
    ``abstract_state``'s leaves, as nested dicts of the checkpoint's key names."""
    wanted = model_paths(abstract_state)
    like: dict = {}
    for model, saved in the_plan.sources.items():
        node, keys = like, saved.split("/")
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        node[keys[-1]] = wanted[model]
    source = Checkpoints(the_plan.directory, repl, read_only=True)
    try:
        return source.restore(like=like, step=the_plan.step, partial=True)
    except (CheckpointMismatchError, CorruptCheckpointError) as e:
        raise ConfigError(f"config.init_from: {e}") from None
    finally:
        source.close()


def place(the_plan: Plan, arrays: dict, state: Any) -> Any:
    """``state`` with the arrays `read` gave in the leaves the plan names."""

    def value(path, x):
        saved = the_plan.sources.get(_name(path))
        if saved is None:
            return x
        node = arrays
        for key in saved.split("/"):
            node = node[key]
        return node

    return jax.tree_util.tree_map_with_path(value, state)
