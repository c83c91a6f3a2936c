"""Sharding beyond data parallelism: rules -> shardings, sharded init, a report.

Where each parameter lives is `replicator.parallel.sharding_rules`' (the rules, their
forms and the mistakes they catch: read its docstring); its names are re-exported
here. This module places whole states by those rules (`state_shardings`: optimizer
state like its parameters, the rest replicated), creates them sharded
(`init_sharded`), and says where a state lives (`bytes_per_device`,
`sharding_report`).
"""

from __future__ import annotations

import collections
import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from replicator.errors import ShardingError as ShardingError
from replicator.parallel.sharding_rules import DEFAULT_RULES as DEFAULT_RULES
from replicator.parallel.sharding_rules import MIN_SHARD_SIZE as MIN_SHARD_SIZE
from replicator.parallel.sharding_rules import PARAMETER_AXES as PARAMETER_AXES
from replicator.parallel.sharding_rules import Placement as Placement
from replicator.parallel.sharding_rules import Rule as Rule
from replicator.parallel.sharding_rules import ShardingPlan as ShardingPlan
from replicator.parallel.sharding_rules import ShardingWarning as ShardingWarning
from replicator.parallel.sharding_rules import (
    dtype_of,
    format_bytes,
    is_box,
    path_string,
    shards_parameters,
)
from replicator.parallel.sharding_rules import param_shardings as param_shardings
from replicator.parallel.sharding_rules import plan_param_shardings as plan_param_shardings

PyTree = Any


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


# -------------------------------------------------------------- one mesh's rules


class ShardingPlanner:
    """A mesh and its rules: the parameters' shardings, states created in them, and a
    report on the last plan (what `Replicator.param_shardings`, `Replicator.init` and
    `Replicator.sharding_report` do).

    Args:
      mesh: the mesh.
      rules: as for `param_shardings` (None: `DEFAULT_RULES`).
      strict: every problem is a `ShardingError`, not a `ShardingWarning`.
      min_size: as for `param_shardings`: an int >= 0.

    Raises:
      ValueError: ``min_size`` is not an int >= 0.

    >>> from replicator.parallel.mesh import build_mesh
    >>> planner = ShardingPlanner(build_mesh(jax.devices()[:1], {"data": 1}), None)
    >>> planner.param_shardings({"w": jax.ShapeDtypeStruct((4, 4), np.float32)})["w"].spec
    P()
    """

    def __init__(
        self,
        mesh: Mesh,
        rules: Sequence[Rule] | None,
        *,
        strict: bool = False,
        min_size: int = MIN_SHARD_SIZE,
    ):
        if not isinstance(min_size, int) or min_size < 0:
            raise ValueError(f"min_size must be an int >= 0 (elements), got {min_size!r}.")
        self.mesh, self.rules, self.strict, self.min_size = mesh, rules, strict, min_size
        self.plan: ShardingPlan | None = None  # the last `param_shardings`', for the report

    def param_shardings(self, abstract_params: PyTree) -> PyTree:
        """`param_shardings` on this mesh by these rules; the plan is kept for `report`."""
        self.plan = plan_param_shardings(
            abstract_params, self.mesh, self.rules, strict=self.strict, min_size=self.min_size
        )
        return self.plan.shardings

    def init(self, init_fn: Callable[..., PyTree], *args: Any) -> PyTree:
        """`init_sharded` with these parameter shardings."""
        return init_sharded(init_fn, self.param_shardings, *args)

    def report(self, state: PyTree) -> str:
        """`sharding_report` of ``state``, by the last plan (else the rules)."""
        return sharding_report(state, self.mesh, self.plan or self.rules)


# ------------------------------------------------------------------- report


def bytes_per_device(tree: PyTree) -> int:
    """The largest number of bytes that ``tree``'s arrays occupy on one device.

    Each array counts with its shard on each device of its sharding; a leaf
    without a sharding (numpy, a Python number) counts whole on every device.
    This is the trainer's ``state_bytes_per_device``.

    >>> bytes_per_device({"w": np.zeros((4, 4), np.float32)})
    64
    """
    per_device: dict[Any, int] = collections.Counter()
    everywhere = 0
    for x in jax.tree.leaves(tree):
        sharding = getattr(x, "sharding", None)
        if not isinstance(sharding, jax.sharding.Sharding):
            everywhere += _nbytes(np.shape(x), dtype_of(x))
            continue
        for device, index in sharding.devices_indices_map(tuple(np.shape(x))).items():
            shape = tuple(len(range(*s.indices(n))) for s, n in zip(index, np.shape(x)))
            per_device[device] += _nbytes(shape, dtype_of(x))
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
        groups[path_string(path[:1]) or "state"].append(x)
    for name, leaves in groups.items():
        whole = sum(_nbytes(np.shape(x), dtype_of(x)) for x in leaves)
        replicated = sum(_nbytes(np.shape(x), dtype_of(x)) for x in leaves if _replicated(x))
        lines.append(
            f"{name:<24}{format_bytes(whole):>12}{format_bytes(bytes_per_device(leaves)):>14}"
            f"{format_bytes(replicated):>14}"
        )
    lines.append(f"{'total':<24}{'':>12}{format_bytes(bytes_per_device(state)):>14}")

    prefix, params = _find_params(state)
    flat = [
        (path, x.value if is_box(x) else x)
        for path, x in jax.tree_util.tree_flatten_with_path(params, is_leaf=is_box)[0]
    ]
    left = sorted(
        ((x, path) for path, x in flat if _replicated(x)),
        key=lambda item: -_nbytes(np.shape(item[0]), dtype_of(item[0])),
    )
    if rules_used is not None and not isinstance(rules_used, ShardingPlan):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ShardingWarning)
            rules_used = plan_param_shardings(params, mesh, rules_used)
    if shards_parameters(mesh):
        why = {}
        if isinstance(rules_used, ShardingPlan):
            why = {p.path: p.why_whole() for p in rules_used.placements}
        lines += ["", "Largest parameters left replicated, and why:"]
        lines += [
            f"  {path_string(prefix + path):<48}{str(np.shape(x)):>16}"
            f"{format_bytes(_nbytes(np.shape(x), dtype_of(x))):>12}"
            f"  {why.get(path_string(path), '')}".rstrip()
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
            by_spec[str(spec)].append(path_string(prefix + path))
        for spec, paths in by_spec.items():
            lines.append(f"  {spec}: {len(paths)} parameters, e.g. {paths[0]}")
    return "\n".join(lines)


def _replicated(x: Any) -> bool:
    sharding = getattr(x, "sharding", None)
    return not isinstance(sharding, jax.sharding.Sharding) or sharding.is_fully_replicated


def _nbytes(shape: tuple[int, ...], dtype: Any) -> int:
    return math.prod(shape) * dtype.itemsize
