"""A custom training loop on replicator's public API, for one process or several.

Trains a small MLP classifier for 10 steps with SGD, then again with Adam, on a
synthetic global batch drawn the same on every process; process 0 writes the
final parameters and the per-step losses to OUT as JSON.

    python tests/programs/custom_loop.py OUT
    python -m replicator launch local --processes 2 --devices-per-process 4 -- \\
        python tests/programs/custom_loop.py OUT

The two runs write the same numbers (tests/test_multiprocess.py).
"""

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

import replicator as rp

GLOBAL_BATCH = 32
NUM_STEPS = 10
FEATURES, HIDDEN, CLASSES = 16, 32, 4


def init_mlp(key):
    k1, k2 = jax.random.split(key)
    return {
        "w1": jax.random.normal(k1, (FEATURES, HIDDEN)) / np.sqrt(FEATURES),
        "b1": jnp.zeros(HIDDEN),
        "w2": jax.random.normal(k2, (HIDDEN, CLASSES)) / np.sqrt(HIDDEN),
        "b2": jnp.zeros(CLASSES),
    }


def mlp(params, x):
    h = jax.nn.relu(x @ params["w1"] + params["b1"])
    return h @ params["w2"] + params["b2"]


def global_batch(step):
    """The step's whole batch, the same on every process (a seeded generator)."""
    rng = np.random.default_rng(step)
    x = rng.normal(size=(GLOBAL_BATCH, FEATURES)).astype(np.float32)
    teacher = np.random.default_rng(1234).normal(size=(FEATURES, CLASSES))
    return {"x": x, "y": np.argmax(x @ teacher, axis=1).astype(np.int32)}


def train(repl, tx):
    tx = repl.wrap_optimizer(tx)

    def train_step(params, opt_state, batch):
        def loss_fn(params):
            logits = mlp(params, batch["x"])
            per_example = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
            return rp.compute_average_loss(per_example)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    params = init_mlp(jax.random.key(0))
    params, opt_state = repl.replicate((params, tx.init(params)))
    rows = repl.process_rows(GLOBAL_BATCH)  # this process's rows of every global batch
    losses = []
    for step in range(NUM_STEPS):
        host_batch = {k: v[rows] for k, v in global_batch(step).items()}
        batch = repl.shard_batch(host_batch)
        params, opt_state, loss = repl.run(train_step, params, opt_state, batch)
        losses.append(repl.reduce(rp.ReduceOp.SUM, loss))  # the global batch's mean loss
    return params, [float(x) for x in losses], rows


def main(out_path):
    rp.initialize()  # joins the other processes, if any; before anything uses JAX
    repl = rp.Replicator()
    results = {}
    for name, tx in (("sgd", optax.sgd(0.5)), ("adam", optax.adam(1e-2))):
        params, losses, rows = train(repl, tx)
        results[name] = {
            "params": {k: np.asarray(v).tolist() for k, v in params.items()},
            "losses": losses,
        }
    print(
        f"process {jax.process_index()} of {jax.process_count()} fed rows "
        f"{rows.start}:{rows.stop} of {GLOBAL_BATCH}; {repl}",
        flush=True,
    )
    if jax.process_index() == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1])
