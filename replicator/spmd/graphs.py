"""Flax NNX graph objects through `Replicator.run` and `compile`, with ``nnx.jit``'s semantics.

An NNX step updates its arguments in place (``opt.update(model, grads)``,
BatchNorm statistics, RNG counters, metrics) and returns only its metrics. A
compiled program cannot mutate Python objects, so the objects are split into a
graph definition (static) and a state (arrays), the state goes through the
program, the step runs on objects merged from it, and their new state comes
back out and is written into the caller's objects (``nnx.update``): what the
step mutated is visible after the call, shared references stay shared.

Under ``run`` each replica runs the step on its own merged objects, so three
things need care, and get it here:

* **Randomness.** Every `nnx.RngKey` is folded with the replica id for the
  step (then restored), so each replica draws its own deterministic stream.
* **Metrics.** Each replica updates `nnx.metrics.Average` (and `Accuracy`)
  with its own examples; their totals and counts are then summed over the
  replicas (``old + psum(new - old)``), so the metric counts the global batch
  once. Update them with per-replica values (e.g. per-example losses), not
  values already reduced across replicas, which would count N times.
* **Anything else that differs between replicas** (e.g. BatchNorm statistics
  without an ``axis_name``) cannot be written back into one object: it is an
  error naming the attribute.

Objects are found anywhere in the arguments (nested in tuples, lists, dicts,
dataclasses; a bare `nnx.Variable` too), but not inside an `nnx.State`, which
is data: the trainer's ``TrainState`` carries its parameters as one. What
cannot be carried back is an error naming the object, never a silent no-op: a
step that changes an object's structure (sets, adds or removes an attribute),
arrays placed off the Replicator's devices, a module whose ``axis_name`` is
not the replicas'.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
from flax import nnx

from replicator.spmd.context import AxisNameError, get_replica_context, vary, varying_axes

PyTree = Any


def is_graph_node(x: Any) -> bool:
    """Whether ``x`` is an NNX object (Module, Optimizer, Rngs, Metric, Variable, ...)."""
    kind = type(x)
    known = _GRAPH_TYPES.get(kind)
    if known is None:  # isinstance through nnx's metaclass is slow: once per type
        known = _GRAPH_TYPES[kind] = isinstance(x, (nnx.Pytree, nnx.Variable))
    return known


_GRAPH_TYPES: dict[type, bool] = {}


def has_graph_nodes(args: Sequence[Any]) -> bool:
    """Whether any argument is an NNX object, or a tuple, list or dict holding one.

    The cheap look done on every call; `contains_graph_nodes` finds objects
    nested deeper, where a call's structure is first seen.
    """
    known = _GRAPH_TYPES.get  # per type, as `is_graph_node`, without its call per value
    for arg in args:
        kind = type(arg)
        children = arg if kind is tuple or kind is list else arg.values() if kind is dict else ()
        if known(kind) or (known(kind) is None and is_graph_node(arg)):
            return True
        for value in children:
            found = known(type(value))
            if found or (found is None and is_graph_node(value)):
                return True
    return False


def contains_graph_nodes(tree: PyTree) -> bool:
    """Whether an NNX object sits anywhere in ``tree``: a flatten, so not for every call."""
    return any(map(is_graph_node, jax.tree.leaves(tree, is_leaf=_is_split_leaf)))


class NestedGraphNodes(Exception):
    """Raised while `Replicator.compile` traces a step given NNX objects it did not split out."""


def refuse_graph_nodes(fn: Callable) -> Callable:
    """``fn``, refusing at trace time arguments that hold NNX objects (as pytrees,
    their in-place changes would be lost): the caller splits them out instead."""

    @functools.wraps(fn)
    def traced(*args, **kwargs):
        if contains_graph_nodes((args, kwargs)):
            raise NestedGraphNodes
        return fn(*args, **kwargs)

    return traced


def _is_split_leaf(x: Any) -> bool:
    # An nnx.State holds Variables, but as data (a TrainState's parameters): not split out.
    return x is None or is_graph_node(x) or isinstance(x, nnx.State)


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where the NNX objects sit in a call's arguments (hashable: a cache key)."""

    graphdef: Any
    treedefs: tuple  # per argument: its treedef with NNX objects (and None) as leaves
    positions: tuple[tuple[int, ...], ...]  # per argument: which of its leaves are objects
    names: tuple[str, ...]  # per object: where it was, e.g. "args[0]"


@dataclasses.dataclass
class SplitCall:
    """A call's arguments with the NNX objects taken out."""

    layout: Layout
    nodes: tuple  # the caller's objects, in order
    args: tuple  # the arguments with each object replaced by None, then the state
    state: Any


