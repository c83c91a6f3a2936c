"""Comparing parameters after optimizer steps, with what Adam amplifies by design.

Two runs of one computation that sum in other orders (other meshes, other reduction
trees, microbatches) differ by float rounding. SGD passes that on unchanged, so its
parameters compare element by element. Adam does not: its step ``m / (sqrt(v) + eps)``
normalises each element's gradient, so in a rare element whose gradient is near zero a
rounding of the gradient's own size turns into a step that differs by up to the
learning rate. Which element that is depends on the machine's float rounding (an AMD
EPYC host and the CI machine disagree on one of 8,192), so after Adam steps a test
bounds the share of elements beyond the tolerance and the worst of them, and keeps the
losses tight, rather than asserting every element.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np


def assert_trained_alike(
    got: Any, want: Any, *, atol: float = 2e-5, worst: float = 1e-4, share: float = 1e-3
) -> None:
    """Parameters after Adam steps: all but ``share`` of the elements (at least one may be
    off, however small the tree) within ``atol``, none of them further than ``worst``."""
    pairs = list(zip(*map(jax.tree.leaves, (got, want)), strict=True))
    assert pairs, "no parameters to compare"
    for a, b in pairs:
        assert np.shape(a) == np.shape(b), (np.shape(a), np.shape(b))
    diffs = np.concatenate(
        [np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).ravel() for a, b in pairs]
    )
    assert np.all(np.isfinite(diffs)), "non-finite parameters"
    off, allowed = int(np.sum(diffs > atol)), max(1, int(share * diffs.size))
    assert diffs.max() <= worst and off <= allowed, (
        f"{off} of {diffs.size} elements off by more than {atol:g} (allowed {allowed}); "
        f"worst {diffs.max():.3g} (allowed {worst:g})"
    )
