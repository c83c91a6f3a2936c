"""The same data as a tfds dataset: a builder of one's own, with nothing to download.

``--config.dataset=regression_tfds:SyntheticRegression`` names the class; the
trainer imports this module (which registers the builder with tfds as
``synthetic_regression``), prepares the dataset under ``config.data_dir`` in
array_record format on first use, as ``tfds.load`` would, and reads it like any
tfds dataset. A plain `tfds.core.GeneratorBasedBuilder`: a builder that is not
part of tfds' own catalog is built where it is, with no flag to set. Once
this module is imported (by your experiment module, say), ``dataset =
"synthetic_regression"`` names it too.

tfds stores a split's examples in an order of its own (sorted by a hash of
their keys), so this dataset trains on the same examples as
``regression_data:make_source`` but not in the same order.
"""

from collections.abc import Iterator

import numpy as np
import regression_data
import tensorflow_datasets as tfds


class SyntheticRegression(tfds.core.GeneratorBasedBuilder):
    """`regression_data`'s examples: ``x`` float32[8] and ``y`` float32."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Initial release."}

    def _info(self) -> tfds.core.DatasetInfo:
        features = tfds.features.FeaturesDict(
            {
                "x": tfds.features.Tensor(shape=(regression_data.NUM_FEATURES,), dtype=np.float32),
                "y": tfds.features.Tensor(shape=(), dtype=np.float32),
            }
        )
        return tfds.core.DatasetInfo(builder=self, features=features)

    def _split_generators(self, dl_manager: tfds.download.DownloadManager) -> dict:
        del dl_manager  # nothing to download: the examples are computed
        return {split: self._generate_examples(split) for split in regression_data.SIZES}

    def _generate_examples(self, split: str) -> Iterator[tuple[int, dict]]:
        source = regression_data.make_source(split)
        for index in range(len(source)):
            yield index, source[index]
