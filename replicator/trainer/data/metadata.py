"""One example shaped like a dataset's, from its metadata: compiling without the data.

``python -m replicator compile`` (and ``launch tpu``'s pre-flight, which runs it)
needs the shapes and dtypes of an example, not the example: `example_from_metadata`
makes one of zeros from the features a tfds builder declares, read from the
builder's code or from a local data_dir's ``dataset_info.json``. A ``gs://``
data_dir is never opened (a laptop without the bucket's credentials compiles all
the same), and a dataset of one's own that is built on first use is not built.

Where the metadata cannot say (a feature without a fixed shape, such as
imagenet's images; a ``'module:function'`` or ``'array_record:PATTERN'`` dataset,
which declares no features), there is no example and the reason says why: the
caller then reads one example from the data.
"""

from __future__ import annotations

import dataclasses
import tempfile
from typing import Any

import numpy as np
import tensorflow_datasets as tfds

from replicator import storage
from replicator.trainer.data import user_sources
from replicator.trainer.data.records import _FILE_FORMAT, Example


@dataclasses.dataclass(frozen=True)
class ShapedExample:
    """What the metadata says of a dataset's examples.

    Attributes:
      example: one example of zeros with each feature's shape and dtype; None where
        the metadata cannot say.
      how: where the shapes come from, or why the metadata cannot give them.
    """

    example: Example | None
    how: str


def example_from_metadata(name: str, data_dir: str | None = None) -> ShapedExample:
    """An example of zeros shaped as dataset ``name``'s features declare.

    Args:
      name: a tfds name (with config and version, as `load_data_source` takes it),
        a ``'module:BuilderClass'``, or a dataset of one's own (no metadata).
      data_dir: the data_dir the run reads; a local one's prepared metadata is
        used, a bucket is never opened (the builder's code declares the features).

    Returns:
      A `ShapedExample`.

    >>> import experiments.datasets  # registers "digits"
    >>> shaped = example_from_metadata("digits", "gs://no-such-bucket/tfds")
    >>> {k: (v.shape, v.dtype.name) for k, v in shaped.example.items()}
    {'image': ((8, 8, 1), 'uint8'), 'label': ((), 'int64')}
    >>> shaped.how
    'shapes from the metadata of digits (tfds features); the dataset was not read'
    >>> example_from_metadata("my_data:make_source").example is None
    True
    """
    builder_name = _builder_name(name)
    if builder_name is None:
        return ShapedExample(None, f"{name!r} is a dataset of your own: it declares no shapes")
    try:
        features = _features(builder_name, data_dir)
    except tfds.core.DatasetNotFoundError:
        return ShapedExample(None, f"tfds knows no dataset {name!r}")
    unfixed = [
        f"{key} {info.shape}"
        for key, info in _flat(features).items()
        if any(d is None for d in info.shape)
    ]
    if unfixed:
        return ShapedExample(
            None, f"{builder_name}'s metadata gives no fixed shape to {', '.join(unfixed)}"
        )
    example = _zeros(features)
    how = f"shapes from the metadata of {builder_name} (tfds features); the dataset was not read"
    return ShapedExample(example, how)


def _builder_name(name: str) -> str | None:
    """The tfds name ``name`` stands for, or None for a function or array_record dataset."""
    if not user_sources.is_user_source(name):
        return name
    if name.startswith(user_sources.ARRAY_RECORD):
        return None
    try:
        builder_class = user_sources.builder_class(name)
    except Exception:  # noqa: BLE001  (reading it will say what is wrong, in its own words)
        return None
    return None if builder_class is None else builder_class.name


def _features(name: str, data_dir: str | None) -> dict[str, Any]:
    """The builder's ``get_tensor_info()``: from a local data_dir (a prepared dataset's
    info, else its code); with a bucket, from the code alone, in an empty directory."""
    if data_dir is not None and storage.is_remote(data_dir):
        with tempfile.TemporaryDirectory() as empty:
            return _tensor_info(name, empty)
    return _tensor_info(name, data_dir)


def _tensor_info(name: str, data_dir: str | None) -> dict[str, Any]:
    # tfds reads pre-computed metadata from its own bucket only when asked to (its
    # GCS access is off by default): a builder whose data is absent takes its code's.
    builder = tfds.builder(name, data_dir=data_dir, file_format=_FILE_FORMAT)
    return builder.info.features.get_tensor_info()


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{key}/"))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _zeros(tree: dict[str, Any]) -> Example:
    """Zeros of each feature's shape and dtype (an empty string for text)."""
    example = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            example[key] = _zeros(value)
            continue
        dtype = np.dtype(value.np_dtype)
        if dtype.kind in "OSU":
            example[key] = np.full(value.shape, b"", dtype=object)
        else:
            example[key] = np.zeros(value.shape, dtype)
    return example
