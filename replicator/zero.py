"""ZeRO inside `Replicator.run`: sharded parameters and optimizer state in a per-replica step.

A leaf sharded over the replica axes (``fsdp``, or ``data`` by a rule) reaches
a per-replica step whole: `Replicator.run` all-gathers it on entry, typed
replica-invariant, so the step is the code it would be on one device. Autodiff
sums its gradient across the replicas already (the transpose of an invariant
value that a per-replica loss uses is a ``psum``); the wrapped optimizer
(`replicator.optim`) keeps each device's slice of that gradient, updates the
device's slice of the parameter with its slice of the optimizer state (ZeRO:
each device stores and updates 1/N), and all-gathers the update so the step
applies it to the whole parameter as written. Optimizer state (leaves under an
``opt_state`` field) is never gathered: it reaches the step as the device's
slice, the wrapped optimizer updates the slice, and the slice leaves `run`. On
the way out `run` keeps of each whole parameter only the device's slice:
between steps each device holds 1/N of both.

An optimizer whose update is not elementwise per parameter (a global-norm clip,
Adafactor's factored moments, LAMB's trust ratio, matrix optimizers) would see
only a slice. The wrapper reads the update's jaxpr to find out, and runs such an
update on whole leaves instead (optimizer state gathered for the step, sliced
after), with a warning: exact, without ZeRO's saving inside the step.

The ``tensor`` axis is not involved: `run` leaves it to the compiler
(``jax.shard_map(axis_names=...)`` over the replica axes only).
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import dataclasses
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.extend.core as jex
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from replicator.context import sum_varying
from replicator.runtime import compat

PyTree = Any


@dataclasses.dataclass
class _Trace:
    """The sharded inputs of the per-replica step being traced."""

    wholes: dict[int, P] = dataclasses.field(default_factory=dict)  # id(gathered leaf) -> spec
    slice_of: dict[int, Any] = dataclasses.field(default_factory=dict)  # id(gathered) -> slice
    # whole shape -> the specs of the sharded inputs of that shape
    by_shape: dict[tuple, set] = dataclasses.field(
        default_factory=lambda: collections.defaultdict(set)
    )
    # (key path, whole shape, spec, sharding) of each sharded input
    paths: list = dataclasses.field(default_factory=list)
    # (key path, slice shape, spec, sharding) of each optimizer-state input left a slice
    slices: list = dataclasses.field(default_factory=list)
    # slice shape -> the specs of the optimizer-state slices of that shape
    by_slice_shape: dict[tuple, set] = dataclasses.field(
        default_factory=lambda: collections.defaultdict(set)
    )
    keep: list = dataclasses.field(default_factory=list)  # keeps the ids above valid


_CURRENT: contextvars.ContextVar[_Trace | None] = contextvars.ContextVar("zero", default=None)
_WARNED: set[str] = set()


def manual_spec(sharding: NamedSharding, axes: Sequence[str]) -> P:
    """``sharding``'s spec restricted to the replica ``axes``: what ``jax.shard_map`` over
    them splits (the ``tensor`` axis stays with the compiler).

    >>> from replicator.mesh import build_mesh
    >>> manual_spec(NamedSharding(build_mesh(), P("fsdp", "tensor")), ("data", "fsdp"))
    PartitionSpec('fsdp',)
    """
    entries = [tuple(a for a in _axes(e) if a in axes) for e in sharding.spec]
    while entries and not entries[-1]:
        entries.pop()
    return P(*[e[0] if len(e) == 1 else (e or None) for e in entries])


def gather_inputs(
    leaves: Sequence[Any],
    shardings: Sequence[NamedSharding | None],
    axes: Sequence[str],
    paths: Sequence[tuple],
) -> tuple[list, _Trace]:
    """The step's argument leaves, each sharded one (a sharding, not None) gathered whole,
    but optimizer state (a leaf under an ``opt_state`` field, as in `rp.TrainState`
    and ``nnx.Optimizer``), which stays this device's slice: only the wrapped
    optimizer reads it, and it updates slices (ZeRO: never a whole moment).

    ``paths`` are the leaves' key paths in the arguments: the optimizer pairs a
    gradient with the parameter whose path ends like the gradient's.
    """
    trace, out = _Trace(), []
    for x, sharding, path in zip(leaves, shardings, paths):
        if sharding is None:
            out.append(x)
            continue
        spec = manual_spec(sharding, axes)
        if _is_optimizer_state(path):
            trace.slices.append((tuple(path), x.shape, spec, sharding))
            trace.by_slice_shape[x.shape].add(spec)
            out.append(x)
            continue
        whole = gather(x, spec)
        trace.wholes[id(whole)], trace.slice_of[id(whole)] = spec, x
        trace.by_shape[whole.shape].add(spec)
        trace.paths.append((tuple(path), whole.shape, spec, sharding))
        trace.keep += [x, whole]
        out.append(whole)
    return out, trace


@contextlib.contextmanager
def tracing(trace: _Trace) -> Iterator[None]:
    """While `Replicator.run` traces a step whose arguments ``trace`` describes."""
    token = _CURRENT.set(trace if trace.wholes or trace.slices else None)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def active() -> bool:
    """Whether the per-replica step being traced has sharded arguments."""
    return _CURRENT.get() is not None


def gather(x: jax.Array, spec: P) -> jax.Array:
    """A device's slice (split as ``spec`` says) -> the whole array, replica-invariant."""
    for dim, axes in enumerate(_axes(e) for e in spec):
        if axes:
            x = compat.all_gather_invariant(x, axes, dim)
    return x


