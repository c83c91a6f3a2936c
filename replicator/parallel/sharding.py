"""Sharding beyond data parallelism: rules -> shardings, sharded init, a report.

One table of rules says where each parameter lives on the ``("data", "fsdp",
"tensor")`` mesh (`replicator.parallel.mesh`). A rule is one of two forms:

* ``(logical_axis, mesh_axis or None)``: every parameter dimension annotated
  with ``logical_axis`` (Flax's ``nn.with_logical_partitioning``, kept in the
  params as ``nn.LogicallyPartitioned`` boxes) is split over ``mesh_axis``, e.g.
  ``("embed", "fsdp")``, ``("mlp", "tensor")``; ``None`` keeps it whole.
* ``(path_regex, per_dimension_axes)``: a parameter whose path (keys joined by
  ``/``, e.g. ``"params/Dense_0/kernel"``) fully matches the regex is split as
  the tuple (or `PartitionSpec`) says, one entry per leading dimension, e.g.
  ``(r".*kernel", ("fsdp", None))``. This is for models without annotations; a
  path rule that matches wins over the annotations.

A logical rule may name several mesh axes, MaxText's way: ``("embed", ("fsdp",
"data"))`` splits the dimension over both (a key that is a plain name with a
tuple of axis names is always such a rule, never a path regex). Rules whose
logical axis starts with ``activation_`` are for the model's activations
(``nn.with_logical_constraint``), so matching no parameter is expected of them.

Rules are tried in order and the first that applies wins. On top of the rules,
the ``fsdp`` axis always means "split the parameters over these replicas", and
so does ``context`` (its devices split a sequence, and hold the weights as FSDP's
do): a parameter of at least ``min_size`` elements that no rule split over
either gets its largest dimension divisible by their product split over both
(ZeRO/FSDP). ``min_size`` is the threshold of this automatic FSDP, as in
big_vision: rules given explicitly apply whatever the size, while with the
default rules parameters below ``min_size`` stay replicated (gathering them
would cost more than they weigh). Mesh axes of size 1 are dropped from the
specs, so on one device every spec is ``P()``.

Mistakes are named, never silent and never an XLA error: a rule that matches
nothing, a rule naming an axis the mesh lacks, a logical axis two rules claim, a
dimension that does not divide over its mesh axis (kept whole on that
dimension), and a parameter of at least ``min_size`` elements left replicated
on a mesh with ``fsdp`` or ``tensor`` > 1 are a `ShardingError` under
``strict=True`` and a `ShardingWarning` otherwise, naming the parameter path and
its size.

The functions are pure: they take the mesh and rules and return shardings;
`Replicator` calls them with its own.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from replicator.errors import ShardingError as ShardingError
from replicator.parallel import mesh as mesh_lib

PyTree = Any
Rule = tuple[str, Any]

DEFAULT_RULES: tuple[Rule, ...] = (
    ("embed", ("fsdp", "context")),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("layers", "stage"),
    ("exp", "expert"),
)
"""FSDP over the embedding width (over ``fsdp`` and ``context``: a context device
holds a slice of the weights as an FSDP one does, MaxText's placement) and
Megatron-style tensor parallelism (the MLP's hidden width and the attention heads
split over ``tensor``); ``vocab`` and ``kv``
stay whole; a stack of layers splits over ``stage`` when the mesh has one
(`replicator.pipeline`), a mixture's experts over ``expert`` (`replicator.parallel.moe`).
Activations named with `replicator.parallel.activations.constrain` follow
`replicator.parallel.activations.ACTIVATION_RULES` (the batch over ``data`` and ``fsdp``)."""

MIN_SHARD_SIZE = 2**14
"""Parameters with fewer elements (64 KiB in float32) stay replicated."""

PARAMETER_AXES = ("fsdp", "context")
"""The mesh axes that split any large parameter no rule split (automatic FSDP)."""

_AUTO_FSDP = "auto fsdp (largest divisible dimension)"
_SMALL = "below min_size: replicated"


class ShardingWarning(UserWarning):
    """The same problems as `ShardingError`, when not ``strict``."""


class Placement(NamedTuple):
    """Where one parameter went, and why.

    Attributes:
      path: the parameter's path, keys joined by ``/``.
      shape: its global shape.
      dtype: its dtype.
      spec: the `PartitionSpec` it got.
      reasons: the rules that split it (``"('embed', 'fsdp')"``, the automatic
        FSDP, ``"below min_size: replicated"``); empty when nothing did.
    """

    path: str
    shape: tuple[int, ...]
    dtype: Any
    spec: P
    reasons: tuple[str, ...]


class ShardingPlan(NamedTuple):
    """`param_shardings`' result with its reasons, for `sharding_report`.

    Attributes:
      shardings: a pytree of `NamedSharding`, the structure of the parameters.
      placements: one `Placement` per parameter, in tree order.
    """

    shardings: PyTree
    placements: tuple[Placement, ...]


# ------------------------------------------------------------- rules -> specs


def param_shardings(
    abstract_params: PyTree,
    mesh: Mesh,
    rules: Sequence[Rule] | None = None,
    *,
    strict: bool = False,
    min_size: int = MIN_SHARD_SIZE,
) -> PyTree:
    """The `NamedSharding` of every parameter, from logical axes and rules.

    Args:
      abstract_params: the parameters, abstract (``jax.eval_shape(model.init,
        ...)``) or concrete, with or without ``nn.LogicallyPartitioned`` /
        ``nn.Partitioned`` boxes (an ``nn.Partitioned`` box names mesh axes
        directly).
      mesh: the ``("data", "fsdp", "tensor")`` mesh.
      rules: ``(logical_axis, mesh_axis or None)`` and ``(path_regex,
        per_dimension_axes)`` pairs (see the module docstring); None means
        `DEFAULT_RULES`. Explicit rules replace the defaults.
      strict: raise a `ShardingError` for every problem instead of warning.
      min_size: parameters with fewer elements get no automatic FSDP and are
        never reported as left replicated; with the default rules (``rules``
        None) they stay replicated altogether.

    Returns:
      The same structure as ``abstract_params`` (boxes kept, holding the
      sharding) with a `NamedSharding` on ``mesh`` at every array.

    Raises:
      ShardingError: under ``strict``, for any problem listed in the module
        docstring.

    >>> mesh = build_mesh(jax.devices()[:1], {"data": 1})
    >>> param_shardings({"w": jnp.zeros((4, 4))}, mesh)["w"].spec
    P()
    """
    return plan_param_shardings(
        abstract_params, mesh, rules, strict=strict, min_size=min_size
    ).shardings


def plan_param_shardings(
    abstract_params: PyTree,
    mesh: Mesh,
    rules: Sequence[Rule] | None = None,
    *,
    strict: bool = False,
    min_size: int = MIN_SHARD_SIZE,
) -> ShardingPlan:
    """`param_shardings`, with the reason for each parameter's placement.

    Same arguments as `param_shardings`; returns a `ShardingPlan`, whose
    ``placements`` `sharding_report` turns into "which rule sharded what".
    """
    problems = _Problems()
    parsed = _parse_rules(DEFAULT_RULES if rules is None else rules, mesh, problems)
    nodes, treedef = jax.tree_util.tree_flatten_with_path(abstract_params, is_leaf=_is_box)
    used: set[int] = set()
    placements, out = [], []
    for path, node in nodes:
        value = node.value if _is_box(node) else node
        names = tuple(node.names) if isinstance(node, nn.Partitioned) else None
        logical = isinstance(node, nn.LogicallyPartitioned)
        small = math.prod(np.shape(value)) < min_size
        placement = _place(
            _path_str(path), value, names, logical, parsed, mesh, small, rules is None, used,
            problems,
        )  # fmt: skip
        placements.append(placement)
        sharding = NamedSharding(mesh, placement.spec)
        out.append(node.replace_boxed(sharding) if _is_box(node) else sharding)
    if rules is not None:
        _check_unused(parsed, used, placements, nodes, problems)
    problems.report(strict)
    return ShardingPlan(jax.tree_util.tree_unflatten(treedef, out), tuple(placements))


@dataclasses.dataclass(frozen=True)
class _Rule:
    index: int
    key: str
    target: Any  # logical rule: a tuple of mesh axes (empty: whole); path rule: axis tuples
    pattern: re.Pattern | None  # path rules only

    def __str__(self) -> str:
        if self.pattern is None:
            target = self.target[0] if len(self.target) == 1 else self.target or None
            return repr((self.key, target))
        entries = tuple(None if not e else e[0] if len(e) == 1 else e for e in self.target)
        return repr((self.key, entries))


def _parse_rules(rules: Sequence[Rule], mesh: Mesh, problems: _Problems) -> list[_Rule]:
    parsed, claimed = [], {}
    for index, rule in enumerate(rules):
        if not (isinstance(rule, tuple | list) and len(rule) == 2 and isinstance(rule[0], str)):
            raise TypeError(
                f"Sharding rule {rule!r} is neither (logical_axis, mesh_axis or None) nor "
                "(path_regex, (mesh axis or None, ...)) with one entry per dimension."
            )
        key, target = rule
        if _names_mesh_axes(key, target):  # ("embed", ("fsdp", "data")): logical
            known = _known_axes(_as_axes(target), rule, mesh, problems)
            parsed.append(_Rule(index, key, known, None))
            if key in claimed:
                problems.add(
                    "claimed",
                    f"logical axis {key!r} is claimed by two rules, {claimed[key]} and "
                    f"{tuple(rule)!r}; keep one",
                )
            else:
                claimed[key] = tuple(rule)
        elif isinstance(target, tuple | list | P):
            try:
                pattern = re.compile(key)
            except re.error as e:
                raise ShardingError(f"Sharding rule {tuple(rule)!r}: bad path regex: {e}.") from e
            entries = tuple(_known_axes(_as_axes(e), rule, mesh, problems) for e in target)
            parsed.append(_Rule(index, key, entries, pattern))
        else:
            raise TypeError(
                f"Sharding rule {tuple(rule)!r}: the second element must be a mesh axis "
                "name, None, or a tuple with one entry per dimension."
            )
    return parsed


_NAME = re.compile(r"[A-Za-z_]\w*")


def _names_mesh_axes(key: str, target: Any) -> bool:
    """Whether a rule is a logical one: a mesh axis or None, or (MaxText's form) a plain
    name with a tuple of mesh axis names (a path rule's tuple has one entry per
    dimension, and its key is a regex)."""
    if target is None or isinstance(target, str):
        return True
    return (
        isinstance(target, tuple | list)
        and not isinstance(target, P)
        and bool(target)
        and all(isinstance(t, str) for t in target)
        and _NAME.fullmatch(key) is not None
    )


def _as_axes(entry: Any) -> tuple[str, ...]:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple | list) else (entry,)


def _known_axes(axes: tuple[str, ...], rule: Any, mesh: Mesh, problems: _Problems):
    for axis in axes:
        # An optional axis (stage, context, expert) is absent when it has size 1.
        if axis not in mesh.axis_names and axis not in mesh_lib.OPTIONAL_AXES:
            problems.add(
                "axis",
                f"rule {tuple(rule)!r} names mesh axis {axis!r}, which the mesh does not "
                f"have (its axes: {', '.join(mesh.axis_names)})",
            )
    return tuple(a for a in axes if a in mesh.axis_names)


def _place(path, value, names, logical, rules, mesh, small, by_default, used, problems):
    """The `Placement` of one parameter; ``small``: below min_size; ``by_default``: the
    rules are the default ones (which leave small parameters whole)."""
    shape = tuple(np.shape(value))
    dtype = _dtype(value)
    size = math.prod(shape)
    path_rule = next(
        (r for r in rules if r.pattern is not None and r.pattern.fullmatch(path)), None
    )
    if path_rule is not None:
        used.add(path_rule.index)
    if logical:
        used.update(r.index for r in rules if r.pattern is None and r.key in names)
    if small and by_default:
        # Small parameters stay whole, but for the axes of a layer stack's schedule (a
        # pipeline's "stage"): its stages hold their own layers, or gather them.
        rules = [r for r in rules if r.pattern is None and _schedules(r.target)]
        if not (logical and any(r.key in names for r in rules)):
            return Placement(path, shape, dtype, P(), (_SMALL,))

    entries: list[tuple[str, ...]] = [()] * len(shape)
    why: list[str | None] = [None] * len(shape)  # the rule behind each dimension's split
    if path_rule is not None:
        if len(path_rule.target) > len(shape):
            problems.add(
                "rank",
                f"{path} {shape}: rule {path_rule} has {len(path_rule.target)} entries for "
                f"{len(shape)} dimensions; not applied",
            )
        else:
            entries[: len(path_rule.target)] = path_rule.target
            why = [str(path_rule)] * len(shape)
    elif names is not None and logical:
        for dim, name in enumerate(names):
            rule = _logical_rule(name, rules, {a for e in entries for a in e})
            if rule is not None:
                entries[dim], why[dim] = rule.target, str(rule)
    elif names is not None:
        entries = [tuple(a for a in _as_axes(n) if a in mesh.axis_names) for n in names]
        why = [f"nn.Partitioned{tuple(names)!r}"] * len(shape)
    wanted = entries
    entries = _fit(path, shape, entries, mesh, problems)
    # (Left whole because a dimension did not divide: reported once, as that.)
    undivided = any(w and not e for w, e in zip(wanted, entries))
    reasons = [why[dim] for dim in range(len(shape)) if entries[dim]]

    splitting = tuple(a for a in PARAMETER_AXES if mesh.shape.get(a, 1) > 1)
    parts = math.prod(mesh.shape[a] for a in splitting)
    if small:
        if not any(entries):
            reasons.append(_SMALL)
    elif splitting and not any(a in e for e in entries for a in splitting):
        free = [d for d in range(len(shape)) if not entries[d] and shape[d] % parts == 0]
        if free:
            dim = max(free, key=lambda d: (shape[d], -d))
            entries[dim] = splitting
            reasons.append(_AUTO_FSDP)
    if not any(entries) and _is_sharded(mesh) and not undivided and not small:
        problems.add(
            "replicated",
            f"{path} {shape} ({size:,} elements, {_format_bytes(size * dtype.itemsize)}) is "
            "left replicated on every device",
        )
    return Placement(path, shape, dtype, _spec(entries), tuple(dict.fromkeys(reasons)))


def _schedules(axes: tuple[str, ...]) -> bool:
    return bool(axes) and set(axes) <= set(mesh_lib.OPTIONAL_AXES)


def _logical_rule(name: str | None, rules: list[_Rule], taken: set[str]) -> _Rule | None:
    for rule in rules:
        if rule.pattern is None and rule.key == name and name is not None:
            if not rule.target:
                return None
            if not taken.intersection(rule.target):
                return rule
    return None


def _fit(path, shape, entries, mesh, problems) -> list[tuple[str, ...]]:
    """Drops axes of size 1, repeated axes, and splits that do not divide their dimension."""
    fitted, seen = [], set()
    for dim, axes in enumerate(entries):
        axes = tuple(a for a in axes if mesh.shape[a] > 1 and a not in seen)
        parts = math.prod(mesh.shape[a] for a in axes)
        if shape[dim] % parts:
            problems.add(
                "divisible",
                f"{path} {shape}: dimension {dim} of size {shape[dim]} does not divide over "
                f"mesh axes {axes} ({parts} devices); kept whole on that dimension",
            )
            axes = ()
        seen.update(axes)
        fitted.append(axes)
    return fitted


def _spec(entries: list[tuple[str, ...]]) -> P:
    parts = [None if not e else e[0] if len(e) == 1 else e for e in entries]
    while parts and parts[-1] is None:
        parts.pop()
    return P(*parts)


def _is_sharded(mesh: Mesh) -> bool:
    return any(mesh.shape.get(a, 1) > 1 for a in (*PARAMETER_AXES, "tensor"))


def _check_unused(rules, used, placements, nodes, problems) -> None:
    logical_names = sorted(
        {n for _, node in nodes if isinstance(node, nn.LogicallyPartitioned) for n in node.names}
        - {None}
    )
    example = placements[0].path if placements else "(no parameters)"
    for rule in rules:
        if rule.index in used or (rule.pattern is None and rule.key.startswith("activation_")):
            continue
        if rule.pattern is None:
            where = f"no parameter has logical axis {rule.key!r} (the model's: {logical_names})"
        else:
            where = f"no parameter path fully matches {rule.key!r} (paths look like {example!r})"
        problems.add("unused", f"rule {rule} matches nothing: {where}")


class _Problems:
    """Problems found while planning, reported together: one message per kind."""

    _HEADERS = {
        "axis": "Sharding rules name mesh axes the mesh does not have",
        "claimed": "A logical axis is claimed by more than one rule",
        "rank": "A path rule has more entries than the parameter has dimensions",
        "unused": "Sharding rules match nothing (renamed parameters?)",
        "divisible": "Dimensions do not divide over their mesh axes",
        "replicated": "Parameters of min_size or more elements are left replicated on a "
        "sharded mesh (no dimension splits over fsdp); add a rule, or raise min_size",
    }

    def __init__(self):
        self.lines: dict[str, list[str]] = collections.defaultdict(list)

    def add(self, kind: str, line: str) -> None:
        if line not in self.lines[kind]:
            self.lines[kind].append(line)

    # Rules that cannot mean what they say are always errors; the rest are
    # warnings unless strict (a model may legitimately leave them so).
    _ALWAYS = ("axis", "claimed")

    def report(self, strict: bool) -> None:
        messages = [self._message(kind, lines) for kind, lines in self.lines.items()]
        if messages and (strict or any(kind in self.lines for kind in self._ALWAYS)):
            raise ShardingError("\n".join(messages))
        for message in messages:
            warnings.warn(message, ShardingWarning, stacklevel=4)

    def _message(self, kind: str, lines: list[str], limit: int = 6) -> str:
        shown = "\n  ".join(lines[:limit])
        more = f"\n  ... and {len(lines) - limit} more" if len(lines) > limit else ""
        return f"{self._HEADERS[kind]}:\n  {shown}{more}"


# -------------------------------------------------------------- whole states


def state_shardings(
    abstract_state: PyTree,
    shardings_fn: Callable[[PyTree], PyTree],
    *,
    mesh: Mesh | None = None,
) -> PyTree:
    """Shardings for a whole train state: parameters, optimizer state, the rest.

    The parameters are ``abstract_state.params`` (a `TrainState`), or
    ``abstract_state["params"]`` (e.g. ``model.init``'s variables), or else the
    whole tree; they get ``shardings_fn(params)``. Every other leaf whose path
    ends with a parameter's path and has its shape (Adam's ``mu`` and ``nu``, an
    EMA of the parameters) gets that parameter's sharding; the rest (step
    counters, RNG keys, BatchNorm statistics) is replicated.

    Args:
      abstract_state: the state's structure, e.g. ``jax.eval_shape(init_fn)``.
      shardings_fn: parameters -> their `NamedSharding`s, e.g.
        ``functools.partial(param_shardings, mesh=mesh, rules=rules)``.
      mesh: for the replicated leaves; by default the parameters' mesh.

    Returns:
      A pytree of `NamedSharding` with ``abstract_state``'s structure, fit for
      ``jax.jit(..., in_shardings=..., out_shardings=...)`` and `attach_shardings`.
    """
    prefix, params = _find_params(abstract_state)
    param_leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    shardings = jax.tree.leaves(jax.tree.broadcast(shardings_fn(params), params))
    if mesh is None:
        meshes = [s.mesh for s in shardings if isinstance(s, NamedSharding)]
        if not meshes:
            raise ValueError("state_shardings: the parameters have no NamedSharding; pass mesh=.")
        mesh = meshes[0]
    by_path = {path: (np.shape(x), s) for (path, x), s in zip(param_leaves, shardings, strict=True)}
    replicated = NamedSharding(mesh, P())

    def pick(path, x):
        if path[: len(prefix)] == prefix and path[len(prefix) :] in by_path:
            return by_path[path[len(prefix) :]][1]
        for start in range(len(path)):  # the longest matching path suffix first
            match = by_path.get(path[start:])
            if match is not None and match[0] == np.shape(x):
                return match[1]
        return replicated

    return jax.tree_util.tree_map_with_path(pick, abstract_state)


def init_sharded(
    init_fn: Callable[..., PyTree], shardings_fn: Callable[[PyTree], PyTree], *args: Any
) -> PyTree:
    """Runs ``init_fn(*args)`` so that every array is created in its sharding.

    ``jax.eval_shape`` gives the state's structure without computing it,
    `state_shardings` its shardings, and ``jax.jit(init_fn, out_shardings=...)``
    computes each device's shards only: no device ever holds a whole sharded
    parameter or optimizer-state leaf.

    Args:
      init_fn: builds the state, e.g. ``lambda key: model.init(key, x)`` or a
        function returning a `TrainState` (parameters and optimizer state).
      shardings_fn: parameters -> their shardings, as for `state_shardings`.
      *args: ``init_fn``'s arguments (keys, example inputs).

    Returns:
      ``init_fn(*args)``, each array placed as `state_shardings` says.
    """
    abstract = jax.eval_shape(init_fn, *args)
    shardings = state_shardings(abstract, shardings_fn)
    return jax.jit(init_fn, out_shardings=shardings)(*args)


def attach_shardings(abstract: PyTree, shardings: PyTree) -> PyTree:
    """``abstract`` as `jax.ShapeDtypeStruct`s carrying ``shardings``.

    For ``Checkpoints.restore(like=...)`` onto a sharded mesh, or lowering a step
    without real arrays.

    Args:
      abstract: arrays or shape-dtype structs (boxes allowed).
      shardings: a pytree of `Sharding` with ``abstract``'s structure (or a prefix).

    Returns:
      ``abstract``'s structure with a `jax.ShapeDtypeStruct` at every array.
    """
    shardings = jax.tree.broadcast(shardings, abstract)
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=s), abstract, shardings
    )


def _find_params(state: PyTree) -> tuple[tuple, PyTree]:
    if isinstance(state, Mapping):
        if "params" in state:
            return (jax.tree_util.DictKey("params"),), state["params"]
    elif hasattr(state, "params"):
        return (jax.tree_util.GetAttrKey("params"),), state.params
    return (), state


# ------------------------------------------------------------------- report


def bytes_per_device(tree: PyTree) -> int:
    """The largest number of bytes that ``tree``'s arrays occupy on one device.

    Each array counts with its shard on each device of its sharding; a leaf
    without a sharding (numpy, a Python number) counts whole on every device.
    This is the trainer's ``state_bytes_per_device``.

    >>> bytes_per_device({"w": jnp.zeros((4, 4))})
    64
    """
    per_device: dict[Any, int] = collections.Counter()
    everywhere = 0
    for x in jax.tree.leaves(tree):
        sharding = getattr(x, "sharding", None)
        if not isinstance(sharding, jax.sharding.Sharding):
            everywhere += _nbytes(np.shape(x), _dtype(x))
            continue
        for device, index in sharding.devices_indices_map(tuple(np.shape(x))).items():
            shape = tuple(len(range(*s.indices(n))) for s, n in zip(index, np.shape(x)))
            per_device[device] += _nbytes(shape, _dtype(x))
    return max(per_device.values(), default=0) + everywhere


def sharding_report(
    state: PyTree, mesh: Mesh, rules_used: ShardingPlan | Sequence[Rule] | None = None
) -> str:
    """A readable account of where a state lives on the mesh.

    Three parts: bytes per device of each top-level subtree (``params``,
    ``opt_state``, ``model_state``, ...), the largest parameters left
    replicated, and which rule sharded what (from ``rules_used``; without it,
    the parameters grouped by their spec).

    Args:
      state: arrays with shardings, concrete or abstract (`attach_shardings`).
      mesh: the mesh the state lives on.
      rules_used: the `ShardingPlan` the parameters were placed by, or the rules
        (re-planned quietly with the default ``min_size``), or None.

    Returns:
      The report, a multi-line string.
    """
    devices = mesh.devices.size
    axes = " ".join(f"{k}={v}" for k, v in mesh.shape.items())
    lines = [f"Sharding on mesh {axes} ({devices} devices)", ""]
    lines.append(f"{'subtree':<24}{'global':>12}{'per device':>14}{'replicated':>14}")
    groups: dict[str, list] = collections.defaultdict(list)
    for path, x in jax.tree_util.tree_flatten_with_path(state)[0]:
        groups[_path_str(path[:1]) or "state"].append(x)
    for name, leaves in groups.items():
        whole = sum(_nbytes(np.shape(x), _dtype(x)) for x in leaves)
        replicated = sum(_nbytes(np.shape(x), _dtype(x)) for x in leaves if _replicated(x))
        lines.append(
            f"{name:<24}{_format_bytes(whole):>12}{_format_bytes(bytes_per_device(leaves)):>14}"
            f"{_format_bytes(replicated):>14}"
        )
    lines.append(f"{'total':<24}{'':>12}{_format_bytes(bytes_per_device(state)):>14}")

    prefix, params = _find_params(state)
    flat = [
        (path, x.value if _is_box(x) else x)
        for path, x in jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_box)[0]
    ]
    left = sorted(
        ((x, path) for path, x in flat if _replicated(x)),
        key=lambda item: -_nbytes(np.shape(item[0]), _dtype(item[0])),
    )
    if rules_used is not None and not isinstance(rules_used, ShardingPlan):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ShardingWarning)
            rules_used = plan_param_shardings(params, mesh, rules_used)
    if _is_sharded(mesh):
        why = {}
        if isinstance(rules_used, ShardingPlan):
            why = {p.path: _why_whole(p) for p in rules_used.placements}
        lines += ["", "Largest parameters left replicated, and why:"]
        lines += [
            f"  {_path_str(prefix + path):<48}{str(np.shape(x)):>16}"
            f"{_format_bytes(_nbytes(np.shape(x), _dtype(x))):>12}"
            f"  {why.get(_path_str(path), '')}".rstrip()
            for x, path in left[:5]
        ] or ["  none"]

    lines += ["", "What sharded the parameters:"]
    if isinstance(rules_used, ShardingPlan):
        by_reason = collections.defaultdict(list)
        for placement in rules_used.placements:
            for reason in placement.reasons or ("nothing: replicated",):
                by_reason[reason].append(placement)
        for reason, placed in by_reason.items():
            first = placed[0]
            lines.append(
                f"  {reason}: {len(placed)} parameters, e.g. {first.path} "
                f"{first.shape} -> {first.spec}"
            )
    else:
        by_spec = collections.defaultdict(list)
        for path, x in flat:
            spec = getattr(getattr(x, "sharding", None), "spec", None)
            by_spec[str(spec)].append(_path_str(prefix + path))
        for spec, paths in by_spec.items():
            lines.append(f"  {spec}: {len(paths)} parameters, e.g. {paths[0]}")
    return "\n".join(lines)


def _why_whole(placement: Placement) -> str:
    if _SMALL in placement.reasons:
        return "below min_size"
    if placement.reasons:
        return "its rule's axes have size 1 here"
    return "no rule splits it and no dimension divides over fsdp"


def _replicated(x: Any) -> bool:
    sharding = getattr(x, "sharding", None)
    return not isinstance(sharding, jax.sharding.Sharding) or sharding.is_fully_replicated


def _dtype(x: Any) -> np.dtype:
    dtype = getattr(x, "dtype", None)
    return np.result_type(x) if dtype is None else dtype


def _nbytes(shape: tuple[int, ...], dtype: Any) -> int:
    return math.prod(shape) * dtype.itemsize


def _format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _is_box(x: Any) -> bool:
    return isinstance(x, nn.meta.AxisMetadata)


def _path_str(path: Sequence[Any]) -> str:
    return jax.tree_util.keystr(tuple(path), simple=True, separator="/")
