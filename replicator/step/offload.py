"""State kept in host memory between steps: optimizer state offload, MaxText's way.

Adam's two moments are two thirds of a float32 train state, and a step reads
them only once, in the update. `host_shardings` places such leaves in the
accelerator host's pinned memory (``memory_kind="pinned_host"``) between steps;
inside the step, `in_device_memory` (which `rp.TrainState.apply_gradients` calls
on the optimizer state) brings them into device memory for the update,
and the step's ``out_shardings`` send the new values back. HBM then holds the
parameters, the activations and one copy of the moments while they are used,
at the cost of a host round trip per step (PCIe on TPU VMs and GPU hosts),
which XLA overlaps with the backward pass where it can.

For programs compiled over the whole mesh (`Replicator.compile`); the numbers
are those of keeping the state in device memory.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import NamedSharding

HOST = "pinned_host"


def host_shardings(shardings: Any) -> Any:
    """``shardings`` (a pytree of `NamedSharding`) in pinned host memory.

    >>> mesh = jax.sharding.Mesh(jax.devices()[:1], ("data",))
    >>> host_shardings(NamedSharding(mesh, jax.sharding.PartitionSpec())).memory_kind
    'pinned_host'
    """
    return jax.tree.map(lambda s: _with_kind(s, HOST), shardings, is_leaf=_is_sharding)


def in_device_memory(tree: Any) -> Any:
    """``tree`` with the leaves a compiled step received in host memory moved into
    device memory, the others as they are: what `rp.TrainState.apply_gradients` does
    to the optimizer state before the update, so that the moments come into HBM only
    for it (after the backward pass), whatever put them in host memory.

    >>> mesh = jax.sharding.Mesh(jax.devices()[:1], ("data",))
    >>> host = host_shardings(NamedSharding(mesh, jax.sharding.PartitionSpec()))
    >>> step = jax.jit(lambda x: in_device_memory(x) + 1, out_shardings=host)
    >>> step(jax.device_put(jnp.zeros(2), host)).tolist()
    [1.0, 1.0]
    """

    def move(x):
        space = getattr(jax.typeof(x), "memory_space", None)
        return jax.device_put(x, jax.memory.Space.Device) if space == jax.memory.Space.Host else x

    return jax.tree.map(move, tree)


def _with_kind(sharding: Any, kind: str) -> Any:
    if not isinstance(sharding, NamedSharding):
        raise TypeError(f"offload needs NamedShardings, got {sharding!r}.")
    return sharding.with_memory_kind(kind)


def _is_sharding(x: Any) -> bool:
    return isinstance(x, jax.sharding.Sharding)