def split_call(args: Sequence[Any]) -> SplitCall:
    """Splits the NNX objects out of ``args``: their state becomes one extra argument."""
    treedefs, positions, pure_args, nodes, names = [], [], [], [], []
    for n, arg in enumerate(args):
        paths, treedef = jax.tree_util.tree_flatten_with_path(arg, is_leaf=_is_split_leaf)
        leaves = [x for _, x in paths]
        where = tuple(i for i, x in enumerate(leaves) if is_graph_node(x))
        nodes.extend(leaves[i] for i in where)
        names.extend(f"args[{n}]{jax.tree_util.keystr(paths[i][0])}" for i in where)
        leaves = [None if i in where else x for i, x in enumerate(leaves)]
        treedefs.append(treedef)
        positions.append(where)
        pure_args.append(jax.tree.unflatten(treedef, leaves))
    graphdef, state = nnx.split(tuple(nodes))
    layout = Layout(graphdef, tuple(treedefs), tuple(positions), tuple(names))
    return SplitCall(layout, tuple(nodes), (*pure_args, state), state)


def check_placement(call: SplitCall, devices: set) -> None:
    """Raises naming the attribute of an NNX object whose array is not on exactly ``devices``.

    A committed array elsewhere, or on only some of them, fails in JAX with an
    error naming a flat argument number; most likely the object was made for
    another Replicator or placed by hand. (An uncommitted array, fresh from
    ``nnx.Rngs(0)``, JAX places itself.)
    """
    for path, var in nnx.to_flat_state(call.state):
        x = var.get_value()
        sharding = getattr(x, "sharding", None)
        if sharding is None or not x.committed or sharding.device_set == devices:
            continue
        raise ValueError(
            f"NNX variable {_path_name(call.layout.names, path)} holds an array on devices "
            f"{sorted(d.id for d in sharding.device_set)}, not on this Replicator's devices "
            f"{sorted(d.id for d in devices)}. Place the objects with "
            "repl.replicate((model, optimizer, ...)) first."
        )


def call_program(program: Callable, call: SplitCall, devices: set, axis_name: tuple) -> Any:
    """``program(*call.args)``; if it fails, an error naming the NNX attribute at fault.

    The diagnoses run only on failure, so every call after the first stays cheap.
    """
    try:
        return program(*call.args)
    except AxisNameError as e:
        modules = _modules_with_foreign_axis_name(call, axis_name)
        if not modules:
            raise
        raise AxisNameError(f"{e} NNX modules with another axis_name: {', '.join(modules)}.") from e
    except Exception:
        check_placement(call, devices)  # an array placed elsewhere: JAX names only flat[i]
        raise


def _modules_with_foreign_axis_name(call: SplitCall, axis_name: tuple) -> list[str]:
    found = []
    for path, obj in nnx.iter_graph(call.nodes):
        value = getattr(obj, "axis_name", None) if isinstance(obj, nnx.Module) else None
        names = (value,) if isinstance(value, str) else value or ()
        if any(name not in axis_name for name in names):
            found.append(f"{_path_name(call.layout.names, path)} (axis_name={value!r})")
    return found


def _path_name(names: Sequence[str], path: tuple) -> str:
    return ".".join([names[path[0]], *(str(p) for p in path[1:])])


def donated_positions(layout: Layout, donate_argnums: Sequence[int]) -> tuple[int, ...]:
    """The pure call's donated positions: the user's, plus the state if an object is donated."""
    donate = tuple(sorted(donate_argnums))
    if any(layout.positions[i] for i in donate):
        donate += (len(layout.positions),)
    return donate


def merge_call(layout: Layout, pure_args: Sequence[Any]) -> tuple[tuple, tuple]:
    """The inverse of `split_call`: ``(args, nodes)`` with new objects merged from the state."""
    *plain, state = pure_args
    nodes = nnx.merge(layout.graphdef, state)
    args, it = [], iter(nodes)
    for arg, treedef, where in zip(plain, layout.treedefs, layout.positions):
        if where:
            leaves = jax.tree.flatten(arg, is_leaf=_is_split_leaf)[0]
            leaves = [next(it) if i in where else x for i, x in enumerate(leaves)]
            arg = jax.tree.unflatten(treedef, leaves)
        args.append(arg)
    return tuple(args), nodes


