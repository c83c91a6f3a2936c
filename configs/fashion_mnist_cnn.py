"""The tf.distribute custom-training tutorial: its CNN on Fashion-MNIST.

Recipe of the tutorial ("Custom training with tf.distribute.Strategy"): the CNN
with "VALID" convolutions (conv 32, pool, conv 64, pool, dense 64, dense 10),
Adam at 1e-3, a batch of 64 per replica and 10 epochs over the 60,000 training
images of ``fashion_mnist``, evaluated on the 10,000 test images.

The global batch is fixed at 512 = 64 per replica x 8 replicas (the
tutorial's recipe as it runs on 8 devices), so the run is the same on any
device count. For exactly 64 per replica on N devices, pass
``--config.batch_size=$((64 * N))``: the step counts follow the batch size and
keep 10 epochs.

Expected: about 91% test accuracy, the tutorial's result (not reproduced
here: this machine cannot download the data). Runtime: 1,171 steps; about
2 minutes of steps on a 2-core CPU (0.1 s per step of 512 on 1 device).

Needs the dataset prepared in array_record format (``tfds build fashion_mnist
--file_format=array_record`` on a machine with network and TensorFlow); then

    python -m replicator train --config configs/fashion_mnist_cnn.py --workdir runs/fashion_mnist

Smoke mode for tests: ``--config configs/fashion_mnist_cnn.py:smoke`` (a few
small steps; the test suite runs it on ``tfds.testing.mock_data``).
"""

import ml_collections

from replicator.trainer.config import base_config

_NUM_TRAIN_EXAMPLES = 60_000
_NUM_EPOCHS = 10


def get_config(mode: str = "") -> ml_collections.ConfigDict:
    c = base_config(mode)  # every key with its default, so every key can be overridden
    c.experiment = "experiments.classify"
    c.model = dict(
        arch="cnn", num_classes=10, conv_features=(32, 64), dense_features=64, padding="VALID"
    )
    c.dataset = "fashion_mnist"

    c.batch_size = 512  # global: 64 per replica x 8 replicas
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
