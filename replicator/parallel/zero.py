"""ZeRO inside `Replicator.run`: sharded parameters and optimizer state in a per-replica step.

A leaf sharded over the replica axes (``fsdp``, or ``data`` by a rule) reaches
a per-replica step whole: `Replicator.run` all-gathers it on entry, typed
replica-invariant, so the step is the code it would be on one device. Optimizer
state (leaves under an ``opt_state`` field) is never gathered: it reaches the
step as the device's slice. Between steps each device holds 1/N of both.

What crosses the devices in a step written with `rp.TrainState` (measured in
``tests/test_zero.py``): the parameters, all-gathered once for the forward pass;
their gradients, reduce-scattered (each device receives its 1/N of the sum,
once per step however many microbatches); nothing else of size. For that,
`TrainState.value_and_grad` differentiates through `defer_gradient_sum`: with the
gathered parameters typed varying (`unsummed`), so autodiff leaves each device
its own gradient instead of all-reducing it whole; the step still reads the
summed gradient (`summed`), an all-reduce XLA drops as dead code unless the step
uses it (a norm). (With ``every``, for an aggregator in `replicator.step.optim`, every
parameter's gradient is deferred alike.) The wrapped optimizer (`shard_optimizer`, inside
`replicator.step.optim`'s wrapper) updates each device's slice of each parameter with
its slice of the gradient and of the optimizer state, and
`TrainState.apply_gradients` runs its update through `update_slices`, which
adds the update's slice to the parameter's slice (`apply_updates`). The whole
update and the whole new parameter are gathered for a step that reads them, and
are dead code otherwise: `run` returns the slices they were gathered from
(`slice_for`).

A step that differentiates on its own (``jax.grad``, ``nnx.value_and_grad``)
gets the gradients autodiff all-reduces, and the wrapped optimizer slices them:
exact, with data parallelism's traffic for the gradients.

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
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from replicator.runtime import compat
from replicator.spmd.context import (
    get_replica_context,
    own_gradient,
    remember_own_gradient,
    sum_varying,
    vary,
    varying_axes,
)

PyTree = Any


@dataclasses.dataclass
class _Trace:
    """The sharded inputs of the per-replica step being traced."""

    axes: tuple[str, ...] = ()  # the replica axes
    wholes: dict[int, P] = dataclasses.field(default_factory=dict)  # id(gathered input) -> spec
    # id(whole) -> (this device's slice, spec), for every whole gathered in the step:
    # the inputs, the updates, the new parameters
    slice_of: dict[int, tuple] = dataclasses.field(default_factory=dict)
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
    # id(summed gradient) -> (this device's slice of it, spec, it), while `scattered` lasts
    grad_slice: dict[int, tuple] = dataclasses.field(default_factory=dict)
    keep: list = dataclasses.field(default_factory=list)  # keeps the ids above valid


_CURRENT: contextvars.ContextVar[_Trace | None] = contextvars.ContextVar("zero", default=None)
_WARNED: set[str] = set()


def manual_spec(sharding: NamedSharding, axes: Sequence[str]) -> P:
    """``sharding``'s spec restricted to the replica ``axes``: what ``jax.shard_map`` over
    them splits (the ``tensor`` axis stays with the compiler).

    >>> from replicator.parallel.mesh import build_mesh
    >>> manual_spec(NamedSharding(build_mesh(), P("fsdp", "tensor")), ("data", "fsdp"))
    P('fsdp',)
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
    trace, out = _Trace(axes=tuple(axes)), []
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
        whole = _gathered(trace, x, spec)
        trace.wholes[id(whole)] = spec
        trace.by_shape[whole.shape].add(spec)
        trace.paths.append((tuple(path), whole.shape, spec, sharding))
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


def _gathered(trace: _Trace, x: jax.Array, spec: P) -> jax.Array:
    """`gather`, remembering the slice: what the whole stands for needs no slicing."""
    whole = gather(x, spec)
    trace.slice_of[id(whole)] = (x, spec)
    trace.keep += [x, whole]
    return whole


def slice_for(x: Any, spec: P) -> jax.Array | None:
    """The slice ``x`` was gathered from in the step being traced, if it was (split as
    ``spec`` says), else None: `Replicator.run` returns it as the device's part of
    a parameter instead of slicing the whole, so the gather is dead code."""
    trace = _CURRENT.get()
    found = trace and trace.slice_of.get(id(x))
    return found[0] if found and found[1] == spec else None


