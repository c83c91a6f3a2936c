"""The private JAX that replicator uses, all in replicator/runtime/compat.py, still works.

A JAX upgrade that moves or changes one of these internals fails here, by name,
rather than deep inside a run.
"""

import jax
import numpy as np

from replicator.runtime import compat


def test_cluster_detection_runs_and_finds_no_cluster_here(monkeypatch):
    for name in ("SLURM_JOB_ID", "TPU_WORKER_HOSTNAMES", "OMPI_MCA_orte_hnp_uri"):
        monkeypatch.delenv(name, raising=False)
    assert compat.detect_cluster(None, None) is None


def test_backend_state_and_distributed_globals():
    jax.devices()
    assert compat.backends_are_initialized() is True
    assert compat.coordination_client() is None  # one process: no coordination service
    assert compat.coordinator_address() is None


def test_max_pool_primitives_and_their_cpu_lowerings():
    pool, pool_grad = compat.max_pool_primitives()
    assert (pool.name, pool_grad.name) == ("reduce_window_max", "select_and_scatter_add")
    for primitive in (pool, pool_grad):
        assert callable(compat.lowering_rule(primitive, "cpu"))


def test_leading_sharding_of_typed_keys_matches_their_sharding():
    import replicator as rp

    repl = rp.Replicator()
    keys = jax.device_put(jax.random.split(jax.random.key(0), 8), repl.batch_sharding)
    assert compat.leading_sharding(keys).spec[0] == keys.sharding.spec[0]
    mirrored = repl.replicate(jax.random.key(1))
    assert compat.leading_sharding(mirrored).is_fully_replicated
    assert compat.leading_sharding(3.0) is None


def test_orbax_array_handler_without_replica_parallel():
    import orbax.checkpoint as ocp

    handler = compat.array_handler_without_replica_parallel()
    assert isinstance(handler, ocp.type_handlers.ArrayHandler)


def test_varying_manual_axes_follow_shard_maps_types():
    from jax.sharding import AxisType
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((2, 4), ("data", "stage"), axis_types=(AxisType.Auto,) * 2)
    seen = {}

    def body(x):
        shape = jax.eval_shape(lambda y: y * 2, x)  # a ShapeDtypeStruct keeps the type
        seen.update(split=compat.varying_manual_axes(x), shape=compat.varying_manual_axes(shape))
        seen["whole"] = compat.varying_manual_axes(jax.numpy.ones(3))
        return x

    program = jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data"))
    jax.jit(program)(jax.numpy.ones(8))
    assert seen == {"split": {"data"}, "shape": {"data"}, "whole": frozenset()}
    assert compat.varying_manual_axes(jax.numpy.ones(3)) == frozenset()  # outside shard_map
    assert compat.varying_manual_axes(1.0) == frozenset()
    assert compat.varying_manual_axes(jax.ShapeDtypeStruct((3,), "float32")) == frozenset()


def test_orbax_json_write_writes_what_the_handler_restores(tmp_path):
    import asyncio

    import orbax.checkpoint as ocp
    from etils import epath

    handler = ocp.JsonCheckpointHandler()
    asyncio.run(compat.orbax_json_write(handler)({"step": 7}, epath.Path(tmp_path)))
    assert handler.restore(epath.Path(tmp_path)) == {"step": 7}


def test_gcsfs_request_without_retries_and_endpoint(monkeypatch):
    import inspect

    import gcsfs

    one_try = compat.gcsfs_request_without_retries()
    assert one_try is not None, "gcsfs no longer exposes its request without retries"
    assert inspect.iscoroutinefunction(one_try)
    assert one_try is not gcsfs.GCSFileSystem._request  # the retrying wrapper is another
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "http://127.0.0.1:9")
    fs = gcsfs.GCSFileSystem(token="anon", skip_instance_cache=True)
    assert compat.gcs_endpoint(fs) == "http://127.0.0.1:9"


def test_thread_shutdown_hooks_run_before_atexit_hooks():
    import subprocess
    import sys

    program = (
        "import atexit\n"
        "from replicator.runtime import compat\n"
        "atexit.register(print, 'atexit')\n"
        "compat.at_thread_shutdown(print, 'thread shutdown')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.splitlines() == ["thread shutdown", "atexit"]


def test_splash_backward_equals_the_public_kernels_own_vjp():
    """`compat.splash_backward` (splash's private ``_splash_attention_bwd``) gives, for one
    block against the kernel's own output and log-sum-exp, the gradients of the public
    kernel's VJP (Pallas's interpreter on CPU)."""
    from jax.experimental.pallas.ops.tpu import splash_attention as sk

    heads, length, dim = 1, 128, 128
    sizes = sk.BlockSizes(*(128,) * 8)
    mask = sk.MultiHeadMask([sk.CausalMask((length, length))])
    make = lambda residuals: sk.make_splash_mha(
        mask, head_shards=1, q_seq_shards=1, block_sizes=sizes, save_residuals=residuals,
        interpret=True,
    )  # fmt: skip
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, d_out = (jax.random.normal(key, (heads, length, dim)) for key in keys)
    out, (lse,) = make(True)(q, k, v)
    want = jax.vjp(make(False), q, k, v)[1](d_out)
    got = compat.splash_backward(make(False), q, k, v, None, out, lse, d_out)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)
