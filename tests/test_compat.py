"""The private JAX that replicator uses, all in replicator/runtime/compat.py, still works.

A JAX upgrade that moves or changes one of these internals fails here, by name,
rather than deep inside a run.
"""

import jax

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
