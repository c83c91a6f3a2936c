"""The tf.distribute tutorial's CNN and recipe on MNIST handwritten digits.

The recipe of ``configs/fashion_mnist_cnn.py`` (the CNN with "VALID"
convolutions, Adam at 1e-3, 64 examples per replica x 8 = a global batch of
512, 10 epochs) on the 60,000 training images of ``mnist``, evaluated on its
10,000 test images. ``--config.batch_size=N`` keeps 10 epochs.

Expected: about 99% test accuracy, what this CNN typically reaches on MNIST
(not reproduced here: this machine cannot download the data). Runtime: 1,171
steps; about 2 minutes of steps on a 2-core CPU (0.1 s per step of 512).

Needs the dataset prepared in array_record format (``tfds build mnist
--file_format=array_record`` on a machine with network and TensorFlow); then

    python -m replicator train --config configs/mnist_cnn.py --workdir runs/mnist_cnn

Smoke mode for tests: ``--config configs/mnist_cnn.py:smoke`` (a few small
steps; the test suite runs it on ``tfds.testing.mock_data``).
"""

import importlib.util
import pathlib

import ml_collections


def _fashion_mnist_config(mode: str) -> ml_collections.ConfigDict:
    path = pathlib.Path(__file__).with_name("fashion_mnist_cnn.py")
    spec = importlib.util.spec_from_file_location("fashion_mnist_cnn", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(mode)


def get_config(mode: str = "") -> ml_collections.ConfigDict:
    c = _fashion_mnist_config(mode)  # the same recipe (one level of derivation)
    c.dataset = "mnist"
    return c
