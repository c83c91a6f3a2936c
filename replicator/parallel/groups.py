"""DiLoCo's islands on one mesh: which calls have them, their rows, their programs.

A DiLoCo train state says which mesh axis its islands span
(`replicator.parallel.diloco.DiLoCoState.island_axis`, carried by the state's type from
``tx.init`` of ``repl.wrap_optimizer(tx, sync=rp.DiLoCo(...))``): wrapping an
optimizer changes no Replicator, the layout travels with each call's arguments.
Where that axis has several replicas, the state's parameters and inner
optimizer state travel one row per island (per-island values,
`placement.Kind.PER_GROUP`): `Islands.axis_of` says so for a call (once per
argument structure), `run` places fresh states in rows (`Islands.place`), and
`compile` runs such a step in the global view of each island, as one program
manual over the island axis only (``shard_map``; the other axes stay with the
compiler). `replicator.parallel.diloco` is the algorithm; this module is all that `run`
and `compile` know of it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from replicator.parallel import diloco as diloco
from replicator.parallel import placement as placement
from replicator.parallel.mesh import DATA_AXES
from replicator.parallel.placement import Kind, remember
from replicator.spmd.context import global_view, group_view, varying_axes
from replicator.spmd.dispatch import StepsInFlight

PyTree = Any
_UNSEEN = object()


def check_sync(sync: Any) -> None:
    """Raises for a ``sync`` that `Replicator.wrap_optimizer` cannot take: not an
    `rp.DiLoCo`, or islands along an axis that is not a replica axis."""
    if not isinstance(sync, diloco.DiLoCo):
        raise TypeError(f"sync must be None or rp.DiLoCo(...), got {sync!r}.")
    if sync.axis not in DATA_AXES:
        raise ValueError(
            f"DiLoCo(axis={sync.axis!r}): islands are replicas along one of the "
            f"replica axes {DATA_AXES}."
        )


def initial_rows(
    mesh: jax.sharding.Mesh, axis: str, init: Callable, abstract: PyTree
) -> tuple[Callable, PyTree]:
    """A DiLoCo train state created in rows, for a jitted init (the trainer's): ``init``
    (whose output is shaped ``abstract``) with each DiLoCo state's parameters and inner
    optimizer state one row per island along ``axis`` (as `run` keeps them, so
    checkpoints restore in that shape), and its shardings: those rows split over
    ``axis``, the rest mirrored. One island: ``init`` as it is, all mirrored."""
    islands = mesh.shape[axis]
    mirrored = jax.tree.map(lambda _: placement.sharding_for(Kind.MIRRORED, mesh), abstract)
    if islands == 1:
        return init, mirrored
    split = placement.sharding_for(Kind.PER_GROUP, mesh, axis)
    stack = lambda tree: jax.tree.map(lambda x: jnp.broadcast_to(x, (islands, *x.shape)), tree)
    rows = lambda: diloco.map_islands(init(), stack)
    return rows, diloco.map_islands(mirrored, lambda tree: jax.tree.map(lambda _: split, tree))


class GroupStates(Exception):
    """Raised while `Replicator.compile` traces a step given DiLoCo train states with
    islands on the mesh (`Islands.refuse`): the caller runs `Islands.compile`'s program."""


class ReplicaGroups:
    """The islands of one mesh: which calls have them, and their rows and programs."""

    def __init__(self, mesh: jax.sharding.Mesh, in_flight: StepsInFlight, compiler_options):
        self.mesh, self._in_flight, self._compiler_options = mesh, in_flight, compiler_options
        self._axes: dict[Any, str | None] = {}  # argument structure -> island axis

    def axis_of(self, args: tuple, treedef: Any = None) -> str | None:
        """The island axis of the DiLoCo train states in ``args`` where it has several
        replicas on this mesh, else None (elastic islands are processes: this mesh's
        replicas are one island). Per argument structure (``treedef``, if known): the
        states' types carry the axis."""
        treedef = jax.tree.structure(args) if treedef is None else treedef
        axis = self._axes.get(treedef, _UNSEEN)
        if axis is _UNSEEN:
            axis = diloco.island_axis_of(args)
            if axis is not None and self.mesh.shape.get(axis, 1) == 1:
                axis = None  # one island: plain data parallelism
            axis = self._axes[treedef] = axis
        return axis

    def place(self, args: tuple, axis: str) -> tuple:
        """``args`` with the parameters and inner optimizer state of every DiLoCo train
        state as per-island values along ``axis``, as `run` needs them: a fresh state's
        (mirrored, shaped like the outer parameters) become one row per island; stacked
        ones (``run``'s outputs, a restored checkpoint) are marked per-island."""
        islands = self.mesh.shape[axis]

        def place_state(x):
            own = (x.params, x.opt_state.inner)
            shapes = [jnp.shape(p) for p in jax.tree.leaves(x.params)]
            outer = [jnp.shape(o) for o in jax.tree.leaves(x.opt_state.outer_params)]
            if shapes == outer:
                params, inner = self.rows(own, axis)
                return x.replace(params=params, opt_state=x.opt_state._replace(inner=inner))
            if shapes != [(islands, *s) for s in outer]:
                raise ValueError(
                    f"A DiLoCo train state's parameters have shapes {shapes[:3]}..., neither "
                    f"the outer parameters' {outer[:3]}... nor one row per island of them "
                    f"({islands} islands): it was saved on another mesh. Evaluate its outer "
                    "parameters (rp.diloco.outer_view), or train on the mesh that saved it."
                )
            for leaf in jax.tree.leaves(own):  # run's own outputs are known already
                if (
                    isinstance(leaf, jax.Array)
                    and leaf.ndim
                    and leaf.shape[0] == islands
                    and placement.known_kind(leaf) is None
                ):
                    remember(leaf, Kind.PER_GROUP)
            return x

        return diloco.map_states(args, place_state)

    def rows(self, tree: PyTree, axis: str) -> PyTree:
        """``tree`` as per-island values (DiLoCo's parameters) along ``axis``, each
        island's row a copy of it."""
        n = self.mesh.shape[axis]
        stack = jax.jit(
            lambda t: jax.tree.map(lambda x: jnp.broadcast_to(x, (n, *jnp.shape(x))), t),
            out_shardings=placement.sharding_for(Kind.PER_GROUP, self.mesh, axis),
        )
        rows = stack(tree)
        for x in jax.tree.leaves(rows):
            remember(x, Kind.PER_GROUP)
        return rows

    def refuse(self, fn: Callable) -> Callable:
        """``fn``, raising `GroupStates` at trace time for arguments with islands on
        this mesh: `compile`'s plain program is not theirs (found once per structure)."""

        @functools.wraps(fn)
        def traced(*args, **kwargs):
            if self.axis_of(args) is not None:
                raise GroupStates
            return fn(*args, **kwargs)

        return traced

    def compile(self, fn: Callable, donate: tuple[int, ...], compiler_options) -> Callable:
        """`compile` under DiLoCo: ``fn`` in the global view of each island, as one
        program manual over the island axis only (``shard_map``; the other axes
        stay with the compiler). Per-island values (the islands' parameters and
        inner state) go in and come out one row per island, as under `run`."""
        cache = {}
        options = {**(self._compiler_options or {}), **(compiler_options or {})} or None

        def prepare(args):
            island = self.axis_of(args)
            args = self.place(args, island)
            flat, treedef = jax.tree.flatten(args)
            rows = tuple(placement.known_kind(x) is Kind.PER_GROUP for x in flat)
            specs = tuple(
                placement.role_specs(_island_role(x, row), (island,), island)[0]
                for x, row in zip(flat, rows)
            )
            key = (treedef, rows, specs)
            if key not in cache:
                program, meta = self._program(fn, island, treedef, rows, specs)
                positions = placement.leaf_positions(args, donate)
                program = jax.jit(program, donate_argnums=positions, compiler_options=options)
                cache[key] = program, meta
            return (*cache[key], flat)

        def step(*args, **kwargs):
            if kwargs:
                raise TypeError("repl.compile under DiLoCo takes positional arguments.")
            program, meta, flat = prepare(args)
            out = self._in_flight.dispatch(program, *flat)
            for i in meta["per_island"]:
                remember(out[i], Kind.PER_GROUP)
            return jax.tree.unflatten(meta["tree"], out)

        def lower(*args, **kwargs) -> jax.stages.Lowered:
            del kwargs
            program, _, flat = prepare(args)
            return program.lower(*flat)

        step.lower = lower
        step.__name__ = getattr(fn, "__name__", "step")
        return step

    def _program(self, fn: Callable, island: str, treedef, rows: tuple, specs: tuple):
        meta = {}
        shard_map = lambda body, out_specs: jax.shard_map(
            body, mesh=self.mesh, in_specs=specs, out_specs=out_specs,
            axis_names={island}, check_vma=True,
        )  # fmt: skip

        def call(*local):
            leaves = [x[0] if row else x for x, row in zip(local, rows)]
            with global_view(), group_view(island):
                out = fn(*jax.tree.unflatten(treedef, leaves))
            leaves, tree = jax.tree.flatten(out)
            return leaves, tree

        def program(*flat):
            def describe(*local):
                leaves, tree = call(*local)
                varies = [varying_axes(x, (island,)) for x in leaves]
                return tree, [Kind.PER_GROUP if v else Kind.MIRRORED for v in varies]

            tree, roles = placement.output_roles(shard_map, describe, flat)

            def body(*local):
                leaves, _ = call(*local)
                return tuple(x[None] if r is Kind.PER_GROUP else x for x, r in zip(leaves, roles))

            out_specs = tuple(placement.role_specs(r, (island,), island)[1] for r in roles)
            meta["tree"] = tree
            meta["per_island"] = [k for k, r in enumerate(roles) if r is Kind.PER_GROUP]
            out = shard_map(body, out_specs)(*flat)
            return tuple(
                jax.lax.with_sharding_constraint(x, placement.sharding_for(r, self.mesh, island))
                for x, r in zip(out, roles)
            )

        program.__name__ = f"islands_{getattr(fn, '__name__', 'step')}"
        return program, meta


def _island_role(x: Any, row: bool) -> placement.Role:
    if row:
        return Kind.PER_GROUP
    sharding = getattr(x, "sharding", None)
    return sharding if isinstance(sharding, NamedSharding) else Kind.MIRRORED
