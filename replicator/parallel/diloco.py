"""DiLoCo: islands of replicas that train apart and meet every ``inner_steps``.

Douillard et al. (2023), "DiLoCo: Distributed Low-Communication Training of
Language Models", and its streaming variant (2025). The replicas along one mesh
axis (``axis``, e.g. ``"data"`` across TPU slices or sites) form *islands*;
inside an island the replicas are ordinary data parallelism. Each island takes
``inner_steps`` (H) steps of the inner optimizer on its own data, its gradients
all-reduced only among its own replicas. Then the islands average their change
of the parameters once (the *outer gradient*, ``outer - island``), an outer
optimizer (Nesterov SGD, lr 0.7, momentum 0.9) applies it to the outer
parameters, and every island starts again from them, keeping its inner
optimizer state. Traffic across islands drops H-fold.

It is a synchronisation policy of the wrapped optimizer, so the step does not
change::

  repl = rp.Replicator(mesh={"data": 4, "fsdp": 2})       # 4 islands of 2 replicas
  tx = repl.wrap_optimizer(optax.adam(1e-3), sync=rp.DiLoCo(inner_steps=50))
  state = rp.TrainState.create(params, tx, key)            # as always
  state, loss = repl.run(train_step, state, batch)         # per-replica step, unchanged

The islands' parameters differ, so `rp.TrainState`'s ``params`` and the inner
optimizer state travel through `Replicator.run` (and `Replicator.compile`, which
runs such a step once per island in the global view of its batch) as
per-island values, one row per island (placed so from a fresh state
automatically); the outer parameters (`DiLoCoState.outer_params`, what to
evaluate) are mirrored. Which axis the islands span travels with the state
itself: the type of its `DiLoCoState` says it (`DiLoCoState.island_axis`,
static, like a pytree's structure), so no Replicator needs telling;
`replicator.parallel.groups` places such states and runs their programs. `outer_view`
gives a train state with the outer parameters in place of the islands'.
`ElasticIslands` (`replicator.runtime.elastic`) runs one island per process, for
islands that may die; `traffic` (`replicator.compiled.hlo`) measures a step's bytes
between islands.

Streaming DiLoCo's knobs: ``fragments`` syncs the parameters in that many
groups at staggered steps (peak traffic / fragments); ``overlap_steps`` applies
an outer gradient that many steps after it was sent, mixing it into the island's
parameters (``mix``) instead of replacing them; ``outer_dtype`` sends the outer
gradient in a narrow dtype (e.g. bfloat16) and accumulates it in float32.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.flatten_util import ravel_pytree

from replicator.compiled.hlo import traffic as traffic
from replicator.parallel import zero as zero
from replicator.runtime import compat
from replicator.runtime.elastic import ElasticIslands as ElasticIslands
from replicator.spmd.context import (
    get_replica_context,
    group_axis,
    in_global_view,
    sum_varying,
    vary,
    varying_axes,
)

PyTree = Any


@dataclasses.dataclass(frozen=True)
class DiLoCo:
    """DiLoCo synchronisation for `Replicator.wrap_optimizer` (``sync=``).

    Args:
      inner_steps: H, the inner steps between two syncs of a fragment.
      outer_optimizer: the optax transformation applied to the averaged outer
        gradient ``outer - island``; None: Nesterov SGD, lr 0.7, momentum 0.9
        (the paper's). ``optax.sgd(1.0)`` makes a sync a plain average.
      axis: the mesh axis whose replicas are the islands (default ``"data"``);
        the other replica axes are data parallelism inside each island.
      fragments: Streaming DiLoCo: the parameter leaves split into this many
        contiguous groups of about equal size, each synced every H steps, the
        groups H / fragments steps apart.
      overlap_steps: Streaming DiLoCo: a fragment's outer gradient is applied
        this many steps after it was sent (0: at once); the island's parameters
        then become ``mix * outer + (1 - mix) * island``.
      mix: the weight of the outer parameters when ``overlap_steps > 0``.
      outer_dtype: the dtype the outer gradient crosses the islands in (e.g.
        ``"bfloat16"``: half the bytes); summed in float32. None: the
        parameters' dtype, all-reduced.
      elastic: islands are processes that may die, synced on the host by
        `ElasticIslands` (the step itself never syncs); see `ElasticIslands`.
    """

    inner_steps: int
    outer_optimizer: optax.GradientTransformation | None = None
    axis: str = "data"
    fragments: int = 1
    overlap_steps: int = 0
    mix: float = 0.5
    outer_dtype: Any = None
    elastic: bool = False

    def __post_init__(self):
        h = self.inner_steps
        if not isinstance(h, int) or h < 1:
            raise ValueError(f"DiLoCo(inner_steps={h!r}): use a positive int.")
        if not isinstance(self.fragments, int) or not 1 <= self.fragments <= h:
            raise ValueError(
                f"DiLoCo(fragments={self.fragments!r}): use an int from 1 to inner_steps={h}."
            )
        if not isinstance(self.overlap_steps, int) or not 0 <= self.overlap_steps < h:
            raise ValueError(
                f"DiLoCo(overlap_steps={self.overlap_steps!r}): use an int from 0 to "
                f"inner_steps - 1 = {h - 1} (an outer gradient lands before the next is sent)."
            )
        if not 0.0 < self.mix <= 1.0:
            raise ValueError(f"DiLoCo(mix={self.mix!r}): use a weight in (0, 1].")
        if self.outer_dtype is not None:
            jnp.dtype(self.outer_dtype)  # a clear numpy error for a bad name
        if self.elastic and (self.fragments, self.overlap_steps) != (1, 0):
            raise ValueError("DiLoCo(elastic=True) syncs whole: use fragments=1, overlap_steps=0.")

    @functools.cached_property
    def outer(self) -> optax.GradientTransformation:
        """The outer optimizer."""
        if self.outer_optimizer is not None:
            return self.outer_optimizer
        return optax.sgd(0.7, momentum=0.9, nesterov=True)

    def syncs_at(self, count: jax.Array, fragment: int) -> jax.Array:
        """Whether ``fragment`` is sent after inner step ``count`` (counted from 1)."""
        offset = fragment * (self.inner_steps // self.fragments)
        return (count >= 1) & ((count + offset) % self.inner_steps == 0)

    def outer_step(self, tree: PyTree, mean: Callable[[np.ndarray], np.ndarray]) -> PyTree:
        """Every DiLoCo train state in ``tree`` after one outer step on the islands'
        mean outer gradient, ``mean(island_delta(state))``: how `ElasticIslands`
        syncs on the host (``mean``: over the processes alive)."""
        return map_states(tree, lambda x: apply_mean_delta(self, x, mean(island_delta(x))))


class DiLoCoState(NamedTuple):
    """The wrapped optimizer's state under DiLoCo.

    Attributes:
      inner: the inner optimizer's state (per island).
      outer_params: the outer parameters, the same on every island: what a
        sync resets the islands to, and what to evaluate.
      outer: the outer optimizer's state, one per fragment.
      count: inner steps taken (int32).
      synced: per fragment, whether its island parameters were set to the outer
        ones at the last step (`settle` makes that exact).
      pending: per fragment, the outer gradient sent but not yet applied
        (``overlap_steps > 0``), else ``()``.
      island_axis: the mesh axis whose replicas are the islands (None: no islands
        on the mesh, e.g. elastic ones, one per process). Not a field: the
        policy's axis, carried by the state's type (`state_type`), so it travels
        with the state through jit, checkpoints and `Replicator.run`.
    """

    inner: PyTree
    outer_params: PyTree
    outer: tuple
    count: jax.Array
    synced: jax.Array
    pending: tuple = ()

    island_axis = None  # a class attribute: see `state_type`


@functools.cache
def state_type(island_axis: str | None) -> type[DiLoCoState]:
    """`DiLoCoState` for islands along ``island_axis``: a subclass that says so, with the
    same fields (hence the same leaves and key paths in checkpoints)."""
    if island_axis is None:
        return DiLoCoState
    return type(
        "DiLoCoState",
        (DiLoCoState,),
        {
            "__slots__": (),
            "__module__": __name__,
            "island_axis": island_axis,
            "__reduce__": lambda self: (_rebuild_state, (island_axis, tuple(self))),
        },
    )


def _rebuild_state(island_axis: str | None, values: tuple) -> DiLoCoState:
    return state_type(island_axis)._make(values)  # (a pickled state, unpickled)


def wrap(
    tx: optax.GradientTransformationExtraArgs,
    policy: DiLoCo,
    axis_names: tuple[str, ...],
    sum_within: Callable[[PyTree, tuple[str, ...]], PyTree] | None = None,
) -> optax.GradientTransformationExtraArgs:
    """``tx`` as DiLoCo's inner optimizer, under ``policy`` (see the module doc).
    ``sum_within(grads, axes)`` sums the gradients over an island's replica ``axes``
    (None: each leaf over those it varies over; `replicator.step.optim`'s aggregators)."""
    outer_tx = policy.outer
    # Elastic islands are processes: on the mesh, the replicas are one island.
    make_state = state_type(None if policy.elastic else policy.axis)

    def init_fn(params):
        groups = fragment_leaves(params, policy.fragments)
        leaves = jax.tree.leaves(params)
        outer_params = jax.tree.map(jnp.array, params)  # a buffer of its own
        return make_state(
            inner=tx.init(params),
            outer_params=outer_params,
            # float32, as the outer step computes (bf16 parameters included)
            outer=tuple(outer_tx.init([leaves[i].astype(jnp.float32) for i in g]) for g in groups),
            count=jnp.zeros((), jnp.int32),
            synced=jnp.zeros((policy.fragments,), bool),
            pending=tuple(
                [jnp.zeros(leaves[i].shape, jnp.float32) for i in g] for g in groups
            ) if policy.overlap_steps else (),
        )  # fmt: skip

    def update_fn(grads, state, params=None, **extra):
        if params is None:
            raise ValueError("DiLoCo needs the parameters: call tx.update(grads, state, params).")
        island, inner_axes, islands, scale = _islands(policy, axis_names, grads)

        def reduce(mine, theirs):  # the islands' mean outer gradient
            return _mean_over_islands(mine, theirs, island, islands, policy.outer_dtype)

        if sum_within is None:
            grads = jax.tree.map(lambda g: sum_varying(g, inner_axes), grads)
        else:
            grads = sum_within(grads, inner_axes)
        if scale > 1:
            grads = jax.tree.map(lambda g: g * scale, grads)
        updates, inner = tx.update(grads, state.inner, params, **extra)
        local = optax.apply_updates(params, updates)
        state = state._replace(inner=inner, count=state.count + 1)
        if policy.elastic:  # synced between steps, on the host (ElasticIslands)
            return updates, state._replace(synced=jnp.zeros_like(state.synced))
        new_local, state = _sync_fragments(policy, reduce, local, state)
        updates = jax.tree.map(lambda new, old: (new - old).astype(old.dtype), new_local, params)
        return updates, state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _sync_fragments(policy: DiLoCo, reduce: Callable, local: PyTree, state: DiLoCoState):
    """After inner step ``state.count``: the island's parameters (``local`` before) and
    ``state`` with every fragment due sent, or its overlapped outer gradient applied."""
    outer_tx, count = policy.outer, state.count
    leaves, treedef = jax.tree.flatten(local)
    outer_leaves = jax.tree.leaves(state.outer_params)
    outer_states, synced, pending = list(state.outer), [], list(state.pending)
    for f, group in enumerate(fragment_leaves(local, policy.fragments)):
        mine = [leaves[i] for i in group]
        theirs = [outer_leaves[i] for i in group]
        if not policy.overlap_steps:
            mine, theirs, outer_states[f] = jax.lax.cond(
                policy.syncs_at(count, f),
                lambda m, o, s: _apply_outer(outer_tx, reduce(m, o), m, o, s, 1.0),
                lambda m, o, s: (m, o, s),
                mine, theirs, outer_states[f],
            )  # fmt: skip
            synced.append(policy.syncs_at(count, f))
        else:
            # The gradient sent overlap_steps ago lands first; then this step's leaves.
            mine, theirs, outer_states[f] = jax.lax.cond(
                policy.syncs_at(count - policy.overlap_steps, f),
                lambda m, o, s, p: _apply_outer(outer_tx, p, m, o, s, policy.mix),
                lambda m, o, s, p: (m, o, s),
                mine, theirs, outer_states[f], pending[f],
            )  # fmt: skip
            pending[f] = jax.lax.cond(
                policy.syncs_at(count, f),
                lambda m, o, p: reduce(m, o),
                lambda m, o, p: p,
                mine, theirs, pending[f],
            )  # fmt: skip
            synced.append(jnp.zeros((), bool))
        for i, m, o in zip(group, mine, theirs):
            leaves[i], outer_leaves[i] = m, o
    return jax.tree.unflatten(treedef, leaves), state._replace(
        outer_params=jax.tree.unflatten(treedef, outer_leaves),
        outer=tuple(outer_states),
        synced=jnp.stack(synced),
        pending=tuple(pending),
    )


def _islands(policy: DiLoCo, axis_names: tuple[str, ...], grads: PyTree):
    """The island axis (None: one island), the axes inside an island, how many
    islands, and by what to scale the gradients to the island's mean."""
    if in_global_view():  # repl.compile: the step sees one island's batch, or all
        axis = group_axis()
        if axis is None or policy.elastic:
            return None, (), 1, 1
        islands = jax.lax.axis_size(axis)  # losses scaled by the global batch, as in run
        return axis, (), islands, islands
    if zero.active():
        raise ValueError(
            "DiLoCo with parameters sharded over the replica axes (ZeRO under repl.run) is "
            "not supported: keep the parameters replicated inside each island (a mesh "
            "without fsdp, or rules that leave them replicated)."
        )
    ctx = get_replica_context()
    inner = summing_axes(policy, axis_names)
    if ctx is None or policy.axis not in ctx.axis_name or policy.elastic:
        # Plain jax.jit on one device, or an island axis of size 1: one island.
        return None, inner, 1, 1
    islands = jax.lax.axis_size(policy.axis)
    for g in jax.tree.leaves(grads):
        if policy.axis not in varying_axes(g, axis_names):
            raise ValueError(
                "DiLoCo: a gradient is the same on every island, so autodiff summed it "
                "over all of them: the parameters must enter repl.run as per-island "
                "values, one row per "
                "island. Keep them (and the inner optimizer state) in an rp.TrainState: "
                "run places it that way itself, from its DiLoCo optimizer state."
            )
    # Losses are scaled by the global batch: the island's sum is 1/islands of its mean.
    return policy.axis, inner, islands, islands


def summing_axes(policy: DiLoCo, axis_names: tuple[str, ...]) -> tuple[str, ...]:
    """The replica axes an island's gradients are summed over in the step being traced:
    those inside an island under `Replicator.run` (all of them where the replicas are
    one island), none in the global view or outside ``run``."""
    ctx = get_replica_context()
    if in_global_view() or ctx is None:
        return ()
    if policy.axis not in ctx.axis_name or policy.elastic:
        return tuple(ctx.axis_name)
    return tuple(a for a in axis_names if a != policy.axis)


def _mean_over_islands(mine, theirs, island, islands, dtype) -> list:
    """The islands' mean outer gradient ``outer - island``, in float32."""
    deltas = [o.astype(jnp.float32) - m.astype(jnp.float32) for m, o in zip(mine, theirs)]
    if island is None:
        return deltas
    if dtype is None:
        return [jax.lax.pmean(d, island) for d in deltas]
    return [_narrow_mean(d, island, islands, dtype) for d in deltas]


def _narrow_mean(x: jax.Array, island: str, islands: int, dtype) -> jax.Array:
    """The islands' mean of ``x``, sent in ``dtype`` and summed in float32: an
    all-reduce spelled as all-to-all (each island gets every island's copy of one
    slice), a float32 sum of the slice, and an all-gather of the slices."""
    flat = x.reshape(-1)
    pad = -flat.size % islands
    rows = jnp.pad(flat, (0, pad)).astype(dtype).reshape(islands, -1)
    mine = jax.lax.all_to_all(rows, island, split_axis=0, concat_axis=0, tiled=True)
    total = jnp.sum(mine.reshape(islands, -1).astype(jnp.float32), axis=0) / islands
    whole = compat.all_gather_invariant(total.astype(dtype), (island,), 0)
    return whole.astype(jnp.float32)[: flat.size].reshape(x.shape)


def _apply_outer(outer_tx, delta, mine, theirs, state, mix):
    """One outer step on a fragment: new outer leaves, and the island's leaves after it."""
    theirs32 = [o.astype(jnp.float32) for o in theirs]
    updates, state = outer_tx.update(delta, state, theirs32)
    new = [(o + u).astype(o_old.dtype) for o, u, o_old in zip(theirs32, updates, theirs)]
    if mix == 1.0:
        mine = [_typed_like(n, m) for n, m in zip(new, mine)]
    else:
        mine = [_typed_like(mix * n + (1 - mix) * m, m) for n, m in zip(new, mine)]
    return mine, new, state


def _typed_like(x: jax.Array, like: jax.Array) -> jax.Array:
    """``x`` in ``like``'s dtype, varying over the axes ``like`` varies over (so that
    both branches of a sync's ``cond`` have one type)."""
    return vary(x.astype(like.dtype), tuple(compat.varying_manual_axes(like)))


def fragment_leaves(params: PyTree, fragments: int) -> list[list[int]]:
    """The parameter leaves (flat indices) in ``fragments`` contiguous groups of about
    equal size; every group has at least one leaf."""
    sizes = [int(np.prod(np.shape(x))) for x in jax.tree.leaves(params)]
    if fragments > len(sizes):
        raise ValueError(
            f"DiLoCo(fragments={fragments}) but the parameters have only {len(sizes)} leaves."
        )
    bounds, total, start = [], sum(sizes), 0
    for f in range(1, fragments):
        # Cut where the running size first reaches f / fragments, leaving a leaf for each
        # fragment still to come.
        cut, running = start + 1, sum(sizes[: start + 1])
        while cut < len(sizes) - (fragments - f) and running < total * f / fragments:
            running += sizes[cut]
            cut += 1
        bounds.append(cut)
        start = cut
    edges = [0, *bounds, len(sizes)]
    return [list(range(a, b)) for a, b in zip(edges, edges[1:])]


def find_state(opt_state: PyTree) -> DiLoCoState | None:
    """The `DiLoCoState` at the top of (or anywhere in) ``opt_state``, or None."""
    found = [
        x
        for x in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, DiLoCoState))
        if isinstance(x, DiLoCoState)
    ]
    return found[0] if found else None