def make_pure(fn: Callable, layout: Layout, *, replica_rngs: bool = True) -> Callable:
    """``fn`` as a function of ``(*args_without_objects, state) -> (out, new_state)``."""

    def pure(*pure_args):
        args, nodes = merge_call(layout, pure_args)
        ctx = get_replica_context()
        variables = _variables(nodes)
        before = {path: var.get_value() for path, var in variables.items()}
        keys = {}
        if ctx is not None and replica_rngs:
            for path, var in variables.items():
                if isinstance(var, nnx.RngKey):
                    keys[path] = var.get_value()
                    var.set_value(jax.random.fold_in(keys[path], ctx.replica_id))
        out = fn(*args)
        for path, key in keys.items():
            variables[path].set_value(key)
        if ctx is not None:
            _agree_across_replicas(nodes, variables, before, ctx.axis_name, layout.names)
        if any(is_graph_node(x) for x in jax.tree.leaves(out, is_leaf=is_graph_node)):
            raise TypeError(
                "A step run by replicator returned an NNX object; return arrays (metrics), "
                "and update the objects passed in, which are written back after the call."
            )
        graphdef, new_state = nnx.split(nodes)
        if graphdef != layout.graphdef:
            _raise_structure_changed(layout, pure_args[-1], nodes)
        return out, new_state

    pure.__name__ = getattr(fn, "__name__", "step")
    return pure


def write_back(call: SplitCall, new_state: Any) -> None:
    """Writes the step's new state into the caller's objects (``nnx.update``)."""
    try:
        nnx.update(call.nodes, new_state)
    except Exception as e:
        raise ValueError(
            f"The step's changes to its NNX objects cannot be written back: "
            f"{type(e).__name__}: {e}. Pass the objects themselves (not views or copies "
            "that cannot be updated in place)."
        ) from e


def _raise_structure_changed(layout: Layout, state_in: Any, nodes: tuple) -> None:
    """Raises naming the attributes a step set, added or removed on its NNX objects."""
    before = _structure(nnx.merge(layout.graphdef, state_in))
    after = _structure(nodes)
    changed = [
        f"{_path_name(layout.names, path)} ({before.get(path, 'absent')} -> "
        f"{after.get(path, 'absent')})"
        for path in sorted(before.keys() | after.keys(), key=str)
        if before.get(path) != after.get(path)
    ]
    raise ValueError(
        f"The step changed the structure of its NNX objects: "
        f"{'; '.join(changed) or 'the contents of an attribute'}. Only "
        "the values of their Variables are written back after a step run by replicator "
        "(unlike nnx.jit, it does not set, add or remove attributes), so this change would "
        "be lost. Make it outside the step, before the call (e.g. model.flag = True, or "
        "model.bias = None), or return the new value from the step."
    )


def _structure(nodes) -> dict[tuple, str]:
    """Each attribute of the objects: a type for objects and Variables, else its value."""
    return {
        (*path, name): type(value).__name__ if is_graph_node(value) else repr(value)[:60]
        for path, obj in nnx.iter_graph(nodes)
        if isinstance(obj, nnx.Pytree)
        for name, value in vars(obj).items()
        if not name.startswith("_pytree__")  # nnx's bookkeeping
    }


def _variables(nodes) -> dict[tuple, nnx.Variable]:
    return {path: value for path, value in nnx.iter_graph(nodes) if isinstance(value, nnx.Variable)}


def _agree_across_replicas(nodes, variables, before, axes, names) -> None:
    """Makes every variable the same on all replicas, or raises naming the one that is not."""
    additive = {
        path + (name,)
        for path, obj in nnx.iter_graph(nodes)
        if isinstance(obj, nnx.metrics.Average)
        for name, value in vars(obj).items()
        if isinstance(value, nnx.Variable)
    }
    for path, var in variables.items():
        value = var.get_value()
        if not isinstance(value, jax.Array):
            continue
        if path in additive:
            # Each replica counted its own examples: totals and counts add up, even
            # where the increments happen to be equal (a count from a static shape).
            delta = vary(value - before[path], axes)
            var.set_value(before[path] + jax.lax.psum(delta, axes))
            continue
        if not varying_axes(value, axes):
            continue
        name = _path_name(names, path)
        raise ValueError(
            f"NNX variable {name} ({type(var).__name__}) differs between replicas after the "
            "step, and one object cannot hold a value per replica. For BatchNorm pass "
            "axis_name=repl.axis_name (statistics over all replicas); for metrics other than "
            "nnx.metrics.Average/Accuracy, update them with values reduced across replicas "
            "(repl.reduce inside the step); keep other per-replica state out of the objects "
            "and return it (per-replica outputs round-trip)."
        )