def reduce_scatter(x: jax.Array, spec: P, axes: Sequence[str]) -> jax.Array:
    """``x``, varying over the replica ``axes``, summed over them -> this device's slice
    of the sum, split as ``spec`` says (`local_slice` of ``psum(x)``): a reduce-
    scatter over the axes that split it, a sum over the others."""
    split = {a for e in spec for a in _axes(e)}
    rest = tuple(a for a in varying_axes(x, axes) if a not in split)
    for dim, dim_axes in enumerate(_axes(e) for e in spec):
        if dim_axes:
            x = jax.lax.psum_scatter(x, dim_axes, scatter_dimension=dim, tiled=True)
    return jax.lax.psum(x, rest) if rest else x


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


# ---------------------------------------------------------------- gradients


def unsummed(params: PyTree, every: bool = False) -> tuple[PyTree, list | None]:
    """``params`` to differentiate so that each sharded parameter's gradient (with
    ``every``, each floating parameter's: for an aggregator, `replicator.step.optim`)
    stays this device's own, unsummed: the parameter typed varying over the
    replica axes. (Autodiff would all-reduce it whole: the transpose of an
    invariant value used by a per-replica loss is a ``psum``.) `summed` hands the
    step the sum it expects; the wrapped optimizer sums the unsummed gradient its
    own way instead. Returns, per leaf, the replica axes `summed` sums it over
    (those autodiff would have), or None if nothing is deferred.
    """
    marks = _unsummed_marks(params, every)
    if marks is None:
        return params, None
    leaves, treedef = jax.tree.flatten(params)
    varied = [vary(x, axes) if axes else x for x, axes in zip(leaves, marks)]
    return jax.tree.unflatten(treedef, varied), marks


def defers_gradient_sum(params: PyTree, every: bool = False) -> bool:
    """Whether `defer_gradient_sum` types any of ``params`` varying (ZeRO, or ``every``,
    under run)."""
    return _unsummed_marks(params, every) is not None


def _unsummed_marks(params: PyTree, every: bool) -> list[tuple[str, ...]] | None:
    ctx, trace = get_replica_context(), _CURRENT.get()
    wholes = trace.wholes if trace is not None else {}
    if ctx is None or not (every or wholes):
        return None
    marks = [
        tuple(a for a in ctx.axis_name if a not in varying_axes(x, ctx.axis_name))
        if _inexact(x) and (every or id(x) in wholes) else ()
        for x in jax.tree.leaves(params)
    ]  # fmt: skip
    return marks if any(marks) else None


def _inexact(x: Any) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact)


def summed(grads: PyTree, marks: list | None) -> PyTree:
    """The gradients of `unsummed` parameters summed over the replicas, as the step
    reads them. Each remembers its unsummed self (`replicator.spmd.context.own_gradient`):
    the wrapped optimizer sums that (ZeRO reduce-scatters it), and this all-reduce
    is dead code (dropped by XLA) unless the step reads the whole gradient itself."""
    if marks is None:
        return grads
    leaves, treedef = jax.tree.flatten(grads)
    out = []
    for g, axes in zip(leaves, marks, strict=True):
        axes = tuple(a for a in axes if a in varying_axes(g, axes))
        if axes:
            total = jax.lax.psum(g, axes)
            remember_own_gradient(total, g)
            g = total
        out.append(g)
    return jax.tree.unflatten(treedef, out)


def defer_gradient_sum(grad_fn: Callable, every: bool = False) -> Callable:
    """``grad_fn(params, batch) -> (grads, out)`` with each sharded parameter's (with
    ``every``, each floating parameter's) gradient computed per device (`unsummed`)
    and handed on as the sum (`summed`), which remembers the unsummed one for the
    wrapped optimizer. Outside `Replicator.run` (or a sharded one, without
    ``every``), ``grad_fn`` as it is."""

    def deferred(params, batch):
        params, marks = unsummed(params, every)
        grads, out = grad_fn(params, batch)
        return summed(grads, marks), out

    return deferred


def scale_summed(grads: PyTree, factor: jax.Array) -> PyTree:
    """``grads`` times ``factor`` (a replica-invariant scalar), each summed gradient's
    bookkeeping carried over: its own part (`summed`) and, while `scattered` lasts,
    this device's slice scaled with it, so that the optimizer still updates from
    slices (a global-norm clip under ZeRO keeps the reduce-scatter)."""
    trace = _CURRENT.get()

    def scale(g):
        new = g * factor.astype(g.dtype)
        own = own_gradient(g)
        if own is not None:
            remember_own_gradient(new, own * factor.astype(own.dtype))
        found = trace.grad_slice.get(id(g)) if trace is not None else None
        if found is not None:
            trace.grad_slice[id(new)] = (found[0] * factor.astype(found[0].dtype), found[1], new)
        return new

    return jax.tree.map(scale, grads)


