"""`Replicator.run`'s program: the step once per replica, under ``jax.shard_map``.

For each step function and argument layout (the role of every leaf, from
`replicator.parallel.placement`) one program is built and cached: each replica gets its
slice of a batch, its row of a per-replica value, and the whole of anything
mirrored (a parameter sharded over the replicas gathered for the step,
`replicator.parallel.zero`). A first, abstract trace of the step (``eval_shape``) says
how each output leaves: mirrored where it is the same on every replica,
stacked per replica where it varies, sharded like the parameter it stands for.
Flax NNX objects go through the same program on their state (`replicator.spmd.graphs`).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from replicator.parallel import placement as placement
from replicator.parallel import zero as zero
from replicator.parallel.groups import ReplicaGroups
from replicator.parallel.mesh import DATA_AXES
from replicator.parallel.placement import ROWS, Kind, Roles, remember
from replicator.spmd import graphs as graphs
from replicator.spmd.context import (
    AxisNameError,
    ReplicaContext,
    replica_context,
    vary,
    varying_axes,
)
from replicator.spmd.dispatch import StepsInFlight
from replicator.spmd.global_view import axis_error, bind_axes, unbound_axis
from replicator.step.precision import Policy, expect_policy

PyTree = Any


class ReplicaPrograms:
    """`run`'s programs on one mesh, cached by step function and argument layout."""

    def __init__(
        self,
        roles: Roles,
        groups: ReplicaGroups,
        precision: Policy,
        in_flight: StepsInFlight,
        compiler_options: dict | None,
    ):
        self.roles, self.groups, self.precision = roles, groups, precision
        self._in_flight, self._compiler_options = in_flight, compiler_options
        self._device_set = set(roles.mesh.devices.flat)  # what NNX objects' arrays must sit on
        self.tensor_parallel = roles.mesh.shape["tensor"] > 1  # (mesh.shape builds a dict)
        self.cache: dict[Any, tuple[Callable, dict]] = {}
        self._graph_fns: dict[Any, Callable] = {}  # NNX steps as pure functions

    def run(self, fn: Callable, args: tuple, donate_argnums, replica_rngs: bool) -> PyTree:
        """`Replicator.run`."""
        if graphs.has_graph_nodes(args):
            return self._run_graph(fn, args, donate_argnums, replica_rngs)
        step, meta, flat = self.prepare(fn, args, donate_argnums)
        if step is None:  # NNX objects nested deeper in the arguments
            return self._run_graph(fn, args, donate_argnums, replica_rngs)
        out = self._in_flight.dispatch(step, *flat)
        for i, kind in meta["remember"]:  # outputs whose role a later call must know
            remember(out[i], kind)
        if meta["grows"]:
            self.roles.check_growth(meta["grows"], flat, args)
        return jax.tree.unflatten(meta["tree"], out)

    def lower(self, fn: Callable, args: tuple, donate_argnums) -> jax.stages.Lowered:
        """`Replicator.lower`."""
        step, _, flat = self.prepare(fn, args, donate_argnums)
        if step is None or graphs.has_graph_nodes(args):  # the program on the objects' state
            call = graphs.split_call(args)
            donate = graphs.donated_positions(call.layout, donate_argnums)
            return self.lower(self._graph_fn(fn, call, True), call.args, donate)
        return step.lower(*flat)

    def _run_graph(self, fn, args, donate_argnums, replica_rngs) -> PyTree:
        call = graphs.split_call(args)
        pure = self._graph_fn(fn, call, replica_rngs)
        donate = graphs.donated_positions(call.layout, donate_argnums)
        program = lambda *pure_args: self.run(pure, pure_args, donate, True)
        out, new_state = graphs.call_program(program, call, self._device_set, self.roles.axis_name)
        graphs.write_back(call, new_state)
        return out

    def _graph_fn(self, fn, call: graphs.SplitCall, replica_rngs: bool) -> Callable:
        key = (fn, call.layout, replica_rngs)
        pure = self._graph_fns.get(key)
        if pure is None:  # checked before the first trace; later calls, if they fail
            graphs.check_placement(call, self._device_set)
            pure = self._graph_fns[key] = graphs.make_pure(
                fn, call.layout, replica_rngs=replica_rngs
            )
        return pure

    def prepare(self, fn: Callable, args: tuple, donate_argnums: Sequence[int]):
        """The cached program for ``fn`` on ``args``, its metadata and the flat arguments;
        ``(None, None, flat)`` where NNX objects sit below the top of ``args``."""
        roles = self.roles
        flat, treedef = jax.tree.flatten(args)
        row_axis = self.groups.axis_of(args, treedef)  # DiLoCo's, from its states
        if row_axis is not None:  # their parameters and inner state: one row per index
            args = self.groups.place(args, row_axis)
            flat, treedef = jax.tree.flatten(args)
        kinds = roles.kinds(flat, args)
        if kinds is None:  # rp.PerReplica leaves: placed one row per replica first
            args = roles.place_marked(args)
            flat, treedef = jax.tree.flatten(args)
            kinds = roles.kinds(flat, args)
        donate = tuple(sorted(donate_argnums))
        # Where mirrored inputs sit on "tensor": their outputs are pinned there too.
        placed = (
            tuple(getattr(x, "sharding", None) if k is Kind.MIRRORED else None
                  for x, k in zip(flat, kinds))
            if self.tensor_parallel else None
        )  # fmt: skip
        key = (fn, treedef, kinds, donate, placed)
        entry = self.cache.get(key)
        if entry is None and graphs.contains_graph_nodes(args):
            entry = self.cache[key] = (None, None)  # `run` splits the NNX objects out
        if entry is None:
            meta: dict[str, Any] = {}
            step = jax.jit(
                _Program(self, fn, treedef, kinds, meta, placed, row_axis).as_function(),
                donate_argnums=placement.leaf_positions(args, donate),
                compiler_options=self._compiler_options,
            )
            entry = self.cache[key] = (step, meta)
        return entry[0], entry[1], flat

    def manual_axes(self) -> set[str]:
        """The axes run's ``shard_map`` is manual over.

        The replica axes only, so that "tensor" stays compiler-partitioned. All of
        them (each replica's tensor devices compute alike) without a tensor axis,
        and on CPU in bf16/fp16, where XLA:CPU 0.10 aborts compiling the partly
        manual program's low-precision all-reduces.
        """
        mesh, num_replicas = self.roles.mesh, self.roles.num_replicas
        low_precision = self.precision.compute_dtype != jnp.float32
        cpu_low = mesh.devices.flat[0].platform == "cpu" and low_precision
        # With one replica, XLA's partitioner cannot keep a manual subgroup of size 1
        # (its collectives fail a RET_CHECK): then the tensor devices compute alike.
        partial = self.tensor_parallel and not cpu_low and num_replicas > 1
        if self.tensor_parallel and num_replicas == 1:
            warnings.warn(
                "run on a mesh of one replica: the step runs whole on each of the "
                f"{mesh.shape['tensor']} tensor devices (exact, no tensor parallelism). "
                "For tensor parallelism with one replica use repl.compile "
                "(step_path='compile' in the trainer), or give data or fsdp more devices.",
                stacklevel=6,
            )
        # A pipeline's stages run manual too (`rp.pipeline` passes activations with
        # ppermute over "stage"); parameters reach each stage whole.
        if not partial:
            return set(mesh.axis_names)
        return set(DATA_AXES) | ({"stage"} & set(mesh.axis_names))


