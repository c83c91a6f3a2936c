"""From a step function to one SPMD program: the replica context, `Replicator.run`'s
per-replica program (``jax.shard_map``), `Replicator.compile`'s global view
(``jax.jit``), Flax NNX graphs through both, inputs and the bound on steps in flight."""
