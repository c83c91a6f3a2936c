"""The one place replicator reaches into JAX's (and Orbax's) private modules.

Each function wraps an internal that has no public equivalent (yet); an
upgrade that changes one breaks it here, and tests/test_compat.py fails loudly
naming it, instead of a run failing somewhere deep inside. Checked on JAX
0.10.2 (Python 3.11) and 0.11.2 (Python 3.12), Orbax 0.12.
"""

from __future__ import annotations

from typing import Any


def detect_cluster(
    num_processes: int | None, process_id: int | None
) -> tuple[str, str, int, int] | None:
    """JAX's own cluster detection (SLURM, Cloud TPU VMs, Kubernetes, Open MPI): what
    ``jax.distributed.initialize()`` runs without arguments.

    Returns:
      ``(detector name, coordinator address, num_processes, process_id)``, or None
      when no supported cluster environment is present.
    """
    from jax._src import clusters

    env = next(
        (
            e
            for e in clusters.ClusterEnv._cluster_types
            if not e.opt_in_only_method and e.is_env_present()
        ),
        None,
    )
    if env is None:
        return None
    address, count, index, _ = clusters.ClusterEnv.auto_detect_unset_distributed_params(
        None, num_processes, process_id, None, None, None
    )
    return env.__name__, address, count, index


def backends_are_initialized() -> bool:
    """Whether JAX's backends have started (after which a process cannot join others)."""
    from jax._src import xla_bridge

    return xla_bridge.backends_are_initialized()


def coordination_client() -> Any:
    """JAX's coordination-service client (its key-value store), or None for one process."""
    from jax._src.distributed import global_state

    return global_state.client


def coordinator_address() -> str | None:
    """The coordinator address ``jax.distributed`` was initialised with, if any."""
    from jax._src.distributed import global_state

    return global_state.coordinator_address


def lowering_rule(primitive: Any, platform: str) -> Any:
    """The MLIR lowering rule JAX uses for ``primitive`` on ``platform``."""
    from jax._src.interpreters import mlir as mlir_internal

    entry = mlir_internal._platform_specific_lowerings[platform].get(primitive)
    return (entry or mlir_internal._lowerings[primitive]).rule


def max_pool_primitives() -> tuple[Any, Any]:
    """``(reduce_window_max_p, select_and_scatter_add_p)``: max pooling and its gradient."""
    from jax._src.lax import windowed_reductions

    return windowed_reductions.reduce_window_max_p, windowed_reductions.select_and_scatter_add_p


def leading_sharding(x: Any) -> Any:
    """``x.sharding``, cheaply enough to ask every step for every leaf (None if none).

    A typed PRNG key array computes its sharding in Python (about 10 µs); the
    sharding of its key data (private ``_base_array``) splits the leading axes the
    same way, which is all `Replicator.run` asks about.
    """
    if type(x).__name__ == "PRNGKeyArray":
        return x._base_array.sharding
    return getattr(x, "sharding", None)


def all_gather_invariant(x: Any, axes: tuple[str, ...], dim: int) -> Any:
    """Inside ``jax.shard_map``: ``x``'s slices over ``axes`` concatenated along ``dim``,
    typed replica-invariant (``jax.lax.all_gather`` types its result varying).

    Public as ``jax.lax.all_gather(..., to="invarying")`` where that exists.
    """
    import jax

    try:
        return jax.lax.all_gather(x, axes, axis=dim, tiled=True, to="invarying")
    except (TypeError, ValueError):
        from jax._src.lax import parallel

        return parallel.all_gather_invariant(x, axes, axis=dim, tiled=True)


def array_handler_without_replica_parallel() -> Any:
    """Orbax's handler of ``jax.Array`` leaves with its replica-parallel slicing off
    (costly in one process), keeping the array metadata store of the default
    handler; Orbax's v0 API exposes the store's type only in a private module."""
    import orbax.checkpoint as ocp
    from orbax.checkpoint._src.metadata import array_metadata_store

    return ocp.type_handlers.ArrayHandler(
        use_replica_parallel=False, array_metadata_store=array_metadata_store.Store()
    )


def set_orbax_gcs_retries(retries: dict) -> None:
    """Makes the tensorstore contexts Orbax reads and writes arrays with retry GCS
    requests as ``retries`` says (tensorstore's ``Context.gcs_request_retries``:
    ``max_retries``, ``initial_delay``, ``max_delay``) instead of tensorstore's
    default, 32 tries over about 15 minutes. Orbax builds a fresh context from two
    module-level defaults for every read, write and merge (``get_ts_context``) and
    takes none from its caller."""
    from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils

    for default in (ts_utils._BASE_TS_CONTEXT, ts_utils._DEFAULT_OCDBT_TS_CONTEXT):
        default["gcs_request_retries"] = dict(retries)