def local_slice(x: jax.Array, spec: P) -> jax.Array:
    """A whole array -> this device's slice of it, split as ``spec`` says."""
    for dim, axes in enumerate(_axes(e) for e in spec):
        if axes:
            size = x.shape[dim] // int(np.prod([jax.lax.axis_size(a) for a in axes]))
            x = jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(axes) * size, size, dim)
    return x


def output_sharding(x: jax.Array, varying: Sequence[str], path: tuple) -> NamedSharding | None:
    """The sharding of the sharded input an output of the step stands for, if any.

    A whole, replica-invariant output shaped like a sharded input (a parameter's
    new value) leaves `run` as that input came in; of several such inputs, the one
    whose key path ends most like the output's (``[0].params.fc.kernel`` for
    ``[0].params.fc.kernel``, or for ``params.fc.kernel`` of a step returning the
    parameters alone). The choice changes only the layout, never a value.
    """
    trace = _CURRENT.get()
    if trace is None:
        return None
    path = tuple(path)
    if varying:  # an optimizer-state slice leaves as the slice it came in as
        candidates = [
            (-_common_suffix(path, where), str(spec), sharding)
            for where, shape, spec, sharding in trace.slices
            if shape == x.shape and set(varying) == {a for e in spec for a in _axes(e)}
        ]
    else:
        candidates = [
            (-_common_suffix(path, where), str(spec), sharding)
            for where, shape, spec, sharding in trace.paths
            if shape == x.shape
        ]
    return min(candidates, key=lambda c: c[:2])[2] if candidates else None


def _common_suffix(a: tuple, b: tuple) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[-1 - n] == b[-1 - n]:
        n += 1
    return n


# ---------------------------------------------------------------- optimizer

_AMBIGUOUS = P("ambiguous")  # a leaf shaped like parameters sharded in different ways


def update(
    tx: optax.GradientTransformationExtraArgs,
    grads: PyTree,
    state: optax.OptState,
    params: PyTree | None,
    axis_names: Sequence[str],
    **extra_args: Any,
) -> tuple[PyTree, optax.OptState]:
    """``tx.update`` of per-replica gradients, ZeRO-style for sharded parameters.

    Each device updates its slice of each sharded parameter with its slice of
    the summed gradient and of the optimizer state; the updates are gathered
    whole, so the step applies them as it would on one device, and optimizer
    state that came in as a slice stays one (any other is gathered whole
    again). Other gradients are all-reduced as under data parallelism.
    """
    trace = _CURRENT.get()
    grad_leaves, grad_def = jax.tree.flatten(grads)
    grads = jax.tree.unflatten(grad_def, [sum_varying(g, axis_names) for g in grad_leaves])
    grad_specs = _grad_specs(trace, grads, params)
    state_specs = _state_specs(trace, state, grad_def, grad_specs)
    # Optimizer state that came in as this device's slice (see `gather_inputs`).
    sliced = [_is_slice(trace, x) for x in jax.tree.leaves(state)]
    specs = (grad_specs, state_specs, grad_specs if params is not None else [])
    ambiguous = any(s is _AMBIGUOUS for s in grad_specs + state_specs)
    if ambiguous or not _elementwise(tx.update, (grads, state, params), extra_args, specs, sliced):
        _warn_whole_update(tx)
        state = _map_where(state, sliced, state_specs, gather)
        updates, new_state = tx.update(grads, state, params, **extra_args)
        return updates, _map_where(new_state, sliced, state_specs, local_slice)
    pieces = [_map(trace, tree, s, _slice) for tree, s in zip((grads, state, params), specs)]
    updates, new_state = tx.update(*pieces, **extra_args)
    whole = lambda trace, x, spec: gather(x, spec)  # noqa: E731
    unsliced = [None if kept else s for kept, s in zip(sliced, state_specs)]  # slices stay
    return _map(trace, updates, grad_specs, whole), _map(trace, new_state, unsliced, whole)


