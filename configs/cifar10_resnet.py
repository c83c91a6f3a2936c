"""ResNet-18 with cross-replica BatchNorm on CIFAR-10: flax's ImageNet example, small.

The ResNet V1 of flax's ImageNet example (``examples/imagenet/models.py``),
stages (2, 2, 2, 2) of basic blocks (ResNet-18), 64 filters, a 3x3 stem
without pooling for 32x32 images, BatchNorm averaged over all replicas
(``axis_name=repl.axis_name``; statistics in ``TrainState.model_state``),
Adam at 1e-3, a global batch of 256, 30 epochs over the 50,000 training images
of ``cifar10``. The optimizer key takes any optax alias and its learning rate,
e.g. ``--config.optimizer=sgd --config.learning_rate=0.1``.

Expected: roughly 85% test accuracy (ResNet-18 without data augmentation
after 30 epochs; an estimate, not reproduced here, as this machine cannot
download the data). Runtime: 5,859 steps; made for one GPU or TPU host
(bf16 with ``--config.precision=bf16``): minutes there. On a 2-core CPU, about
5 hours (roughly 3 s per step of 256, estimated from the model's FLOPs).

Needs the dataset prepared in array_record format (``tfds build cifar10
--file_format=array_record`` on a machine with network and TensorFlow); then

    python -m replicator train --config configs/cifar10_resnet.py --workdir runs/cifar10_resnet

Smoke mode for tests: ``--config configs/cifar10_resnet.py:smoke`` (a tiny
ResNet for a few steps; the test suite runs it on ``tfds.testing.mock_data``).
"""

import ml_collections

from replicator.trainer.config import base_config

_NUM_TRAIN_EXAMPLES = 50_000
_NUM_EPOCHS = 30


def get_config(mode: str = "") -> ml_collections.ConfigDict:
    c = base_config(mode)  # every key with its default, so every key can be overridden
    c.experiment = "experiments.classify"
    c.model = dict(
        arch="resnet", num_classes=10, stage_sizes=(2, 2, 2, 2), num_filters=64, small_inputs=True
    )
    c.dataset = "cifar10"

    c.batch_size = 256
    c.eval_batch_size = 1000
    steps_per_epoch = _NUM_TRAIN_EXAMPLES // c.get_ref("batch_size")
    c.num_train_steps = _NUM_EPOCHS * _NUM_TRAIN_EXAMPLES // c.get_ref("batch_size")
    c.learning_rate = 1e-3
    c.seed = 0

    c.log_every_steps = 50
    c.eval_every_steps = 5 * steps_per_epoch
    c.checkpoint_every_steps = 5 * steps_per_epoch
    c.best_metric = "accuracy"

    if mode == "smoke":
        c.model = dict(
            arch="resnet", num_classes=10, stage_sizes=(1, 1), num_filters=8, small_inputs=True
        )
        c.batch_size = 16
        c.eval_batch_size = 16
        c.num_train_steps = 4
        c.log_every_steps = 2
        c.eval_every_steps = 2
        c.checkpoint_every_steps = 2
    return c
