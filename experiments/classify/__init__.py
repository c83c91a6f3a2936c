"""Image classification: the tf.distribute tutorial's CNN, flax's ImageNet ResNet (linen),
a Vision Transformer (``model.arch="vit"``; Hugging Face ViT checkpoints in and out
through the `hf_checkpoint` hook, `experiments.classify.hf`), or the Flax NNX MNIST
tutorial's CNN (``model.arch="nnx_cnn"``, `nnx_task`).

Importing it registers the offline datasets this repository defines (``digits``).
"""

import experiments.datasets  # noqa: F401  (registers the local tfds builders)
from experiments.classify import nnx_task, task
from experiments.classify.hf import hf_checkpoint as hf_checkpoint
from experiments.classify.model import CNN as CNN
from experiments.classify.resnet import ResNet as ResNet
from experiments.classify.task import preprocess as preprocess
from experiments.classify.vit import ViT as ViT
from replicator.trainer import Experiment, Settings


def make_experiment(settings: Settings) -> Experiment:
    """`nnx_task`'s experiment for ``model.arch="nnx_cnn"``, else `task`'s (linen models)."""
    variant = nnx_task if settings.model.get("arch") == "nnx_cnn" else task
    return variant.make_experiment(settings)
