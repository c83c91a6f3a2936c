"""State kept in host memory between steps: optimizer state offload, MaxText's way.

Adam's two moments are two thirds of a float32 train state, and a step reads
them only once, in the update. `host_shardings` places such leaves in the
accelerator host's pinned memory (``memory_kind="pinned_host"``) between steps;
inside the step, `fetch` brings them into device memory for the update, and the
step's ``out_shardings`` send the new values back. HBM then holds the
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
DEVICE = "device"


def host_shardings(shardings: Any) -> Any:
    """``shardings`` (a pytree of `NamedSharding`) in pinned host memory.

    >>> mesh = jax.sharding.Mesh(jax.devices()[:1], ("data",))
    >>> host_shardings(NamedSharding(mesh, jax.sharding.PartitionSpec())).memory_kind
    'pinned_host'
    """
    return jax.tree.map(lambda s: _with_kind(s, HOST), shardings, is_leaf=_is_sharding)


def fetch(tree: Any, shardings: Any) -> Any:
    """``tree`` moved into device memory, laid out as ``shardings`` (the same
    shardings `host_shardings` was given): call it inside the compiled step, before
    the values are used.

    >>> mesh = jax.sharding.Mesh(jax.devices()[:1], ("data",))
    >>> where = NamedSharding(mesh, jax.sharding.PartitionSpec())
    >>> step = jax.jit(lambda x: fetch(x, where) * 2, out_shardings=host_shardings(where))
    >>> x = jax.device_put(jnp.ones(3), host_shardings(where))
    >>> step(x).sharding.memory_kind, step(x).tolist()
    ('pinned_host', [2.0, 2.0, 2.0])
    """
    device = jax.tree.map(lambda s: _with_kind(s, DEVICE), shardings, is_leaf=_is_sharding)
    return jax.device_put(tree, device)


def _with_kind(sharding: Any, kind: str) -> Any:
    if not isinstance(sharding, NamedSharding):
        raise TypeError(f"offload needs NamedShardings, got {sharding!r}.")
    return sharding.with_memory_kind(kind)


def _is_sharding(x: Any) -> bool:
    return isinstance(x, jax.sharding.Sharding)