def update_slices(
    update: Callable, grads: PyTree, params: PyTree, opt_state: PyTree
) -> tuple[tuple[PyTree, PyTree], Any]:
    """``update(pieces, slices, opt_state) -> ((slices, opt_state), extra)`` on this
    device's slices of the sharded parameters (``params``, gathered), with
    ``pieces`` the gradients as `scattered` gives them; the new slices come back
    gathered whole again (`param_wholes`). Outside a sharded `Replicator.run`,
    ``update(grads, params, opt_state)``.

    ``update`` applies the whole ``grads`` through the wrapped optimizer, which
    finds their slices while this lasts, and adds the update's slices with
    `apply_updates`."""
    with scattered(grads, params) as pieces:
        (new_params, opt_state), extra = update(pieces, param_slices(params), opt_state)
    return (param_wholes(new_params, params), opt_state), extra


@contextlib.contextmanager
def scattered(grads: PyTree, params: PyTree) -> Iterator[PyTree]:
    """While `rp.TrainState.apply_gradients` traces one update: ``grads`` with each
    gradient `summed` left unsummed as this device's slice of the sum, reduce-
    scattered once; the wrapped optimizer updates with these slices (it finds
    them by the summed gradient) until the block ends. Not kept beyond: a slice
    belongs to the trace it was made in (an update inside a ``lax.cond`` branch
    must not hand its slices to the next one)."""
    trace = _CURRENT.get()
    if trace is None:
        yield grads
        return
    leaves, treedef = jax.tree.flatten(grads)
    made, out = {}, []
    for g, spec in zip(leaves, _grad_specs(trace, grads, params)):
        if _summed_here(trace, g) and _known(spec):
            piece = _grad_slice(trace, g, spec)  # (an enclosing block's, if it made one)
            made[id(g)] = (piece, spec, g)  # (g: keeps its id from being reused)
            g = piece
        out.append(g)
    outer = trace.grad_slice
    trace.grad_slice = {**outer, **made}
    try:
        yield jax.tree.unflatten(treedef, out)
    finally:
        trace.grad_slice = outer


def _summed_here(trace: _Trace, g: Any) -> bool:
    """Whether ``g`` is a summed gradient whose slice can come without the whole sum."""
    return id(g) in trace.grad_slice or own_gradient(g) is not None


def _grad_slice(trace: _Trace, g: jax.Array, spec: P) -> jax.Array:
    """This device's slice of the summed gradient ``g``, reduce-scattered from its own,
    unsummed part (or the slice `scattered` made, while it lasts), in ``g``'s dtype
    (the part may be narrower: the dtype the sum is carried in)."""
    found = trace.grad_slice.get(id(g))
    if found is not None and found[1] == spec:
        return found[0]
    piece = reduce_scatter(own_gradient(g), spec, trace.axes)
    return piece if piece.dtype == g.dtype else piece.astype(g.dtype)


def param_slices(params: PyTree) -> PyTree:
    """``params`` with each gathered sharded parameter as this device's slice of it."""
    trace = _CURRENT.get()
    if trace is None:
        return params
    # (Every whole in ``trace.wholes`` was gathered by `_gathered`, which remembers its slice.)
    return jax.tree.map(lambda x: trace.slice_of[id(x)][0] if id(x) in trace.wholes else x, params)


def apply_updates(params: PyTree, updates: PyTree, wholes: PyTree) -> PyTree:
    """``optax.apply_updates`` on `param_slices` (``params``; ``wholes`` the parameters
    they are slices of): each sharded parameter's slice takes its update's slice
    (ZeRO: the whole update is never needed), the others their whole update."""
    trace = _CURRENT.get()
    if trace is not None:

        def piece(u, whole):
            spec = trace.wholes.get(id(whole))
            if u is None or spec is None:
                return u
            found = slice_for(u, spec)
            return local_slice(u, spec) if found is None else found

        updates = jax.tree.map(piece, updates, wholes, is_leaf=lambda x: x is None)
    return optax.apply_updates(params, updates)


def param_wholes(slices: PyTree, wholes: PyTree) -> PyTree:
    """The inverse of `param_slices`: each slice gathered whole again, remembered, so
    that `Replicator.run` returns the slice and the gather is dead code."""
    trace = _CURRENT.get()
    if trace is None:
        return slices

    def whole(x, was):
        spec = trace.wholes.get(id(was))
        if spec is None:
            return x
        x = _gathered(trace, x, spec)
        trace.wholes[id(x)] = spec  # a parameter as the step's inputs are
        return x

    return jax.tree.map(whole, slices, wholes)


def _common_suffix(a: tuple, b: tuple) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[-1 - n] == b[-1 - n]:
        n += 1
    return n