def _is_optimizer_state(path: Sequence[Any]) -> bool:
    return any(getattr(k, "name", getattr(k, "key", None)) == "opt_state" for k in path)


def _is_slice(trace: _Trace, x: Any) -> bool:
    """Whether ``x`` is an optimizer-state slice: varying over the replica axes, shaped
    like one that came in as a slice."""
    return (
        hasattr(x, "shape")
        and x.shape in trace.by_slice_shape
        and bool(jax.typeof(x).manual_axis_type.varying)
    )


def _map_where(tree: PyTree, where: list, specs: list, fn) -> PyTree:
    """``fn(leaf, spec)`` on the leaves of ``tree`` marked in ``where``."""
    leaves, treedef = jax.tree.flatten(tree)
    return jax.tree.unflatten(
        treedef, [fn(x, s) if w else x for x, w, s in zip(leaves, where, specs)]
    )


def _map(trace: _Trace, tree: PyTree, specs: list, fn) -> PyTree:
    if tree is None:
        return None
    leaves, treedef = jax.tree.flatten(tree)
    return jax.tree.unflatten(
        treedef, [fn(trace, x, s) if s is not None else x for x, s in zip(leaves, specs)]
    )


def _slice(trace: _Trace, x: jax.Array, spec: P) -> jax.Array:
    """This device's slice of ``x``: the input slice itself where ``x`` is a gathered
    input, ``x`` where it is a slice already (optimizer state)."""
    if _is_slice(trace, x):
        return x
    piece = trace.slice_of.get(id(x))
    return local_slice(x, spec) if piece is None else piece


def _spec_by_shape(trace: _Trace, x: Any) -> P | None:
    if not hasattr(x, "shape"):
        return None
    if jax.typeof(x).manual_axis_type.varying:  # an optimizer-state slice, or no ZeRO leaf
        found = set(trace.by_slice_shape.get(x.shape, ())) if _is_slice(trace, x) else set()
    else:
        found = set(trace.by_shape.get(x.shape, ()))
    return found.pop() if len(found) == 1 else (_AMBIGUOUS if found else None)


def _grad_specs(trace: _Trace, grads: PyTree, params: PyTree | None) -> list[P | None]:
    """Each gradient's spec: its parameter's, the sharded input whose key path ends
    like the gradient's (``.../params/fc/kernel`` for ``fc/kernel``), else by shape."""
    specs = []
    for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]:
        n = len(path)
        found = {
            spec for where, shape, spec, _ in trace.paths
            if shape == np.shape(g) and where[len(where) - n:] == tuple(path)
        }  # fmt: skip
        if len(found) > 1:
            specs.append(_AMBIGUOUS)
        else:
            specs.append(found.pop() if found else _spec_by_shape(trace, g))
    return specs


def _state_specs(trace: _Trace, state: PyTree, grad_def, grad_specs: list) -> list[P | None]:
    """Each optimizer-state leaf's spec: a subtree shaped like the gradients (Adam's
    moments) pairs leaf by leaf with them; any other leaf goes by its shape."""
    if jax.tree.structure(state) == grad_def:
        return list(grad_specs)
    children = jax.tree_util.tree_flatten(state, is_leaf=lambda x: x is not state)[0]
    if not children:
        return []
    if len(children) == 1 and children[0] is state:  # a leaf
        return [_spec_by_shape(trace, state)]
    return [s for child in children for s in _state_specs(trace, child, grad_def, grad_specs)]


