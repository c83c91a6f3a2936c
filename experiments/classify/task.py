"""Classification task: preprocessing, train step and eval step.

The steps are written once, for one device, in the per-replica style:
`rp.compute_average_loss` divides by the global batch and the wrapped optimizer
sums the gradients, so the same functions run under `Replicator.run` and
`Replicator.compile`.
"""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import replicator as rp
from experiments.classify.model import CNN
from replicator.state import TrainState


def preprocess(example: dict[str, Any]) -> dict[str, np.ndarray]:
    """uint8 image -> float32 in [0, 1]; label -> int32."""
    return {
        "image": np.asarray(example["image"], np.float32) / 255.0,
        "label": np.asarray(example["label"], np.int32),
    }


def make_model(precision: rp.Policy, **model_kwargs: Any) -> CNN:
    """The CNN computing in the policy's compute dtype."""
    return CNN(dtype=precision.compute_dtype, **model_kwargs)


def init_params(model: CNN, rng: jax.Array, example: dict[str, np.ndarray]) -> Any:
    """Initial parameters, shaped by one preprocessed example."""
    return model.init(rng, jnp.asarray(example["image"])[None])["params"]


def make_train_step(model: CNN, tx: optax.GradientTransformation) -> Callable:
    """Returns ``train_step(state, batch) -> (state, metrics)``."""

    def train_step(state: TrainState, batch: dict[str, jax.Array]):
        def loss_fn(params):
            logits = model.apply({"params": params}, batch["image"])
            losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"])
            return rp.compute_average_loss(losses), logits

        (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        correct = jnp.argmax(logits, -1) == batch["label"]
        # Sums derived from the batch, so they are per-replica values to reduce.
        metrics = {
            "loss": loss,
            "correct": jnp.sum(correct),
            "count": jnp.sum(jnp.ones_like(correct)),
        }
        return state.apply_gradients(grads, tx), metrics

    return train_step


def make_eval_step(model: CNN) -> Callable:
    """Returns ``eval_step(params, batch) -> sums`` of loss, correct and real examples.

    Padded examples (``batch["mask"] == 0``) count nowhere.
    """

    def eval_step(params: Any, batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
        logits = model.apply({"params": params}, batch["image"])
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"])
        mask = batch["mask"].astype(jnp.float32)
        correct = (jnp.argmax(logits, -1) == batch["label"]).astype(jnp.float32)
        return {
            "loss": jnp.sum(losses * mask),
            "correct": jnp.sum(correct * mask),
            "count": jnp.sum(mask),
        }

    return eval_step
