"""Image classification: the tf.distribute tutorial's CNN, flax's ImageNet ResNet (linen),
a Vision Transformer (``model.arch="vit"``; Hugging Face ViT checkpoints in and out
through the `hf_checkpoint` hook, `experiments.classify.hf`), or the Flax NNX MNIST
tutorial's CNN (``model.arch="nnx_cnn"``, `nnx_task`).

``CONFIG_KEYS`` declares the ``model`` keys of every architecture (each takes its
own and leaves the others'); the classifiers add no top-level key and use no mesh
axis beyond ``data``, ``fsdp`` and ``tensor``.

Importing it registers the offline datasets this repository defines (``digits``).
"""

import dataclasses
import inspect
from collections.abc import Mapping
from typing import Any

import experiments.datasets  # noqa: F401  (registers the local tfds builders)
from experiments.classify import nnx_task, task
from experiments.classify.hf import hf_checkpoint as hf_checkpoint
from experiments.classify.model import CNN as CNN
from experiments.classify.resnet import ResNet as ResNet
from experiments.classify.task import preprocess as preprocess
from experiments.classify.vit import ViT as ViT
from experiments.classify.vit import check_shape
from replicator.trainer import ConfigError, ConfigKeys, Experiment, Settings

ARCHS = ("cnn", "resnet", "vit", "nnx_cnn")
# name -> (types, meaning); the default is the linen `task.classifier`'s (else NNX's).
_MODEL_ROWS = {
    "arch": ((str,), "'cnn' (tf.distribute's tutorial), 'resnet' (flax's), 'vit' or 'nnx_cnn'"),
    "num_classes": ((int,), "size of the output layer"),
    "conv_features": ((tuple, list), "cnn, nnx_cnn: the convolutions' channels"),
    "dense_features": ((int,), "cnn: the dense layer's width"),
    "padding": ((str,), "cnn: the convolutions' padding, 'SAME' or 'VALID'"),
    "stage_sizes": ((tuple, list), "resnet: blocks per stage"),
    "num_filters": ((int,), "resnet: the first stage's channels"),
    "small_inputs": ((bool,), "resnet: a 3x3 stem without pooling, for small images"),
    "image_size": ((int, None), "vit: the side of its square images (8 for digits)"),
    "patch_size": ((int,), "vit: the side of a patch, dividing image_size"),
    "embed_dim": ((int,), "vit: the width"),
    "num_layers": ((int,), "vit: transformer blocks"),
    "num_heads": ((int,), "vit: attention heads, dividing embed_dim"),
    "mlp_dim": ((int,), "vit: the MLP's hidden width"),
    "norm_eps": ((float,), "vit: the layer norms' epsilon"),
    "qkv_bias": ((bool,), "vit: biases on the q/k/v projections"),
    "num_channels": ((int,), "vit: the images' channels (hf:DIR checkpoints: 3)"),
    "hidden_features": ((int,), "nnx_cnn: the dense layer's width"),
    "dropout_rate": ((float,), "nnx_cnn: dropout before the output layer"),
}
_TAKES = {variant: inspect.signature(variant.classifier).parameters for variant in (task, nnx_task)}
_DEFAULTS = {name: p.default for params in reversed(_TAKES.values()) for name, p in params.items()}


def check_config(values: Mapping[str, Any]) -> list[str]:
    """The architecture's name, and a ViT's patches and heads (`check_shape`)."""
    model = values["model"]
    if model["arch"] not in ARCHS:
        return [f"config.model.arch={model['arch']!r} is not one of {ARCHS}"]
    if model["arch"] == "vit":
        try:
            check_shape(model["image_size"], model["patch_size"], model["embed_dim"],
                        model["num_heads"])  # fmt: skip
        except ConfigError as e:
            return [str(e)]
    return []


CONFIG_KEYS = ConfigKeys(
    model={
        name: (types, _DEFAULTS[name], meaning) for name, (types, meaning) in _MODEL_ROWS.items()
    },
    check=check_config,
)


def make_experiment(settings: Settings) -> Experiment:
    """`nnx_task`'s experiment for ``model.arch="nnx_cnn"``, else `task`'s (linen models),
    each given the model keys it takes (and any key no architecture declares)."""
    variant = nnx_task if settings.model.get("arch") == "nnx_cnn" else task
    model = {
        key: value
        for key, value in settings.model.items()
        if key in _TAKES[variant] or key not in _MODEL_ROWS
    }
    return variant.make_experiment(dataclasses.replace(settings, model=model))
