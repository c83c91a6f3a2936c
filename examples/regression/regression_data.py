"""A synthetic regression data set, made with NumPy: a data function for ``dataset``.

``config.dataset = "regression_data:make_source"`` names `make_source` in this
file; ``python -m replicator`` imports it from the config file's directory. The
trainer calls ``make_source(split)`` for the config's ``train_split`` and
``eval_split`` in every process, then reads each process's rows of it through
its own iterators (shuffled, resumable, exact in eval), as it does tfds data.

Each example is ``{"x": float32[8], "y": float32}`` with
``y = x @ w + 0.5 * sin(2 * x[0]) + noise``: a linear part, a curve a linear
model cannot fit, and noise of standard deviation 0.05 (the lowest mean squared
error any model can reach is 0.0025).

The same examples as array_record files, for
``dataset='array_record:DIR/{split}.array_record'``::

    .venv/bin/python examples/regression/regression_data.py DIR
"""

import os
import sys

import numpy as np

NUM_FEATURES = 8
NOISE = 0.05
SIZES = {"train": 16384, "test": 1024}
_SEEDS = {"train": 1, "test": 2}  # each split its own draw; the target's weights: seed 0


class Examples:
    """Rows of arrays, one example each: the random-access protocol the trainer
    reads (``len(source)`` and ``source[i]`` -> a dict of numpy arrays). A list
    of such dicts would do as well; arrays keep a large split compact."""

    def __init__(self, x: np.ndarray, y: np.ndarray):
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        return {"x": self.x[index], "y": self.y[index]}


def make_source(split: str) -> Examples:
    """The ``split`` ("train": 16,384 examples, "test": 1,024), the same on every machine.

    >>> source = make_source("test")
    >>> len(source), source[0]["x"].shape, source[0]["y"].dtype
    (1024, (8,), dtype('float32'))
    """
    if split not in SIZES:
        raise ValueError(f"the splits are {sorted(SIZES)}, not {split!r}")
    weights = np.random.default_rng(0).normal(size=NUM_FEATURES) / np.sqrt(NUM_FEATURES)
    rng = np.random.default_rng(_SEEDS[split])
    x = rng.normal(size=(SIZES[split], NUM_FEATURES))
    noise = NOISE * rng.normal(size=SIZES[split])
    y = x @ weights + 0.5 * np.sin(2 * x[:, 0]) + noise
    return Examples(x.astype(np.float32), y.astype(np.float32))


def write_records(directory: str) -> list[str]:
    """Writes each split's examples, in order, to ``DIRECTORY/SPLIT.array_record``.

    Returns:
      The files written.
    """
    from replicator.trainer import data  # write_array_records: flax msgpack, one a record

    paths = []
    for split in SIZES:
        source = make_source(split)
        paths.append(os.path.join(directory, f"{split}.array_record"))
        data.write_array_records(paths[-1], (source[i] for i in range(len(source))))
    return paths


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(f"usage: python {sys.argv[0]} DIRECTORY")
    for written in write_records(sys.argv[1]):
        print(written)
