"""Sample quality of generated digits, judged by a small classifier of real digits.

The Inception network of the Inception score and FID knows nothing of 8x8
scans, so a small MLP trained on the ``digits`` train split takes its place
(scikit-learn, under a second, once per process; 98% accuracy on the test split):

* ``fid``: the Fréchet distance between two Gaussians fitted to the
  classifier's hidden features (64 ReLU units) of the generated samples and of
  the real eval images. 0 for identical distributions; lower is better.
* ``classifier_score``: the Inception score with this classifier,
  ``exp(E_x KL(p(y|x) || p(y)))``. Between 1 and 10 (the number of classes):
  high when each sample is confidently one digit and all digits are generated.

Both come from *sums over examples* (feature sums, outer-product sums,
probability sums), which add up exactly across batches, replicas and
processes, and ignore padded examples; `summarize_scores` turns the totals into
the scores on the host.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from sklearn.datasets import load_digits
from sklearn.exceptions import ConvergenceWarning
from sklearn.neural_network import MLPClassifier
from threadpoolctl import threadpool_limits

from experiments.datasets.digits import NUM_TEST_EXAMPLES, split_test_mask

HIDDEN_UNITS = 64
_DIGITS_SPLIT_SEED = 0  # the seed of the ``digits`` tfds builder's train/test split


@dataclasses.dataclass(frozen=True)
class DigitsClassifier:
    """A one-hidden-layer ReLU MLP on 8x8 images in [-1, 1], as arrays.

    Attributes:
      hidden_kernel: ``[64, HIDDEN_UNITS]``.
      hidden_bias: ``[HIDDEN_UNITS]``.
      output_kernel: ``[HIDDEN_UNITS, 10]``.
      output_bias: ``[10]``.
      test_accuracy: its accuracy on the ``digits`` test split.
    """

    hidden_kernel: np.ndarray
    hidden_bias: np.ndarray
    output_kernel: np.ndarray
    output_bias: np.ndarray
    test_accuracy: float

    def __call__(self, images_BxHxWxC: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Hidden features ``[B, HIDDEN_UNITS]`` and class logits ``[B, 10]``, in float32."""
        x = jnp.reshape(images_BxHxWxC, (images_BxHxWxC.shape[0], -1)).astype(jnp.float32)
        features_BxH = jax.nn.relu(x @ self.hidden_kernel + self.hidden_bias)
        logits_BxC = features_BxH @ self.output_kernel + self.output_bias
        return features_BxH, logits_BxC


