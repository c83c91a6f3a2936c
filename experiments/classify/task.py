"""Image classification: preprocessing, the train and eval steps, and the metrics.

The steps are written once, for one device, in the per-replica style:
`rp.compute_average_loss` divides by the global batch and the wrapped optimizer
sums the gradients, so the same functions run under `Replicator.run` and
`Replicator.compile`. Models with BatchNorm (the ResNet) keep their statistics
in `rp.TrainState.model_state`, averaged over the replicas (``axis_name``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import replicator as rp
from experiments.classify.model import CNN
from experiments.classify.resnet import ResNet
from experiments.classify.vit import ViT, check_shape
from replicator.trainer import ConfigError, Experiment, Settings


def preprocess(batch: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """uint8 images -> float32 in [0, 1]; labels -> int32.

    The loader calls it once per batch, on the examples stacked along axis 0;
    being elementwise, it also maps a single example.
    """
    out = {
        "image": np.asarray(batch["image"], np.float32) / 255.0,
        "label": np.asarray(batch["label"], np.int32),
    }
    if "mask" in batch:
        out["mask"] = np.asarray(batch["mask"])
    return out


def make_experiment(settings: Settings) -> Experiment:
    """The classification experiment, from ``config.model`` (`classifier`'s arguments)."""
    return classifier(settings, **settings.model)


def classifier(
    settings: Settings,
    *,
    arch: str = "cnn",
    num_classes: int = 10,
    conv_features: Sequence[int] = (32, 64),
    dense_features: int = 64,
    padding: str = "SAME",
    stage_sizes: Sequence[int] = (2, 2, 2, 2),
    num_filters: int = 64,
    small_inputs: bool = True,
    image_size: int | None = None,
    patch_size: int = 4,
    embed_dim: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    mlp_dim: int = 128,
    norm_eps: float = 1e-6,
    qkv_bias: bool = True,
    num_channels: int = 3,
) -> Experiment:
    """The classification experiment.

    Args:
      settings: from the trainer.
      arch: ``"cnn"`` (the tf.distribute tutorial's), ``"resnet"`` (flax's
        ImageNet example's, with cross-replica BatchNorm) or ``"vit"`` (a Vision
        Transformer, big_vision's and Hugging Face's; ``init_from='hf:DIR'`` loads a
        ``ViTModel`` or ``ViTForImageClassification``, `experiments.classify.hf`).
      num_classes: size of the output layer.
      conv_features, dense_features, padding: the CNN's.
      stage_sizes, num_filters, small_inputs: the ResNet's.
      image_size, patch_size, embed_dim, num_layers, num_heads, mlp_dim, norm_eps,
        qkv_bias, num_channels: the ViT's (`experiments.classify.vit.ViT`).
    """
    repl = settings.repl
    if arch == "cnn":
        module = CNN(num_classes, tuple(conv_features), dense_features, padding)
    elif arch == "resnet":
        module = ResNet(tuple(stage_sizes), num_classes, num_filters, repl.axis_name, small_inputs)
    elif arch == "vit":
        check_shape(image_size, patch_size, embed_dim, num_heads)
        module = ViT(num_classes, image_size, patch_size, embed_dim, num_layers, num_heads,
                     mlp_dim, norm_eps, qkv_bias, num_channels)  # fmt: skip
    else:
        raise ConfigError(f"config.model.arch={arch!r}: choose 'cnn', 'resnet' or 'vit'.")
    return _experiment(repl.apply_policy(module), settings, with_state=arch == "resnet")


def _experiment(model: nn.Module, settings: Settings, *, with_state: bool) -> Experiment:
    """The experiment around a linen classifier; ``with_state``: it has BatchNorm statistics."""
    repl, tx = settings.repl, settings.make_optimizer()

    def apply(params, model_state, images, train):
        variables = {"params": params, **(model_state or {})}
        if not with_state:
            return model.apply(variables, images), model_state
        if not train:
            return model.apply(variables, images, train=False), model_state
        return model.apply(variables, images, train=True, mutable=["batch_stats"])

    def init_state(rng: jax.Array, example: Mapping[str, Any]) -> rp.TrainState:
        init_rng, state_rng = jax.random.split(rng)
        kwargs = {"train": False} if with_state else {}
        variables = model.init(init_rng, jnp.asarray(example["image"])[None], **kwargs)
        params = variables.pop("params")
        return rp.TrainState.create(
            params,
            tx,
            state_rng,
            model_state=dict(variables) or None,
            policy=repl.precision,
            grad_accum_steps=settings.grad_accum_steps,
        )

    def train_step(state: rp.TrainState, batch):
        def loss_fn(params, *rest):
            model_state, batch = rest if with_state else (None, rest[0])
            logits, new_state = apply(params, model_state, batch["image"], train=True)
            losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"])
            correct = jnp.argmax(logits, -1) == batch["label"]
            count = jnp.float32(losses.size)
            sums = {"loss": jnp.sum(losses), "correct": jnp.sum(correct), "count": count}
            loss = rp.compute_average_loss(losses)
            return (loss, (new_state, sums)) if with_state else (loss, sums)

        (_, aux), grads = state.value_and_grad(loss_fn, batch, has_aux=True)
        new_state, sums = aux if with_state else (None, aux)
        return state.apply_gradients(grads, tx, model_state=new_state), sums

    def eval_step(view, batch):
        logits, _ = apply(view["params"], view["model_state"], batch["image"], train=False)
        return eval_sums(logits, batch)

    return Experiment(
        preprocess=preprocess,
        init_state=init_state,
        train_step=train_step,
        eval_step=eval_step,
        summarize=summarize,
        metric_names=("accuracy", "loss"),
    )


def eval_sums(logits: jax.Array, batch: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
    """Sums of loss, correct predictions and examples over the real (``mask``) examples."""
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"])
    mask = batch["mask"].astype(jnp.float32)
    correct = (jnp.argmax(logits, -1) == batch["label"]).astype(jnp.float32)
    return {
        "loss": jnp.sum(losses * mask),
        "correct": jnp.sum(correct * mask),
        "count": jnp.sum(mask),
    }


def summarize(sums: Mapping[str, Any]) -> dict[str, float]:
    """Summed ``loss``, ``correct`` and ``count`` -> mean loss and accuracy.

    >>> summarize({"loss": 3.0, "correct": 2.0, "count": 4.0})
    {'loss': 0.75, 'accuracy': 0.5}
    """
    count = float(sums["count"])
    mean: Callable[[str], float] = lambda key: float(sums[key]) / count if count else math.nan
    return {"loss": mean("loss"), "accuracy": mean("correct")}