def settle(params: PyTree, opt_state: PyTree) -> PyTree:
    """``params`` with each fragment just synced set to the outer parameters exactly.

    The update a sync returns is ``outer - island``, and ``island + (outer -
    island)`` can miss ``outer`` by a rounding; `rp.TrainState.apply_gradients`
    calls this so that every island holds the outer parameters bitwise.
    """
    state = find_state(opt_state)
    if state is None:
        return params
    leaves, treedef = jax.tree.flatten(params)
    outer = jax.tree.leaves(state.outer_params)
    for f, group in enumerate(fragment_leaves(params, state.synced.shape[0])):
        for i in group:
            leaves[i] = jnp.where(state.synced[f], outer[i].astype(leaves[i].dtype), leaves[i])
    return jax.tree.unflatten(treedef, leaves)


def map_states(tree: PyTree, fn: Callable[[Any], Any]) -> PyTree:
    """``tree`` with each DiLoCo train state ``x`` (an `rp.TrainState` whose optimizer
    state is a `DiLoCoState`) replaced by ``fn(x)``."""
    return jax.tree.map(lambda x: fn(x) if _is_state(x) else x, tree, is_leaf=_is_state)


def outer_view(tree: PyTree) -> PyTree:
    """``tree`` with each DiLoCo `rp.TrainState`'s ``params`` replaced by its outer
    parameters (mirrored, one copy): the model to evaluate, export or serve."""
    return map_states(tree, lambda x: x.replace(params=x.opt_state.outer_params))


