"""Dataset builders that this repository defines.

Importing this package registers every builder below with tfds, so that
``replicator.trainer.data.load_data_source("digits", ...)`` can find them by name.
"""

from experiments.datasets.digits import Digits as Digits
