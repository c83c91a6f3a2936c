"""The two paths over one mesh, built together: `Replicator.run`'s replica programs
(`replicator.spmd.replica_program`) and `Replicator.compile`'s global view
(`replicator.spmd.global_view`).

They share what a `Replicator` holds for its mesh: the roles of its axes
(`replicator.parallel.placement.Roles`), the bound on steps in flight
(`replicator.spmd.dispatch`), the compiler options (`replicator.spmd.cpu`) and
DiLoCo's replica groups (`replicator.parallel.groups`), so that a state trained on
one path goes on, in the same groups and within the same bound, on the other.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax

from replicator.parallel import groups as groups
from replicator.parallel import placement as placement
from replicator.spmd import cpu as cpu
from replicator.spmd import dispatch as dispatch
from replicator.spmd.global_view import GlobalView
from replicator.spmd.replica_program import ReplicaPrograms
from replicator.step.precision import Policy


class Paths(NamedTuple):
    """What `build_paths` builds for one mesh.

    Attributes:
      roles: the roles of the mesh's axes (replicas, batch and mirrored shardings).
      in_flight: the bound on dispatched steps, shared by both paths.
      compiler_options: XLA options every program gets (None: JAX's defaults).
      programs: `run`'s programs.
      global_view: what every step `compile` makes shares.
    """

    roles: placement.Roles
    in_flight: dispatch.StepsInFlight
    compiler_options: dict[str, Any] | None
    programs: ReplicaPrograms
    global_view: GlobalView


def build_paths(
    mesh: jax.sharding.Mesh,
    precision: Policy,
    rules: Sequence[Any] | None = None,
    max_steps_in_flight: int | None = None,
    cpu_defaults: bool = True,
) -> Paths:
    """Both paths over ``mesh``, sharing their state.

    Args:
      mesh: the mesh.
      precision: the precision policy of both paths' steps.
      rules: the sharding rules, for the activations a step under `compile` names.
      max_steps_in_flight: as `Replicator`'s (`replicator.spmd.dispatch.checked_bound`).
      cpu_defaults: on a CPU mesh, `replicator.spmd.cpu.configure`'s compiler options.

    Returns:
      The `Paths`.

    Raises:
      ValueError: a ``max_steps_in_flight`` below 1.
    """
    bound = dispatch.checked_bound(max_steps_in_flight)
    roles = placement.Roles(mesh)
    devices = list(mesh.devices.flat)
    in_flight = dispatch.StepsInFlight(bound, devices)
    options = cpu.configure(devices) if cpu_defaults else None
    # DiLoCo's replica groups: which calls' states train apart (said by the states).
    replica_groups = groups.ReplicaGroups(mesh, in_flight, options)
    programs = ReplicaPrograms(roles, replica_groups, precision, in_flight, options)
    global_view = GlobalView(roles, precision, in_flight, replica_groups, options, rules)
    return Paths(roles, in_flight, options, programs, global_view)