def map_islands(tree: PyTree, fn) -> PyTree:
    """``tree`` with ``(params, inner)`` of each DiLoCo `rp.TrainState` replaced by
    ``fn((params, inner))``: e.g. stacked one row per island, or their shardings."""

    def apply(x):
        params, inner = fn((x.params, x.opt_state.inner))
        return x.replace(params=params, opt_state=x.opt_state._replace(inner=inner))

    return map_states(tree, apply)


def outer_bytes(tree: PyTree) -> int:
    """The bytes of one copy of the outer parameters of every DiLoCo train state in ``tree``."""
    states = [x for x in jax.tree.leaves(tree, is_leaf=_is_state) if _is_state(x)]
    return sum(x.nbytes for s in states for x in jax.tree.leaves(s.opt_state.outer_params))


def has_states(tree: PyTree) -> bool:
    """Whether ``tree`` holds a DiLoCo train state."""
    return any(_is_state(x) for x in jax.tree.leaves(tree, is_leaf=_is_state))


def island_axis_of(tree: PyTree) -> str | None:
    """The mesh axis the islands of the DiLoCo train states in ``tree`` span (their
    `DiLoCoState.island_axis`), or None: no such state, or none with islands on a mesh."""
    states = [x for x in jax.tree.leaves(tree, is_leaf=_is_state) if _is_state(x)]
    axes = sorted({s.opt_state.island_axis for s in states} - {None})
    if len(axes) > 1:
        raise ValueError(
            f"DiLoCo train states with islands along different axes {axes} in one call: "
            "run or compile a step on states of one policy axis at a time."
        )
    return axes[0] if axes else None


