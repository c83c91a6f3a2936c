"""The tutorial CNN's train step written four ways, as timed candidates.

All four train the same flax model (conv 32, pool, conv 64, pool, dense 64,
dense 10 on 28x28x1 images) with Adam on the same synthetic global batch, and
return the mean loss, the number of correct predictions and the example count:

* ``jit``: hand-written `jax.jit` with `NamedSharding` (batch split, the rest
  replicated), the global-view program JAX's docs recommend.
* ``pmap``: hand-written `jax.pmap` with a ``pmean`` of the gradients.
* ``replicator_run`` / ``replicator_compile``: the per-replica step written
  once in replicator's style (`rp.compute_average_loss`, the wrapped optimizer,
  `TrainState.apply_gradients`), run by `Replicator.run` and `Replicator.compile`.

Two more hand-written jit variants add TrainState's non-finite guard, as a
per-leaf ``where`` or as one ``lax.cond``, to price it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from trials import Candidate

import replicator as rp
from experiments.classify.model import CNN
from replicator.step.state import TrainState, all_finite

GLOBAL_BATCH = 256
PATHS = ("jit", "pmap", "replicator_run", "replicator_compile")
GUARDED = {"jit, where guard": "where", "jit, cond guard": "cond"}  # hand-written + guard


def make_model(pool: str = "flax") -> nn.Module:
    """The tutorial CNN; ``pool="reshape"`` is the model-side max-pool rewrite."""
    if pool == "reshape":
        return ReshapePoolCNN(num_classes=10, conv_features=(32, 64), dense_features=64)
    return CNN(num_classes=10, conv_features=(32, 64), dense_features=64, padding="VALID")


class ReshapePoolCNN(nn.Module):
    """The same CNN with max pool as reshape + max (the model-side rewrite, for reference)."""

    num_classes: int = 10
    conv_features: Sequence[int] = (32, 64)
    dense_features: int = 64

    @nn.compact
    def __call__(self, images_BxHxWxC: jax.Array) -> jax.Array:
        x = images_BxHxWxC
        for features in self.conv_features:
            x = nn.relu(nn.Conv(features, (3, 3), padding="VALID")(x))
            b, h, w, c = x.shape
            x = x[:, : h // 2 * 2, : w // 2 * 2].reshape(b, h // 2, 2, w // 2, 2, c)
            x = x.max(axis=(2, 4))
        x = x.reshape(x.shape[0], -1)
        x = nn.relu(nn.Dense(self.dense_features)(x))
        return nn.Dense(self.num_classes)(x)


def synthetic_batch(batch_size: int = GLOBAL_BATCH, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "image": rng.random((batch_size, 28, 28, 1), dtype=np.float32),
        "label": rng.integers(0, 10, batch_size).astype(np.int32),
    }


def _loss_and_metrics(model, params, batch, reduce_loss):
    logits = model.apply({"params": params}, batch["image"])
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"])
    correct = jnp.sum(jnp.argmax(logits, -1) == batch["label"])
    return reduce_loss(losses), (correct, jnp.int32(losses.shape[0]))


def _loop(step: Callable, state: list) -> Callable[[int], Any]:
    """``run(k)``: k steps, the state carried in ``state[0]``; returns the last outputs."""

    def run(k: int):
        out = None
        for _ in range(k):
            state[0], out = step(state[0])
        return state[0], out

    return run


def handwritten_jit(
    model, host_batch, tx, params, devices, compiler_options=None, guard=None
) -> Candidate:
    """The hand-written jit step; ``guard`` skips the update on non-finite gradients.

    ``"where"`` selects old or new per leaf (what TrainState.apply_gradients does
    today); ``"cond"`` puts one `lax.cond` around the update.
    """
    mesh = Mesh(np.asarray(devices), ("data",))
    split, mirrored = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
    batch = jax.device_put(host_batch, split)

    def train_step(carry, batch):
        params, opt_state = carry
        (loss, (correct, count)), grads = jax.value_and_grad(
            lambda p: _loss_and_metrics(model, p, batch, jnp.mean), has_aux=True
        )(params)

        def update(params, opt_state):
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        if guard is None:
            carry = update(params, opt_state)
        elif guard == "where":
            finite = all_finite(grads)
            keep = lambda new, old: jnp.where(finite, new, old)
            carry = jax.tree.map(keep, update(params, opt_state), (params, opt_state))
        else:
            carry = jax.lax.cond(all_finite(grads), update, lambda *old: old, params, opt_state)
        return carry, {"loss": loss, "correct": correct, "count": count}

    step = jax.jit(
        train_step,
        donate_argnums=(0,),
        out_shardings=mirrored,
        compiler_options=compiler_options,
    )
    carry = jax.device_put((params, tx.init(params)), mirrored)
    compiled = step.lower(carry, batch).compile()
    info = {
        "flops_per_device": compiled.cost_analysis()["flops"],
        "temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
        "num_devices": len(devices),
    }
    return Candidate(_loop(lambda c: step(c, batch), [carry]), info, hlo=compiled.as_text())


def handwritten_pmap(model, host_batch, tx, params, devices) -> Candidate:
    n = len(devices)
    # A leading device axis, split over the devices (jax.device_put_sharded is gone).
    stacked = NamedSharding(Mesh(np.asarray(devices), ("batch",)), P("batch"))
    per_device = jax.tree.map(lambda x: x.reshape(n, x.shape[0] // n, *x.shape[1:]), host_batch)
    batch = jax.device_put(per_device, stacked)

    def train_step(carry, batch):
        params, opt_state = carry
        (loss, (correct, count)), grads = jax.value_and_grad(
            lambda p: _loss_and_metrics(model, p, batch, jnp.mean), has_aux=True
        )(params)
        grads = jax.lax.pmean(grads, "batch")
        updates, opt_state = tx.update(grads, opt_state, params)
        metrics = {
            "loss": jax.lax.pmean(loss, "batch"),
            "correct": jax.lax.psum(correct, "batch"),
            "count": jax.lax.psum(count, "batch"),
        }
        return (optax.apply_updates(params, updates), opt_state), metrics

    step = jax.pmap(train_step, axis_name="batch", donate_argnums=(0,), devices=devices)
    copies = jax.tree.map(
        lambda x: np.broadcast_to(x, (n, *np.shape(x))), (params, tx.init(params))
    )
    carry = jax.device_put(copies, stacked)
    return Candidate(_loop(lambda c: step(c, batch), [carry]), {"num_devices": n})


def replicator_step(model, tx) -> Callable:
    """The step as a replicator user writes it: per replica, global-batch loss."""

    def train_step(state: TrainState, batch):
        def loss_fn(params):
            return _loss_and_metrics(model, params, batch, rp.compute_average_loss)

        (loss, (correct, count)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        return state.apply_gradients(grads, tx), {"loss": loss, "correct": correct, "count": count}

    return train_step


def replicator_candidate(model, host_batch, params, devices, path: str) -> Candidate:
    # The benchmarks choose CPU settings themselves, the same for every candidate
    # (XLA_FLAGS, cpu_defaults.py); the Replicator's own CPU defaults stay off.
    repl = rp.Replicator(devices=devices, cpu_defaults=False)
    tx = repl.wrap_optimizer(optax.adam(1e-3))
    state = repl.replicate(TrainState.create(params, tx, jax.random.key(0)))
    batch = repl.shard_batch(host_batch)
    train_step = replicator_step(model, tx)
    if path == "replicator_run":
        step = lambda s: repl.run(train_step, s, batch, donate_argnums=(0,))
    else:
        compiled = repl.compile(train_step, donate_argnums=(0,))
        step = lambda s: compiled(s, batch)
    return Candidate(_loop(step, [state]), {"num_devices": len(devices)})


def build(
    paths: Sequence[str] = PATHS,
    pool: str = "flax",
    batch_size: int = GLOBAL_BATCH,
    compiler_options: dict | None = None,
) -> dict[str, Candidate]:
    """Worker entry point: the requested paths over all of this process's devices."""
    devices = jax.devices()
    model = make_model(pool)
    host_batch = synthetic_batch(batch_size)
    # Host copies: each candidate places (and donates) its own buffers.
    params = jax.device_get(model.init(jax.random.key(0), host_batch["image"][:1])["params"])
    tx = optax.adam(1e-3)
    out = {}
    for path in paths:
        if path == "jit":
            out[path] = handwritten_jit(model, host_batch, tx, params, devices, compiler_options)
        elif path in GUARDED:
            out[path] = handwritten_jit(
                model, host_batch, tx, params, devices, compiler_options, GUARDED[path]
            )
        elif path == "pmap":
            out[path] = handwritten_pmap(model, host_batch, tx, params, devices)
        else:
            out[path] = replicator_candidate(model, host_batch, params, devices, path)
    return out
