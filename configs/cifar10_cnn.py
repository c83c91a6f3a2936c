"""A small CNN on CIFAR-10: 32x32 colour images of 10 classes.

The tf.distribute tutorial's CNN with a third convolution for the larger
images (conv 32, pool, conv 64, pool, conv 64, pool, dense 64, dense 10, all
"VALID"), Adam at 1e-3, a global batch of 128 (16 per replica x 8), 10 epochs
over the 50,000 training images of ``cifar10``, evaluated on its 10,000 test
images. ``--config.batch_size=N`` keeps 10 epochs.

Expected: roughly 65-70% test accuracy, what a CNN this size reaches in 10
epochs (TensorFlow's "Convolutional Neural Network" tutorial reports about
70% for a near-identical model); not reproduced here, as this machine cannot
download the data. Runtime: 3,906 steps; about 2 minutes of steps on a 2-core CPU
(0.034 s per step of 128 on 1 device).

Needs the dataset prepared in array_record format (``tfds build cifar10
--file_format=array_record`` on a machine with network and TensorFlow); then

    python -m replicator train --config configs/cifar10_cnn.py --workdir runs/cifar10_cnn

Smoke mode for tests: ``--config configs/cifar10_cnn.py:smoke`` (a few small
steps; the test suite runs it on ``tfds.testing.mock_data``).
"""

import ml_collections

from replicator.trainer.config import base_config

_NUM_TRAIN_EXAMPLES = 50_000
_NUM_EPOCHS = 10


def get_config(mode: str = "") -> ml_collections.ConfigDict:
    c = base_config(mode)  # every key with its default, so every key can be overridden
    c.experiment = "experiments.classify"
    c.model = dict(
        arch="cnn", num_classes=10, conv_features=(32, 64, 64), dense_features=64, padding="VALID"
    )
    c.dataset = "cifar10"

    c.batch_size = 128  # global: 16 per replica x 8 replicas
    c.eval_batch_size = 512

    # References, not numbers: --config.batch_size=N keeps 10 epochs and per-epoch evals.
    # Each key its own reference to an epoch of batch_size: setting one never sets another.
    def steps_per_epoch():
        return _NUM_TRAIN_EXAMPLES // c.get_ref("batch_size")

    c.num_train_steps = _NUM_EPOCHS * _NUM_TRAIN_EXAMPLES // c.get_ref("batch_size")
    c.learning_rate = 1e-3
    c.seed = 0

    c.log_every_steps = 50
    c.eval_every_steps = steps_per_epoch()
    c.checkpoint_every_steps = steps_per_epoch()

    if mode == "smoke":
        c.batch_size = 16
        c.eval_batch_size = 16
        c.num_train_steps = 4
        c.log_every_steps = 2
        c.eval_every_steps = 2
        c.checkpoint_every_steps = 2
    return c