class _Program:
    """One program of `ReplicaPrograms`: ``fn`` on every replica for one layout of
    arguments (``kinds``); fills ``meta`` (output tree, roles to remember, mirrored
    inputs that grew) on its first trace. ``row_axis``: the axis DiLoCo's replica groups
    span, each holding one row of their values (`replicator.parallel.groups`), or None."""

    def __init__(
        self, programs: ReplicaPrograms, fn, treedef, kinds: tuple, meta: dict, placed, row_axis
    ):
        roles = programs.roles
        self.fn, self.treedef, self.kinds, self.meta, self.placed = fn, treedef, kinds, meta, placed
        self.roles, self.axes, self.row_axis = roles, roles.axis_name, row_axis
        self.policy = programs.precision
        self.ctx = ReplicaContext(roles.num_replicas, self.axes)
        self.shardings = [k if isinstance(k, NamedSharding) else None for k in kinds]
        # Key paths of the leaves: the wrapped optimizer pairs gradients with parameters.
        self.paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(
            jax.tree.unflatten(treedef, range(len(kinds))))[0]]  # fmt: skip
        self.in_specs = tuple(placement.role_specs(k, self.axes, row_axis)[0] for k in kinds)
        self.manual = programs.manual_axes()

    def as_function(self) -> Callable:
        def run_all_replicas(*flat):
            return self(*flat)

        # Named after the step in compile logs, profiles and HLO dumps: jit_run_<fn>.
        run_all_replicas.__name__ = f"run_{getattr(self.fn, '__name__', 'step')}"
        return run_all_replicas

    def shard_map(self, body: Callable, out_specs) -> Callable:
        return jax.shard_map(
            body, mesh=self.roles.mesh, in_specs=self.in_specs, out_specs=out_specs,
            axis_names=self.manual, check_vma=True,
        )  # fmt: skip

    def call(self, *flat, whole=False):
        """The step on one replica's arguments: its output leaves, their tree, their
        roles, and for sharded outputs the slice they were gathered from."""
        axes, row_axis = self.axes, self.row_axis
        rows = [x[0] if k in ROWS else x for x, k in zip(flat, self.kinds)]
        rows, trace = zero.gather_inputs(
            rows, [None] * len(rows) if whole else self.shardings, axes, self.paths
        )
        name = getattr(self.fn, "__name__", "step")
        with (
            replica_context(self.ctx, name),
            zero.tracing(trace),
            expect_policy(self.policy, self.fn),
        ):
            out = self.fn(*jax.tree.unflatten(self.treedef, rows))
            # How each output leaves: mirrored, stacked per replica (or one row per index
            # of DiLoCo's axis), or sharded like the sharded input it stands for.
            roles = []
            for path, x in jax.tree_util.tree_flatten_with_path(out)[0]:
                varying = varying_axes(x, axes)
                sharded = zero.output_sharding(x, varying, path)
                if varying and varying == (row_axis,):  # differs between DiLoCo's replica groups
                    sharded = Kind.PER_GROUP
                roles.append(sharded or (Kind.PER_REPLICA if varying else Kind.MIRRORED))
            leaves, tree = jax.tree.flatten(out)
            # A sharded output's slice: the one it was gathered from, if it was.
            pieces = [
                zero.slice_for(x, zero.manual_spec(role, axes))
                if isinstance(role, NamedSharding) else None
                for x, role in zip(leaves, roles)
            ]  # fmt: skip
        return leaves, tree, roles, pieces

    def __call__(self, *flat):
        try:  # first, how each output leaves decides the out_specs
            tree, roles = placement.output_roles(
                self.shard_map, lambda *f: self.call(*f)[1:3], flat
            )
        except (AssertionError, NameError, ValueError) as e:
            self._raise_for_axis_names(e, flat)
            raise
        out_specs = tuple(placement.role_specs(r, self.axes, self.row_axis)[1] for r in roles)
        self._describe(tree, roles)
        out = self.shard_map(functools.partial(self._body, roles), out_specs)(*flat)
        self._find_growth(flat, out)
        return tuple(
            jax.lax.with_sharding_constraint(x, role) if isinstance(role, NamedSharding)
            else self._mirrored_layout(x, flat) if role is Kind.MIRRORED
            else x
            for x, role in zip(out, roles)
        )  # fmt: skip

    def _body(self, roles: list, *flat) -> tuple:
        axes = self.axes
        leaves, _, _, pieces = self.call(*flat)
        out = []
        for x, role, piece in zip(leaves, roles, pieces):
            if role is Kind.PER_REPLICA:
                x = vary(jnp.asarray(x), axes)[None]
            elif role is Kind.PER_GROUP:
                x = x[None]
            elif piece is not None:
                x = piece
            elif role is not Kind.MIRRORED and not varying_axes(x, axes):  # whole: keep a slice
                x = zero.local_slice(x, zero.manual_spec(role, axes))
            out.append(x)
        return tuple(out)

    def _describe(self, tree, roles: list) -> None:
        self.meta["tree"] = tree
        # Outputs a later call must tell apart: per-replica values, DiLoCo groups' rows,
        # and parameters sharded like a batch (remembered as parameters).
        self.meta["remember"] = [
            (i, role) if isinstance(role, Kind) else (i, Kind.SHARDED)
            for i, role in enumerate(roles)
            if role is Kind.PER_REPLICA or role is Kind.PER_GROUP
            or (isinstance(role, NamedSharding) and self.roles.layout(role) is placement.SPLIT)
        ]  # fmt: skip

    def _find_growth(self, flat: tuple, out: tuple) -> None:
        """Mirrored inputs of one row per replica that came back one axis longer
        (checked per call, where run can see how the input was placed)."""
        n = self.roles.num_replicas
        stacked = {out[i].shape for i, kind in self.meta["remember"] if kind is Kind.PER_REPLICA}
        self.meta["grows"] = [
            i
            for i, (x, kind) in enumerate(zip(flat, self.kinds))
            if kind is Kind.MIRRORED and x.shape[:1] == (n,) and (n, *x.shape) in stacked
        ]

    def _mirrored_layout(self, x: jax.Array, flat: tuple) -> jax.Array:
        """A mirrored output, pinned where the compiler would choose (over ``tensor``): as
        the mirrored input of its shape and dtype was (its old value), else replicated."""
        if self.placed is None:
            return x
        for arg, where in zip(flat, self.placed):
            if isinstance(where, NamedSharding) and (arg.shape, arg.dtype) == (x.shape, x.dtype):
                return jax.lax.with_sharding_constraint(x, where)
        return jax.lax.with_sharding_constraint(x, self.roles.mirrored_sharding)

    def _raise_for_axis_names(self, error: Exception, flat) -> None:
        """Turns a collective over an axis that is not the replicas' into an `AxisNameError`.

        Inside ``shard_map`` such a collective fails with a bare assertion; traced
        again outside it, with the replica axes bound, it names the axis.
        """
        if isinstance(error, AxisNameError):
            raise error
        n, local = self.roles.num_replicas, []
        for x, kind in zip(flat, self.kinds):
            shape = x.shape
            if kind is Kind.BATCH:
                shape = (shape[0] // n, *shape[1:])
            elif kind in ROWS:
                shape = shape[1:]
            local.append(jax.ShapeDtypeStruct(shape, x.dtype))
        one_replica = self.roles.one_replica_axes
        try:  # sharded arguments given whole (their global shape)
            whole = bind_axes(lambda *xs: self.call(*xs, whole=True)[0], one_replica)
            jax.eval_shape(whole, *local)
        except NameError as e:
            name = unbound_axis(e)
            if name is not None and name not in one_replica:
                raise axis_error(name, "run", self.axes) from error
        except Exception:  # noqa: BLE001  (only a diagnosis; the original error stands)
            pass
