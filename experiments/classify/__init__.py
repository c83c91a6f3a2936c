"""Image classification: the tf.distribute tutorial's CNN or flax's ImageNet ResNet.

Importing it registers the offline datasets this repository defines (``digits``).
"""

import experiments.datasets  # noqa: F401  (registers the local tfds builders)
from experiments.classify.model import CNN as CNN
from experiments.classify.resnet import ResNet as ResNet
from experiments.classify.task import make_experiment as make_experiment
from experiments.classify.task import preprocess as preprocess
