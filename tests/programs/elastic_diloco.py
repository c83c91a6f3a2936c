"""Elastic DiLoCo on replicator's public API: one island per process, islands may die.

Each process is an island: it trains a small MLP on its own synthetic data on
its own devices (data parallelism inside the island, ``repl.run``) with Adam,
and every INNER_STEPS steps `rp.diloco.ElasticIslands.sync` averages the outer
gradients of the islands still alive and applies the outer Nesterov step. Each
survivor writes its final parameters to OUT/island<k>.npz.

    python -m replicator launch local --processes 3 --devices-per-process 2 -- \\
        python tests/programs/elastic_diloco.py OUT [--die-at-step 7 --die-island 2]

``--die-at-step S --die-island K``: island K kills itself (SIGKILL) right after
step S. ``--die-in-sync R``: island K dies inside sync round R, after publishing
its outer gradient, before the membership barrier. ``--hang-in-sync R``: island
K never reaches sync round R (alive, silent), so the others' sync times out.

``--reference ISLANDS`` runs every island in this one process, in lockstep,
dropping island K from the syncs after step S: what the elastic run must equal.
"""

import argparse
import os
import signal
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import replicator as rp
from replicator.runtime import elastic

INNER_STEPS, STEPS, BATCH = 3, 12, 16
FEATURES, HIDDEN = 8, 16


def init_params(key):
    k1, k2 = jax.random.split(key)
    return {
        "w1": jax.random.normal(k1, (FEATURES, HIDDEN)) / np.sqrt(FEATURES),
        "b1": jnp.zeros(HIDDEN),
        "w2": jax.random.normal(k2, (HIDDEN, 1)) / np.sqrt(HIDDEN),
    }


def batch_of(island, step):
    """Island ``island``'s batch at ``step``: its own data (a seeded generator)."""
    rng = np.random.default_rng(1000 * island + step)
    x = rng.normal(size=(BATCH, FEATURES)).astype(np.float32)
    y = np.sin(x.sum(axis=1, keepdims=True)).astype(np.float32)
    return {"x": x, "y": y}


def make_island(policy):
    """A Replicator over this process's devices, the wrapped optimizer and a step."""
    repl = rp.Replicator(devices=jax.local_devices())
    tx = repl.wrap_optimizer(optax.adam(1e-2), sync=policy)

    def loss_fn(params, batch):
        h = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
        return rp.compute_average_loss(((h @ params["w2"] - batch["y"]) ** 2)[:, 0])

    def step(state, batch):
        _, grads = state.value_and_grad(loss_fn, batch)
        return state.apply_gradients(grads, tx)

    state = repl.replicate(rp.TrainState.create(init_params(jax.random.key(0)), tx,
                                                jax.random.key(0)))  # fmt: skip
    return repl, step, state


def save(out, island, state):
    leaves = jax.tree.leaves(jax.device_get((state.params, state.opt_state.outer_params)))
    np.savez(os.path.join(out, f"island{island}.npz"), *leaves)


def elastic_run(args, policy):
    rp.initialize(recoverable=True, heartbeat_timeout_s=args.heartbeat)
    island = jax.process_index()
    islands = rp.diloco.ElasticIslands(policy, timeout_s=args.timeout)
    repl, step, state = make_island(policy)
    victim = island == args.die_island
    if victim and args.die_in_sync is not None:
        # Dies inside the sync: after publishing its outer gradient, at the membership
        # barrier that would have let the others read it.
        live = islands.group.live

        def dying_live(deadline=None):
            if islands.group.rounds == args.die_in_sync:
                os.kill(os.getpid(), signal.SIGKILL)
            return live(deadline)

        islands.group.live = dying_live
    if victim and args.hang_in_sync is not None:
        mean = islands.group.mean

        def stuck_mean(array):  # alive, but never reaches the sync
            if islands.group.rounds == args.hang_in_sync:
                time.sleep(3600)
            return mean(array)

        islands.group.mean = stuck_mean
    try:
        for i in range(1, STEPS + 1):
            state = repl.run(step, state, repl.shard_batch(batch_of(island, i)))
            if victim and i == args.die_at_step:
                os.kill(os.getpid(), signal.SIGKILL)
            if i % INNER_STEPS == 0:
                state = islands.sync(state)
    except elastic.SyncTimeout as e:
        print(f"island {island}: {e}", file=sys.stderr, flush=True)
        sys.exit(elastic.EXIT_SYNC_TIMEOUT)
    save(args.out, island, state)
    print(f"island {island} finished with islands {list(islands.members)}", flush=True)
    islands.close()


def reference_run(args, policy):
    """Every island in this process, in lockstep; the syncs average the islands alive."""
    runs = [make_island(policy) for _ in range(args.reference)]
    states = [state for _, _, state in runs]
    dead = set()
    for i in range(1, STEPS + 1):
        for k, (repl, step, _) in enumerate(runs):
            if k not in dead:
                states[k] = repl.run(step, states[k], repl.shard_batch(batch_of(k, i)))
        if i == args.die_at_step:
            dead.add(args.die_island)
        if i % INNER_STEPS == 0:
            alive = [k for k in range(len(runs)) if k not in dead]
            mean = elastic.combine([rp.diloco.island_delta(states[k]) for k in alive])
            for k in alive:
                states[k] = rp.diloco.apply_mean_delta(policy, states[k], mean)
    for k in range(len(runs)):
        if k not in dead:
            save(args.out, k, states[k])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--die-island", type=int, default=-1)
    parser.add_argument("--die-at-step", type=int, default=None)
    parser.add_argument("--die-in-sync", type=int, default=None)
    parser.add_argument("--hang-in-sync", type=int, default=None)
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--heartbeat", type=int, default=6)  # loaded CI machines: not 3
    parser.add_argument("--reference", type=int, default=0)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    policy = rp.DiLoCo(inner_steps=INNER_STEPS, elastic=True)
    if args.reference:
        reference_run(args, policy)
    else:
        elastic_run(args, policy)


if __name__ == "__main__":
    main()