def load_digits_split(split: str) -> tuple[np.ndarray, np.ndarray]:
    """The ``digits`` tfds dataset's split, read straight from scikit-learn.

    Args:
      split: ``"train"`` (1,437 scans) or ``"test"`` (360).

    Returns:
      uint8 images ``[N, 8, 8, 1]`` in 0..255 and int64 labels ``[N]``, the
      examples the tfds builder writes, in the same order.
    """
    digits = load_digits()
    # The builder's conversion: counts 0..16 -> 0..255, rounding half up.
    images = ((digits.images.astype(np.int64) * 255 + 8) // 16).astype(np.uint8)[..., None]
    is_test = split_test_mask(digits.target, NUM_TEST_EXAMPLES, seed=_DIGITS_SPLIT_SEED)
    rows = {"train": ~is_test, "test": is_test}[split]
    return images[rows], digits.target[rows]


def to_unit_range(images: np.ndarray) -> np.ndarray:
    """uint8 0..255 -> float32 in [-1, 1], the range of the generator's ``tanh``."""
    return np.asarray(images, np.float32) / 127.5 - 1.0


@functools.cache
def fit_digits_classifier(seed: int = 0) -> DigitsClassifier:
    """Trains the judge on the ``digits`` train split (under a second; cached per process).

    Deterministic for a given ``seed``, so scores from different runs compare.
    """
    train_images, train_labels = load_digits_split("train")
    test_images, test_labels = load_digits_split("test")
    flat = lambda images: to_unit_range(images).reshape(len(images), -1)
    # Adam, lightly regularised: L-BFGS fits faster but is overconfident off the data
    # (uniform noise then scores 7 of 10 instead of 3).
    mlp = MLPClassifier(
        hidden_layer_sizes=(HIDDEN_UNITS,), alpha=1e-3, max_iter=500, random_state=seed
    )
    # One BLAS thread: 0.5 s instead of 2-4 s for these small matrices on a busy
    # machine, and the same summation order, hence the same judge, everywhere.
    with threadpool_limits(1), warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        mlp.fit(flat(train_images), train_labels)
    (w1, w2), (b1, b2) = mlp.coefs_, mlp.intercepts_
    as32 = lambda x: np.asarray(x, np.float32)
    return DigitsClassifier(
        hidden_kernel=as32(w1),
        hidden_bias=as32(b1),
        output_kernel=as32(w2),
        output_bias=as32(b2),
        test_accuracy=float(mlp.score(flat(test_images), test_labels)),
    )


def score_sums(
    classifier: DigitsClassifier,
    samples_BxHxWxC: jax.Array,
    references_BxHxWxC: jax.Array,
    mask_B: jax.Array,
) -> dict[str, jax.Array]:
    """Mergeable sums over the examples whose mask is 1, for `summarize_scores`.

    Args:
      classifier: the judge, from `fit_digits_classifier`.
      samples_BxHxWxC: generated images in [-1, 1].
      references_BxHxWxC: real images in [-1, 1].
      mask_B: 1 for real examples, 0 for padding (which adds nothing).

    Returns:
      ``count``; ``sample_features`` and ``reference_features`` (sums of the
      hidden features), ``sample_outer`` and ``reference_outer`` (sums of their
      outer products); ``sample_probs`` (the sum of the class probabilities)
      and ``sample_neg_entropy`` (the sum of ``sum_y p log p``).

    >>> clf = DigitsClassifier(np.eye(64, 4), np.zeros(4), np.ones((4, 10)), np.zeros(10), 1.0)
    >>> sums = score_sums(clf, jnp.ones((3, 8, 8, 1)), jnp.ones((3, 8, 8, 1)), jnp.array([1, 1, 0]))
    >>> float(sums["count"]), sums["sample_outer"].shape, round(float(sums["sample_probs"][0]), 3)
    (2.0, (4, 4), 0.2)
    """
    keep = jnp.asarray(mask_B) > 0
    masked = lambda x: jnp.where(keep.reshape(-1, *[1] * (x.ndim - 1)), x, 0)
    sample_features, logits = classifier(samples_BxHxWxC)
    reference_features, _ = classifier(references_BxHxWxC)
    log_probs = jax.nn.log_softmax(logits)
    probs = masked(jnp.exp(log_probs))
    sample_features, reference_features = masked(sample_features), masked(reference_features)
    return {
        "count": jnp.sum(keep.astype(jnp.float32)),
        "sample_features": jnp.sum(sample_features, axis=0),
        "sample_outer": sample_features.T @ sample_features,
        "reference_features": jnp.sum(reference_features, axis=0),
        "reference_outer": reference_features.T @ reference_features,
        "sample_probs": jnp.sum(probs, axis=0),
        "sample_neg_entropy": jnp.sum(probs * log_probs),
    }


def summarize_scores(sums: Mapping[str, np.ndarray]) -> dict[str, float]:
    """``fid`` and ``classifier_score`` from the totals of `score_sums`."""
    sums = {name: np.asarray(value, np.float64) for name, value in sums.items()}
    count = float(sums["count"])
    sample = _gaussian(sums["sample_features"], sums["sample_outer"], count)
    reference = _gaussian(sums["reference_features"], sums["reference_outer"], count)
    mean_probs = sums["sample_probs"] / count
    mean_kl = sums["sample_neg_entropy"] / count - np.sum(_xlogx(mean_probs))
    return {
        "fid": frechet_distance(*sample, *reference),
        "classifier_score": float(np.exp(mean_kl)),
    }


def frechet_distance(
    mean1: np.ndarray, cov1: np.ndarray, mean2: np.ndarray, cov2: np.ndarray
) -> float:
    """The Fréchet (2-Wasserstein) distance between two Gaussians.

    ``|m1 - m2|^2 + tr(C1) + tr(C2) - 2 tr((C1^1/2 C2 C1^1/2)^1/2)``, through
    symmetric eigendecompositions, so it stays real and finite for the
    rank-deficient covariances of a few hundred samples.

    >>> frechet_distance(np.zeros(2), np.eye(2), np.ones(2), 4 * np.eye(2))
    4.0
    """
    values, vectors = np.linalg.eigh(cov1)
    root1 = (vectors * np.sqrt(np.clip(values, 0, None))) @ vectors.T
    cross = np.linalg.eigvalsh(root1 @ cov2 @ root1)
    trace_root = np.sum(np.sqrt(np.clip(cross, 0, None)))
    distance = np.sum((mean1 - mean2) ** 2) + np.trace(cov1) + np.trace(cov2) - 2 * trace_root
    return float(max(distance, 0.0))


def _gaussian(total: np.ndarray, outer: np.ndarray, count: float) -> tuple[np.ndarray, np.ndarray]:
    mean = total / count
    cov = (outer - count * np.outer(mean, mean)) / max(count - 1, 1)  # unbiased, like np.cov
    return mean, (cov + cov.T) / 2


def _xlogx(p: np.ndarray) -> np.ndarray:
    return np.where(p > 0, p * np.log(np.where(p > 0, p, 1)), 0.0)