# ---------------------------------------------------------------- optimizer

_AMBIGUOUS = P("ambiguous")  # a leaf shaped like parameters sharded in different ways


def _known(spec: P | None) -> bool:
    return spec is not None and spec is not _AMBIGUOUS


def shard_optimizer(
    tx: optax.GradientTransformationExtraArgs, axis_names: Sequence[str]
) -> optax.GradientTransformationExtraArgs:
    """``tx`` that, in a `Replicator.run` step with sharded arguments, updates this
    device's slices (`update`), and elsewhere is ``tx`` itself. Its state is ``tx``'s.
    The gradients it receives are summed across replicas already."""
    axis_names = tuple(axis_names)

    def update_fn(grads, state, params=None, **extra_args):
        if not active():
            return tx.update(grads, state, params, **extra_args)
        return update(tx, grads, state, params, axis_names, **extra_args)

    return optax.GradientTransformationExtraArgs(tx.init, update_fn)


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
    the summed gradient (reduce-scattered where `summed` left it unsummed) and
    of the optimizer state; the updates are gathered whole, so the step can
    apply them as it would on one device (`apply_updates` takes the slices
    instead), and optimizer state that came in as a slice stays one (any other
    is gathered whole again). Other gradients are all-reduced as under data
    parallelism.
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
    unsliced = [None if kept else s for kept, s in zip(sliced, state_specs)]  # slices stay
    return (
        _map(trace, updates, grad_specs, _gathered),
        _map(trace, new_state, unsliced, _gathered),
    )


def _is_optimizer_state(path: Sequence[Any]) -> bool:
    return any(getattr(k, "name", getattr(k, "key", None)) == "opt_state" for k in path)


def _is_slice(trace: _Trace, x: Any) -> bool:
    """Whether ``x`` is an optimizer-state slice: varying over the replica axes, shaped
    like one that came in as a slice."""
    return (
        hasattr(x, "shape")
        and x.shape in trace.by_slice_shape
        and bool(compat.varying_manual_axes(x))
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
    if _summed_here(trace, x):  # a gradient `summed` left unsummed: reduce-scatter it
        return _grad_slice(trace, x, spec)
    piece = slice_for(x, spec)
    return local_slice(x, spec) if piece is None else piece


def _spec_by_shape(trace: _Trace, x: Any) -> P | None:
    if not hasattr(x, "shape"):
        return None
    if compat.varying_manual_axes(x):  # an optimizer-state slice, or no ZeRO leaf
        found = set(trace.by_slice_shape.get(x.shape, ())) if _is_slice(trace, x) else set()
    else:
        found = set(trace.by_shape.get(x.shape, ()))
    return found.pop() if len(found) == 1 else (_AMBIGUOUS if found else None)


def _ending_like(inputs: list, x: Any, path: tuple) -> set:
    """The specs of the ``inputs`` (``trace.paths`` or ``.slices``) shaped like ``x`` whose
    key path ends like ``path`` (``.../params/fc/kernel`` for ``fc/kernel``)."""
    shape, n = np.shape(x), len(path)
    return {s for where, sh, s, _ in inputs if sh == shape and where[len(where) - n :] == path}


def _grad_specs(trace: _Trace, grads: PyTree, params: PyTree | None) -> list[P | None]:
    """Each gradient's spec: its parameter's, the sharded input whose key path ends
    like the gradient's, else by shape."""
    specs = []
    for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]:
        found = _ending_like(trace.paths, g, tuple(path))
        if len(found) > 1:
            specs.append(_AMBIGUOUS)
        else:
            specs.append(found.pop() if found else _spec_by_shape(trace, g))
    return specs


def _state_specs(
    trace: _Trace, state: PyTree, grad_def, grad_specs: list, path: tuple = ()
) -> list[P | None]:
    """Each optimizer-state leaf's spec: a subtree shaped like the gradients (Adam's
    moments) pairs with them; a slice is its input's by key path (`_ending_like`: slices
    of one shape may split differently, as LoRA's adapters do); the rest by shape."""
    if jax.tree.structure(state) == grad_def:
        return list(grad_specs)
    children = jax.tree_util.tree_flatten_with_path(state, is_leaf=lambda x: x is not state)[0]
    if len(children) == 1 and children[0][1] is state:  # a leaf
        found = _ending_like(trace.slices, state, path) if _is_slice(trace, state) else ()
        return [next(iter(found)) if len(found) == 1 else _spec_by_shape(trace, state)]
    return [
        spec
        for key, child in children
        for spec in _state_specs(trace, child, grad_def, grad_specs, path + tuple(key))
    ]


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
            whole = k == 1 and sliced[i] and _known(s)
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