def _is_state(x: Any) -> bool:
    """Whether ``x`` is a train state under DiLoCo: an `rp.TrainState` (or any object
    with ``params``, ``replace`` and a `DiLoCoState` as ``opt_state``)."""
    return isinstance(getattr(x, "opt_state", None), DiLoCoState) and hasattr(x, "replace")


# ------------------------------------------------------------------ elastic


def island_delta(state: Any) -> np.ndarray:
    """This island's outer gradient ``outer - island``: one float32 vector on the host."""
    return np.asarray(jax.device_get(_delta(state.params, state.opt_state.outer_params)))


@jax.jit
def _delta(params, outer):
    parts = [
        o.astype(jnp.float32) - p.astype(jnp.float32)
        for p, o in zip(jax.tree.leaves(params), jax.tree.leaves(outer))
    ]
    return ravel_pytree(parts)[0]


def apply_mean_delta(policy: DiLoCo, state: Any, mean: np.ndarray) -> Any:
    """``state`` after the outer step on the islands' mean outer gradient ``mean``
    (from `island_delta` of each island): new outer parameters, and the island's
    parameters set to them exactly. The loop decides when to sync (every
    ``inner_steps`` steps it ran: an island that skipped a non-finite update
    counts fewer inner steps, and still syncs with the others)."""
    return _outer_step(policy.outer, state, mean)


@functools.partial(jax.jit, static_argnums=0)
def _outer_step(outer_tx, state, mean):
    leaves = jax.tree.leaves(state.opt_state.outer_params)
    delta = ravel_pytree([x.astype(jnp.float32) for x in leaves])[1](mean)  # as `_delta` laid it
    mine = jax.tree.leaves(state.params)
    mine, new, outer = _apply_outer(outer_tx, delta, mine, leaves, state.opt_state.outer[0], 1.0)
    treedef = jax.tree.structure(state.params)
    return state.replace(
        params=jax.tree.unflatten(treedef, mine),
        opt_state=state.opt_state._replace(
            outer_params=jax.tree.unflatten(treedef, new),
            outer=(outer,),
            synced=jnp.ones_like(state.opt_state.synced),
        ),
    )
