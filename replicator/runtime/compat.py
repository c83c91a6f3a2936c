"""The one place replicator reaches into private parts of JAX, Orbax, gcsfs and Python.

Each function wraps an internal that has no public equivalent (yet); an
upgrade that changes one breaks it here, and tests/test_compat.py fails loudly
naming it, instead of a run failing somewhere deep inside. Checked on JAX
0.10.2 (Python 3.11) and 0.11.2 (Python 3.12), Orbax 0.12; where a function
names another version, on that one.
"""

from __future__ import annotations

from collections.abc import Callable
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


def varying_manual_axes(x: Any) -> frozenset[str]:
    """The manual mesh axes ``x`` varies over, as ``jax.shard_map``'s ``check_vma`` types
    it (empty outside one, and for a value the same on every device along them).

    ``jax.typeof(x).manual_axis_type.varying``: a field of the abstract values of
    ``jax._src.core`` (`jax.sharding.ManualAxisType` is public, the field that holds
    it is not; JAX 0.10.2 has no public ``.vma``). ``x``: an array, a tracer, a Python
    scalar or a ``jax.ShapeDtypeStruct`` (read as it is: ``jax.typeof`` of one made
    under other manual axes than the caller's fails an assertion).
    """
    import jax

    if isinstance(x, jax.ShapeDtypeStruct):
        kind = x.manual_axis_type  # None where it was made outside any shard_map
    else:
        kind = jax.typeof(x).manual_axis_type
    return frozenset(() if kind is None else kind.varying)


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


def orbax_json_write(handler: Any) -> Callable[[Any, Any], Any]:
    """The coroutine function with which Orbax's ``JsonCheckpointHandler`` writes an
    item, ``write(item, directory)`` (its private ``_save_fn``; on the primary host
    only), bound to ``handler`` (an instance of it or of a subclass): a subclass's
    ``async_save`` schedules it when it chooses. Checked on Orbax 0.12.8."""
    import functools

    import orbax.checkpoint as ocp

    return functools.partial(ocp.JsonCheckpointHandler._save_fn, handler)


def gcsfs_request_without_retries() -> Callable[..., Any] | None:
    """``GCSFileSystem._request`` as gcsfs wrote it, under the decorator that retries it
    (6 tries in about 30 s): an ``async`` function ``(fs, method, path, *args,
    **kwargs)`` trying once, for a subclass that retries its own way; None where the
    decorator no longer exposes it (``__wrapped__``). Checked on gcsfs 2026.10.1."""
    import gcsfs

    return getattr(gcsfs.GCSFileSystem._request, "__wrapped__", None)


def gcs_endpoint(fs: Any) -> str:
    """The URL a ``gcsfs.GCSFileSystem`` sends its requests to (``https://storage.googleapis.com``,
    or ``STORAGE_EMULATOR_HOST``'s server), its private ``_location``: for a request
    of the JSON API that gcsfs has no method for. Checked on gcsfs 2026.10.1."""
    return fs._location


def at_thread_shutdown(fn: Callable[..., Any], *args: Any) -> None:
    """Runs ``fn(*args)`` as Python shuts down, before non-daemon threads are joined
    and before ``atexit`` hooks: while ``concurrent.futures`` pools (which Orbax's
    writers and gcsfs's uploads use) still take work, which they refuse once their
    own shutdown hook, registered the same way, has run. CPython's private
    ``threading._register_atexit`` (3.9 onward; hooks run in reverse order of
    registration). Checked on Python 3.11 and 3.12."""
    import threading

    threading._register_atexit(fn, *args)


def splash_backward(kernel: Any, q, k, v, segment_ids, out, lse, d_out) -> tuple[Any, Any, Any]:
    """Splash attention's backward kernels (``dq``, ``dkv``) for ``kernel`` (one
    ``make_splash_mha``/``make_splash_mqa`` kernel, called on one example), given the
    output ``out`` and log-sum-exp ``lse`` to differentiate against: ``(dq, dk, dv)``.

    The public kernel's VJP uses the residuals of its own forward; attention split into
    blocks (a ring, gathered keys) differentiates each block against the output and
    log-sum-exp of all of them, which only the private ``_splash_attention_bwd`` of
    ``splash_attention_kernel`` takes. Checked on JAX 0.10.2.
    """
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk

    def collapsed(info):  # as the public kernel's jitted entry passes its mask infos on
        blocks = None if info is None else info.partial_mask_blocks
        if blocks is None:
            return info
        return info._replace(partial_mask_blocks=blocks.reshape(-1, *blocks.shape[-2:]))

    kw = kernel.kwargs
    residuals = (
        q, k, v, segment_ids, None, out, lse,
        collapsed(kernel.dq_mask_info), collapsed(kernel.dkv_mask_info),
    )  # fmt: skip
    grads = sk._splash_attention_bwd(
        False, kw["mask_value"], kw["is_mqa"], kw["block_sizes"], None, kw["mask_function"],
        kw["attn_logits_soft_cap"], kw["interpret"], residuals, d_out,
    )  # fmt: skip
    return grads[3], grads[4], grads[5]
