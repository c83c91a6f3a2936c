"""`Replicator.compile`'s step: ``jax.jit`` over the mesh, in the global view.

The global view is one replica holding the whole batch. A step without
collectives compiles exactly as ``jax.jit(fn)``; one that names the replica
axes (``psum``, ``axis_index``, ``nn.BatchNorm(axis_name=...)``) fails that
trace with an unbound axis, and is traced again with those axes bound as axes
of size 1 (`bind_axes`), so the step written for `run` computes the same
numbers here. `Compiled` is the callable `compile` returns (like equinox's
``_JitWrapper``): the fast path calls the jitted function, NNX objects go through
their state (`replicator.spmd.graphs`), DiLoCo train states through their groups'
program (`replicator.parallel.groups`; found while tracing, like nested NNX objects).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from replicator.parallel.activations import activation_rules
from replicator.parallel.groups import GroupStates, ReplicaGroups
from replicator.parallel.placement import Roles
from replicator.spmd import graphs as graphs
from replicator.spmd.context import AxisNameError, global_view
from replicator.spmd.dispatch import StepsInFlight
from replicator.step.precision import Policy, expect_policy


class GlobalView:
    """What every step `compile` makes on one mesh shares."""

    def __init__(
        self,
        roles: Roles,
        precision: Policy,
        in_flight: StepsInFlight,
        groups: ReplicaGroups,
        compiler_options: dict | None,
        rules: Sequence[Any] | None = None,
    ):
        self.roles, self.precision, self.in_flight, self.groups = (
            roles, precision, in_flight, groups
        )  # fmt: skip
        self.rules = rules  # the activation rules `activations.constrain` reads in a step
        self.compiler_options = compiler_options
        self.device_set = set(roles.mesh.devices.flat)  # what NNX objects' arrays must sit on


class Compiled:
    """A step `Replicator.compile` made: call it as ``fn``; ``lower(*args)`` lowers it.

    Attributes:
      jitted: the `jax.jit` object in use (rebound once if the step names the
        replica axes).
    """

    def __init__(
        self,
        view: GlobalView,
        fn: Callable,
        *,
        donate_argnums: int | Sequence[int] = (),
        in_shardings: Any = None,
        out_shardings: Any = None,
        static_argnums: int | Sequence[int] = (),
        compiler_options: dict[str, Any] | None = None,
    ):
        self._view, self._fn, self._groups = view, fn, view.groups
        self._donate, self._options = donate_argnums, compiler_options
        self._plain_jit = not (
            in_shardings is not None or out_shardings is not None or static_argnums
        )
        self._static_argnums = static_argnums
        self._jit = functools.partial(
            jax.jit,
            donate_argnums=donate_argnums,
            in_shardings=in_shardings,
            out_shardings=out_shardings,
            static_argnums=static_argnums,
            compiler_options={**(view.compiler_options or {}), **(compiler_options or {})} or None,
        )
        # NNX objects go through _graph_step, DiLoCo states with groups through _groups_step.
        self._refused = graphs.refuse_graph_nodes(view.groups.refuse(fn))
        self._plain = self.jitted = self._jit(self._global_step(self._refused))
        self._in_flight, self._bound = view.in_flight, view.in_flight.bound
        self._graph_programs: dict[Any, Callable] = {}
        self._graph_trees: set = set()  # argument structures holding NNX objects below the top
        self._groups_program: Callable | None = None  # DiLoCo's, made on use
        self._groups_trees: set = set()  # argument structures holding DiLoCo's replica groups
        self.__name__ = getattr(fn, "__name__", "step")

    def __call__(self, *args, **kwargs):
        # A step given DiLoCo train states with groups on the mesh runs on each of
        # them: found when such a structure is first traced, looked up after.
        if self._groups_trees and jax.tree.structure(args) in self._groups_trees:
            return self._groups_step()(*args, **kwargs)
        if graphs.has_graph_nodes(args) or (  # the second look only once one was seen nested
            self._graph_trees and jax.tree.structure(args) in self._graph_trees
        ):
            return self._graph_step(*args, **kwargs)
        try:  # the fast path: jit's own dispatch, plus the bound where it is needed
            if self._bound:
                return self._in_flight.dispatch(self.jitted, *args, **kwargs)
            return self.jitted(*args, **kwargs)
        except GroupStates:
            self._groups_trees.add(jax.tree.structure(args))
            return self._groups_step()(*args, **kwargs)
        except graphs.NestedGraphNodes:  # found while tracing: split them out from now on
            if kwargs:
                raise TypeError(
                    "repl.compile takes Flax NNX objects as positional arguments."
                ) from None
            self._graph_trees.add(jax.tree.structure(args))
            return self._graph_step(*args, **kwargs)
        except NameError as e:
            # A step without collectives compiles exactly as jax.jit(fn). One that
            # uses the replica axes is traced again with them bound to one replica.
            if not self._bind_replica_axes(e):
                raise
            return self(*args, **kwargs)

    def lower(self, *args, **kwargs) -> jax.stages.Lowered:
        """The program for these arguments, lowered, like `Replicator.lower` for `run`."""
        if graphs.contains_graph_nodes(args):
            call = graphs.split_call(args)  # the program on the objects' state
            return self._graph_program(call).lower(*call.args)
        try:
            return self.jitted.lower(*args, **kwargs)
        except GroupStates:
            return self._groups_step().lower(*args, **kwargs)
        except NameError as e:
            if not self._bind_replica_axes(e):
                raise
            return self.jitted.lower(*args, **kwargs)

    def _global_step(self, fn: Callable) -> Callable:
        view = self._view
        return in_global_view(fn, view.roles.mesh.abstract_mesh, view.precision, view.rules)

    def _bind_replica_axes(self, error: NameError) -> bool:
        """Whether ``error`` means: trace again with the replica axes bound to one
        replica (if so, the step is that program from now on); raises `AxisNameError`
        for an axis that is not theirs."""
        if isinstance(error, AxisNameError):
            return False
        name = unbound_axis(error)
        if name is None:
            return False
        roles = self._view.roles
        if name not in roles.one_replica_axes or self.jitted is not self._plain:
            raise axis_error(name, "compile", roles.axis_name) from error
        self.jitted = self._jit(self._global_step(bind_axes(self._refused, roles.one_replica_axes)))
        return True

    def _groups_step(self) -> Callable:
        if self._groups_program is None:
            if self._static_argnums:
                raise ValueError("repl.compile under DiLoCo takes no static_argnums.")
            positions = _as_positions(self._donate)
            self._groups_program = self._groups.compile(self._fn, positions, self._options)
        return self._groups_program

    def _graph_program(self, call: graphs.SplitCall) -> Callable:
        if not self._plain_jit:
            raise TypeError(
                "repl.compile takes Flax NNX objects as positional arguments, without "
                "in_shardings, out_shardings or static_argnums."
            )
        compiled = self._graph_programs.get(call.layout)
        if compiled is None:  # checked before the first trace; later calls, if they fail
            graphs.check_placement(call, self._view.device_set)
            compiled = self._graph_programs[call.layout] = Compiled(
                self._view,
                graphs.make_pure(self._fn, call.layout),
                donate_argnums=graphs.donated_positions(call.layout, _as_positions(self._donate)),
                compiler_options=self._options,
            )
        return compiled

    def _graph_step(self, *args, **kwargs):
        if kwargs:
            raise TypeError("repl.compile takes Flax NNX objects as positional arguments.")
        call = graphs.split_call(args)
        view = self._view
        out, new_state = graphs.call_program(
            self._graph_program(call), call, view.device_set, view.roles.axis_name
        )
        graphs.write_back(call, new_state)
        return out


def in_global_view(
    fn: Callable,
    mesh: jax.sharding.AbstractMesh,
    policy: Policy | None = None,
    rules: Sequence[Any] | None = None,
) -> Callable:
    """``fn`` traced as a global-view step: with the mesh ambient (bare
    `PartitionSpec`s refer to it) and the Replicator's sharding ``rules`` the ones
    `activations.constrain` applies, only while tracing, never on each call; told
    when the Replicator's ``policy`` goes unused (`expect_policy`)."""

    @functools.wraps(fn)
    def global_step(*args, **kwargs):
        with global_view(), jax.sharding.use_abstract_mesh(mesh), activation_rules(rules):
            if policy is None:
                return fn(*args, **kwargs)
            with expect_policy(policy, fn):
                return fn(*args, **kwargs)

    # Named after the step in compile logs, profiles and HLO dumps: jit_<fn>.
    global_step.__name__ = getattr(
        fn, "__name__", getattr(getattr(fn, "func", None), "__name__", "step")
    )
    return global_step


