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


def preprocess(batch: dict[str, Any]) -> dict[str, np.ndarray]:
    """uint8 images -> float32 in [0, 1]; labels -> int32.

    The loader calls it once per batch, on the examples stacked along axis 0;
    being elementwise, it also maps a single example.
    """
    return {
        "image": np.asarray(batch["image"], np.float32) / 255.0,
        "label": np.asarray(batch["label"], np.int32),
    }


def make_model(**model_kwargs: Any) -> CNN:
    """The CNN; the trainer applies the precision policy around it."""
    return CNN(**model_kwargs)


def init_params(model: CNN, rng: jax.Array, example: dict[str, np.ndarray]) -> Any:
    """Initial parameters, shaped by one preprocessed example."""
    return model.init(rng, jnp.asarray(example["image"])[None])["params"]


def make_train_step(model: CNN, tx: optax.GradientTransformation) -> Callable:
    """Returns ``train_step(state, batch) -> (state, metrics)``.

    Padded examples (``batch["mask"] == 0``, if there is a mask) count nowhere:
    the loss is the mean over the real examples of the global batch.
    """

    def train_step(state: TrainState, batch: dict[str, jax.Array]):
        mask = batch.get("mask", jnp.ones(batch["label"].shape, jnp.float32))
        total = rp.global_sum(mask)  # the real examples of the whole global batch

        def loss_fn(params, batch):
            logits = model.apply({"params": params}, batch["image"])
            losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"])
            weight = batch.get("mask", jnp.ones_like(losses))
            loss = rp.compute_average_loss(losses, global_batch_size=total, sample_weight=weight)
            correct = (jnp.argmax(logits, -1) == batch["label"]) * weight
            return loss, {"correct": jnp.sum(correct), "count": jnp.sum(weight)}

        (loss, sums), grads = state.value_and_grad(loss_fn, batch, has_aux=True)
        metrics = {"loss": loss, **sums}
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
