"""Sharding rules -> where each parameter lives on the mesh, and why.

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
would cost more than they weigh). Sizes are per layer (`layer_shape`): a
scanned block's parameters, stacked on a ``layers`` axis (`STACK_AXES`), are
measured without it, so a stack of 20 LayerNorm scales of 2,048 stays
replicated as each one alone would, rather than cost an all-gather per layer in
the forward pass and its recomputation (lm_1b on a v5e-16: 2,756 all-gathers
a step become 52). Its gradient is summed over the replicas by one all-reduce
per layer, as XLA already did for the split stack before slicing its share.
Only a schedule's axes (a pipeline's ``stage``) still split a small stack.
Mesh axes of size 1 are dropped from the specs, so on one device every spec is
``P()``.

Mistakes are named, never silent and never an XLA error: a rule that matches
nothing, a rule naming an axis the mesh lacks, a logical axis two rules claim, a
dimension that does not divide over its mesh axis (kept whole on that
dimension), and a parameter of at least ``min_size`` elements left replicated
on a mesh with ``fsdp`` or ``tensor`` > 1 are a `ShardingError` under
``strict=True`` and a `ShardingWarning` otherwise, naming the parameter path and
its size.

The functions are pure: they take the mesh and rules and return shardings;
`Replicator` calls them with its own. Whole states (optimizer state placed like its
parameters), sharded init and the report are `replicator.parallel.sharding`'s, which
re-exports these names.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
import warnings
from collections.abc import Sequence
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
"""Parameters with fewer elements per layer (64 KiB in float32) stay replicated."""

STACK_AXES = ("layers",)
"""Logical axes that stack layers (``nn.scan``'s ``metadata_params={nn.PARTITION_NAME:
"layers"}``): a parameter's per-layer shape (`layer_shape`) leaves them out."""

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

    def why_whole(self) -> str:
        """Why a parameter left replicated is: the report's words."""
        if _SMALL in self.reasons:
            return "below min_size"
        if self.reasons:
            return "its rule's axes have size 1 here"
        return "no rule splits it and no dimension divides over fsdp"


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
      min_size: parameters with fewer elements per layer (`layer_shape`) get no
        automatic FSDP and are never reported as left replicated; with the
        default rules (``rules`` None) they stay replicated altogether.

    Returns:
      The same structure as ``abstract_params`` (boxes kept, holding the
      sharding) with a `NamedSharding` on ``mesh`` at every array.

    Raises:
      ShardingError: under ``strict``, for any problem listed in the module
        docstring.

    >>> from replicator.parallel.mesh import build_mesh
    >>> mesh = build_mesh(jax.devices()[:1], {"data": 1})
    >>> param_shardings({"w": jax.ShapeDtypeStruct((4, 4), np.float32)}, mesh)["w"].spec
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
    nodes, treedef = jax.tree_util.tree_flatten_with_path(abstract_params, is_leaf=is_box)
    used: set[int] = set()
    placements, out = [], []
    for path, node in nodes:
        value = node.value if is_box(node) else node
        names = tuple(node.names) if isinstance(node, nn.Partitioned) else None
        logical = isinstance(node, nn.LogicallyPartitioned)
        small = math.prod(layer_shape(node)) < min_size
        placement = _place(
            path_string(path), value, names, logical, parsed, mesh, small, rules is None, used,
            problems,
        )  # fmt: skip
        placements.append(placement)
        sharding = NamedSharding(mesh, placement.spec)
        out.append(node.replace_boxed(sharding) if is_box(node) else sharding)
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
        if is_logical_rule(key, target):  # ("embed", ("fsdp", "data")): logical
            known = _known_axes(as_axes(target), rule, mesh, problems)
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
            entries = tuple(_known_axes(as_axes(e), rule, mesh, problems) for e in target)
            parsed.append(_Rule(index, key, entries, pattern))
        else:
            raise TypeError(
                f"Sharding rule {tuple(rule)!r}: the second element must be a mesh axis "
                "name, None, or a tuple with one entry per dimension."
            )
    return parsed


_NAME = re.compile(r"[A-Za-z_]\w*")


def is_logical_rule(key: str, target: Any) -> bool:
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


def as_axes(entry: Any) -> tuple[str, ...]:
    """A rule's mesh axes as a tuple: ``None`` -> ``()``, ``"fsdp"`` -> ``("fsdp",)``."""
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
    dtype = dtype_of(value)
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
        entries = [tuple(a for a in as_axes(n) if a in mesh.axis_names) for n in names]
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
    if not any(entries) and shards_parameters(mesh) and not undivided and not small:
        problems.add(
            "replicated",
            f"{path} {shape} ({size:,} elements, {format_bytes(size * dtype.itemsize)}) is "
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


# ---------------------------------------------------------------- shared with the report


def shards_parameters(mesh: Mesh) -> bool:
    """Whether ``mesh`` splits parameters: an ``fsdp``, ``context`` or ``tensor`` axis above 1."""
    return any(mesh.shape.get(a, 1) > 1 for a in (*PARAMETER_AXES, "tensor"))


def dtype_of(x: Any) -> np.dtype:
    """The dtype of an array, a shape-dtype struct or a Python number."""
    dtype = getattr(x, "dtype", None)
    return np.result_type(x) if dtype is None else dtype


def format_bytes(n: float) -> str:
    """``n`` bytes for people.

    >>> format_bytes(512), format_bytes(3 * 2**20)
    ('512 B', '3.0 MiB')
    """
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def is_box(x: Any) -> bool:
    """Whether ``x`` is a Flax metadata box (``nn.LogicallyPartitioned``, ``nn.Partitioned``)."""
    return isinstance(x, nn.meta.AxisMetadata)


def layer_shape(node: Any) -> tuple[int, ...]:
    """A parameter's shape per layer: without the dimensions its box names by a
    `STACK_AXES` axis (the ``layers`` axis ``nn.scan`` stacks a block's parameters on).

    Args:
      node: an array or shape-dtype struct, or a Flax box around one.

    Returns:
      Its shape, less the stacked dimensions.

    >>> box = nn.LogicallyPartitioned(jax.ShapeDtypeStruct((20, 2048), np.float32),
    ...                               ("layers", "embed"))
    >>> layer_shape(box), layer_shape(box.value)
    ((2048,), (20, 2048))
    """
    shape = tuple(np.shape(node.value if is_box(node) else node))
    names = tuple(getattr(node, "names", ())) if is_box(node) else ()
    if len(names) != len(shape):
        return shape
    return tuple(n for n, name in zip(shape, names) if name not in STACK_AXES)


def path_string(path: Sequence[Any]) -> str:
    """A pytree path as the rules match it: keys joined by ``/``."""
    return jax.tree_util.keystr(tuple(path), simple=True, separator="/")