def bind_axes(fn: Callable, axes: Sequence[str]) -> Callable:
    """``fn`` with each of ``axes`` bound as a named axis of size 1 (one replica).

    A collective over them then acts over that single replica: ``psum`` and
    ``pmean`` return their input, ``axis_index`` is 0, ``all_gather`` adds an axis
    of size 1.
    """

    @functools.wraps(fn)
    def bound(*args, **kwargs):
        # The arguments go through vmap (unmapped) rather than being closed over, so
        # pytrees are rebuilt inside it: Flax NNX checks that its objects belong to
        # the trace level that uses them.
        one = lambda _, *args: fn(*args, **kwargs)
        for name in reversed(axes):
            one = jax.vmap(one, in_axes=(0,) + (None,) * len(args), axis_name=name)
        try:
            out = one(jnp.zeros((1,) * len(axes)), *args)
        except NotImplementedError as e:  # JAX's vmap of all_gather over several axes
            if len(axes) < 2 or "feature request" not in str(e):
                raise
            raise NotImplementedError(
                f"A collective that gathers or scatters over repl.axis_name = {tuple(axes)!r} "
                "(lax.all_gather, psum_scatter, all_to_all) cannot run under repl.compile when "
                "the replicas span several mesh axes: JAX cannot batch it over them. Under "
                "the global view there is one replica, so all_gather(x) is x[None]; or run "
                "the step with repl.run, or use a mesh whose replicas span one axis."
            ) from e
        return jax.tree.map(lambda x: x.reshape(x.shape[len(axes) :]), out)

    return bound


_UNBOUND = re.compile(r"unbound axis name:?\s*'?([^\s.,']+)")


def unbound_axis(error: NameError) -> str | None:
    """The axis named by JAX's "unbound axis name" error, or None for other NameErrors."""
    match = _UNBOUND.search(str(error))
    return match.group(1) if match else None


def axis_error(name: str, path: str, axis_name: tuple[str, ...]) -> AxisNameError:
    """The error for a collective over axis ``name`` under ``repl.{path}``."""
    return AxisNameError(
        f"The step passes axis name {name!r} to a collective (lax.psum, pmean, "
        f"axis_index, all_gather, nn.BatchNorm(axis_name=...)) under repl.{path}, but "
        f"the replicas' axis is repl.axis_name = {axis_name!r}. Pass repl.axis_name "
        "(or rp.get_replica_context().axis_name) instead of a hard-coded name."
    )


def _as_positions(argnums: int | Sequence[int]) -> tuple[int, ...]:
    return (argnums,) if isinstance(argnums, int) else tuple(argnums)
