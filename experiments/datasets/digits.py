"""The ``digits`` tfds dataset: scikit-learn's 8x8 handwritten digits, built offline.

scikit-learn ships 1,797 real scans of handwritten digits (the test part of the
UCI "Optical Recognition of Handwritten Digits" data), each an 8x8 grid of
counts 0..16. This builder turns them into a tfds dataset that goes through the
same array_record + grain path as ``mnist`` or ``cifar10``, but needs no
network: the data come from the installed scikit-learn package.

Split: a fixed, stratified 1,437 train / 360 test split. Each class gives the
test split its share of the 360 examples (largest-remainder rounding), drawn
with ``np.random.RandomState(0)``; NumPy freezes that legacy generator's stream,
so the split is the same on every machine and NumPy version.

Build it with::

    import experiments.datasets  # registers the builder
    import tensorflow_datasets as tfds
    tfds.builder("digits", data_dir=DIR).download_and_prepare(file_format="array_record")

or let ``replicator.trainer.data.load_data_source("digits", "train", data_dir=DIR)``
prepare it on first use: it is a builder of this repository's own, not of tfds'
catalog, so it is built where it is, with no flag to set.

The same examples without tfds: `make_source` returns a split as a list of
examples, in the order the built dataset stores them, for
``dataset='experiments.datasets.digits:make_source'`` (a function source).
"""

import hashlib
from collections.abc import Iterator

import numpy as np
import tensorflow_datasets as tfds
from sklearn.datasets import load_digits

from experiments.datasets.base import LocalBuilder

NUM_CLASSES = 10
NUM_TEST_EXAMPLES = 360
_SPLIT_SEED = 0

_CITATION = """\
@misc{alpaydin1998optdigits,
  author = {Alpaydin, E. and Kaynak, C.},
  title = {Optical Recognition of Handwritten Digits},
  year = {1998},
  howpublished = {UCI Machine Learning Repository},
  doi = {10.24432/C50P49},
}"""


class Digits(LocalBuilder):
    """scikit-learn's handwritten digits as a tfds dataset (no download needed)."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Initial release."}

    def _info(self) -> tfds.core.DatasetInfo:
        # A raw uint8 Tensor instead of tfds.features.Image: Image encodes PNG
        # with TensorFlow, which we do not install. The stored bytes are
        # smaller than a PNG of 64 pixels anyway.
        features = tfds.features.FeaturesDict(
            {
                "image": tfds.features.Tensor(shape=(8, 8, 1), dtype=np.uint8),
                "label": tfds.features.ClassLabel(num_classes=NUM_CLASSES),
            }
        )
        return tfds.core.DatasetInfo(
            builder=self,
            description=(
                "1,797 8x8 grayscale scans of handwritten digits 0-9 from "
                "scikit-learn (UCI optdigits), rescaled to 0..255; fixed "
                "stratified 1,437 train / 360 test split."
            ),
            features=features,
            supervised_keys=("image", "label"),
            homepage="https://archive.ics.uci.edu/dataset/80",
            citation=_CITATION,
        )

    def _split_generators(self, dl_manager: tfds.download.DownloadManager) -> dict:
        del dl_manager  # Everything comes from the installed scikit-learn.
        images, labels, rows = _digits()
        return {
            split: self._generate_examples(images, labels, indices)
            for split, indices in rows.items()
        }

    def _generate_examples(
        self, images: np.ndarray, labels: np.ndarray, indices: np.ndarray
    ) -> Iterator[tuple[int, dict]]:
        # The key is the row in load_digits(), so an example can be traced back.
        for i in indices:
            yield int(i), {"image": images[i], "label": int(labels[i])}


def make_source(split: str) -> list[dict[str, np.ndarray]]:
    """The ``digits`` dataset's ``split`` as a function source, without tfds.

    The examples the builder writes, in the order the built dataset stores
    them: tfds' writer sorts a split's examples by the MD5 of the split's name
    followed by the example's key (here the row in ``load_digits()``), so a
    function source of these trains exactly like ``dataset='digits'``.

    Args:
      split: ``"train"`` (1,437 scans) or ``"test"`` (360).

    Returns:
      ``[{"image": uint8[8, 8, 1], "label": int64}, ...]``.

    >>> source = make_source("test")
    >>> len(source), source[0]["image"].shape, source[0]["label"].dtype
    (360, (8, 8, 1), dtype('int64'))
    """
    images, labels, rows = _digits()
    if split not in rows:
        raise ValueError(f"digits has the splits {sorted(rows)}, not {split!r}")
    salted = lambda i: hashlib.md5(f"{split}{i}".encode(), usedforsecurity=False).hexdigest()
    order = sorted(rows[split].tolist(), key=salted)
    return [{"image": images[i], "label": labels[i]} for i in order]


def _digits() -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
    """uint8 images ``[1797, 8, 8, 1]``, int64 labels, and each split's rows."""
    digits = load_digits()
    # Counts 0..16 -> 0..255, rounding half up in exact integer arithmetic.
    images = (digits.images.astype(np.int64) * 255 + 8) // 16
    images = images.astype(np.uint8)[..., None]
    labels = digits.target.astype(np.int64)
    is_test = split_test_mask(labels, NUM_TEST_EXAMPLES, seed=_SPLIT_SEED)
    return images, labels, {"train": np.flatnonzero(~is_test), "test": np.flatnonzero(is_test)}


def split_test_mask(labels: np.ndarray, num_test: int, *, seed: int) -> np.ndarray:
    """Draws a stratified test split of exactly ``num_test`` examples.

    Every class contributes its share of ``num_test``, rounded by the largest
    remainder so that the shares add up exactly; the examples within a class
    are drawn with ``np.random.RandomState(seed)``.

    Args:
        labels: integer class of each example, shape ``[num_examples]``.
        num_test: how many examples go to the test split.
        seed: seed of the NumPy ``RandomState`` that picks the examples.

    Returns:
        A boolean array shaped like ``labels``, True for test examples.

    >>> mask = split_test_mask(np.array([0, 0, 0, 1, 1, 1]), 2, seed=0)
    >>> int(mask.sum()), int(mask[:3].sum()), int(mask[3:].sum())
    (2, 1, 1)
    """
    counts = np.bincount(labels)
    quota = counts * num_test / len(labels)
    per_class = np.floor(quota).astype(np.int64)
    largest_remainders = np.argsort(per_class - quota, kind="stable")
    per_class[largest_remainders[: num_test - per_class.sum()]] += 1

    rng = np.random.RandomState(seed)
    is_test = np.zeros(len(labels), dtype=bool)
    for label, n in enumerate(per_class):
        is_test[rng.permutation(np.flatnonzero(labels == label))[:n]] = True
    return is_test