# ------------------------------------------- is an optimizer's update elementwise?

# Primitives that compute each element from the same element of their inputs.
_ELEMENTWISE = frozenset(
    """abs acos acosh add and asin asinh atan atan2 atanh cbrt ceil clamp
    convert_element_type copy copy_p cos cosh digamma div eq erf erf_inv erfc exp exp2 expm1
    floor ge gt igamma imag integer_pow is_finite le lgamma log log1p logistic lt max min
    mul ne neg nextafter not optimization_barrier or pow real reduce_precision rem round
    rsqrt select_n sign sin sinh sqrt square sub tan tanh xor""".split()
)


def _elementwise(fn, args: tuple, extra: dict, specs: tuple, sliced: list) -> bool:
    """Whether ``fn(*args, **extra)`` computes each element of the sharded leaves' results
    from the same elements of their inputs only (so a slice in gives the slice out).
    ``sliced`` marks the state leaves (``args[1]``) given as slices: traced whole."""
    leaves, treedef = jax.tree.flatten((args, extra))
    tainted, shapes = [], []
    for k, (part, part_specs) in enumerate(zip(args, specs)):
        if part is None:
            continue
        tainted += [s is not None for s in part_specs]
        for i, (x, s) in enumerate(zip(jax.tree.leaves(part), part_specs)):
            whole = k == 1 and sliced[i] and s is not None and s is not _AMBIGUOUS
            shapes.append(_whole_shape(x.shape, s) if whole else getattr(x, "shape", None))
    tainted += [False] * (len(leaves) - len(tainted))
    shapes += [getattr(x, "shape", None) for x in leaves[len(shapes) :]]
    abstract = [
        jax.ShapeDtypeStruct(shape, x.dtype) if hasattr(x, "dtype") else x
        for x, shape in zip(leaves, shapes)
    ]

    def call(*flat):
        call_args, call_extra = jax.tree.unflatten(treedef, flat)
        return fn(*call_args, **call_extra)

    closed = jax.make_jaxpr(call)(*abstract)
    return _taint_stays_local(closed.jaxpr, tainted)


def _whole_shape(shape: tuple, spec: P) -> tuple:
    """The whole shape of a slice of ``shape`` split as ``spec`` says (inside shard_map)."""
    sizes = list(shape)
    for dim, axes in enumerate(_axes(e) for e in spec):
        if axes:
            sizes[dim] *= int(np.prod([jax.lax.axis_size(a) for a in axes]))
    return tuple(sizes)


def _taint_stays_local(jaxpr: jex.Jaxpr, tainted_in: Sequence[bool]) -> bool:
    tainted = {v for v, t in zip(jaxpr.invars, tainted_in) if t}
    for eqn in jaxpr.eqns:
        hits = [isinstance(v, jex.Var) and v in tainted for v in eqn.invars]
        if not any(hits):
            continue
        name = eqn.primitive.name
        if name == "broadcast_in_dim":
            ok = eqn.invars[0].aval.shape == eqn.outvars[0].aval.shape
        elif name in _ELEMENTWISE:
            ok = True
        else:  # a call (jit, custom_jvp, ...) is as local as its body
            bodies = [
                j.jaxpr if isinstance(j, jex.ClosedJaxpr) else j
                for j in eqn.params.values()
                if isinstance(j, (jex.ClosedJaxpr, jex.Jaxpr))
            ]
            ok = len(bodies) == 1 and len(bodies[0].invars) == len(hits)
            ok = ok and _taint_stays_local(bodies[0], hits)
        if not ok:
            return False
        tainted.update(eqn.outvars)
    return True


def _warn_whole_update(tx) -> None:
    name = getattr(tx, "__qualname__", None) or type(tx).__name__
    if name in _WARNED:
        return
    _WARNED.add(name)
    warnings.warn(
        "Under repl.run with sharded parameters, this optimizer's update runs on whole "
        "leaves (exact, without ZeRO's saving inside the step): it is not elementwise per "
        "parameter (e.g. a global-norm clip, Adafactor, LAMB), or parameters of one shape "
        "are sharded in different ways and its state does not say which is which. "
        "repl.compile (step_path='compile' in the trainer) keeps it sharded throughout.",
        stacklevel=4,
    )


def _axes(entry: Any) -> tuple[str, ...]:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)
