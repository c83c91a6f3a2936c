"""Reading a batch of examples: tfds records decoded a batch at a time (`RecordSource`)."""

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
import tensorflow_datasets as tfds
from array_record.python.array_record_data_source import ArrayRecordDataSource
from tensorflow_datasets.proto import tf_example_pb2

from replicator.errors import DatasetError

Example = dict[str, Any]
Batch = dict[str, np.ndarray]

_FILE_FORMAT = "array_record"
_DECODE = tfds.decode.DeserializeMethod.DESERIALIZE_AND_DECODE


class RecordSource(Sequence[Example]):
    """A tfds array_record split that decodes a batch of records at once.

    tfds decodes one record at a time, through several layers of Python per
    feature: about 30 us for an 8x8 digit, most of the cost of a batch. Here a
    batch's records are read with one call and parsed, then each feature is
    decoded for the whole batch: fixed-shape `tfds.features.Tensor` values
    (``ClassLabel`` and ``Scalar`` included) with one NumPy conversion, other
    features (``Image``: PNG/JPEG) by tfds' own per-value decoder. tfds'
    decoders pick OpenCV over PIL when it is installed, as replicator does:
    it decodes a 28x28 PNG in half PIL's time. Results equal tfds'
    ``source[i]``, stacked (scalars included: tfds makes them Python numbers,
    which stack as int64, float64 or bool). Only splits whose top-level
    features each store one value of fixed shape are wrapped; nested dicts,
    sequences and ragged features keep tfds' per-example path.

    Use `RecordSource.wrap`, which keeps any other source as it is.

    Args:
        source: a tfds ``ArrayRecordDataSource`` without custom decoders.
    """

    def __init__(self, source: Any):
        self._source = source
        self._records = source.data_source
        self._features = source.dataset_info.features
        self._decoders = {name: _batch_decoder(f) for name, f in self._features.items()}

    @classmethod
    def wrap(cls, source: Any) -> Sequence[Example]:
        """``RecordSource(source)`` if it can decode ``source`` by batch, else ``source``."""
        features = getattr(getattr(source, "dataset_info", None), "features", None)
        plain = (
            getattr(source, "decoders", True) is None
            and getattr(source, "deserialize_method", None) is _DECODE
            and isinstance(features, tfds.features.FeaturesDict)
            # Real files: tfds.testing.mock_data puts a mock here.
            and isinstance(getattr(source, "data_source", None), ArrayRecordDataSource)
            # One stored value of fixed shape per top-level feature: no nested
            # dicts, sequences or ragged dimensions.
            and all(_fixed_shape(f.get_serialized_info()) for f in features.values())
        )
        return cls(source) if plain else source

    def __len__(self) -> int:
        return len(self._source)

    def __getitem__(self, index: int) -> Example:  # type: ignore[override]
        return self._source[index]

    def read_batch(self, indices: Sequence[int]) -> Batch:
        """Returns the examples at ``indices`` stacked, like `read_batch`."""
        indices = [int(i) for i in indices]
        records = self._records.__getitems__(indices)
        if len(records) != len(indices):
            raise IndexError(f"Asked for {len(indices)} records, got {len(records)}.")
        columns: dict[str, list] = {name: [] for name in self._decoders}
        for index, record in zip(indices, records):
            stored = tf_example_pb2.Example.FromString(record).features.feature
            for name, values in columns.items():
                if name not in stored:
                    raise DatasetError(
                        f"Record {index} of {self._source!r} has no feature {name!r}."
                    )
                feature = stored[name]
                values.append(getattr(feature, feature.WhichOneof("kind")).value)
        return {name: self._decoders[name](values) for name, values in columns.items()}

    def __repr__(self) -> str:
        return f"RecordSource({self._source!r})"


def _fixed_shape(stored: Any) -> bool:
    return isinstance(stored, tfds.features.TensorInfo) and None not in stored.shape


def _batch_decoder(feature: tfds.features.FeatureConnector) -> Callable[[list], np.ndarray]:
    """Decodes one feature's stored values (one list per example) into a batch.

    Mirrors tfds' NumPy parser: the stored values become an array of the
    serialized dtype and shape (a scalar becomes a Python number, so scalars
    stack as int64, float64 or bool), and the feature decodes that.
    """
    stored = feature.get_serialized_info()
    dtype, shape = np.dtype(stored.np_dtype), tuple(stored.shape)
    if (
        isinstance(feature, tfds.features.Tensor)
        and shape == tuple(feature.shape)  # not encoded to bytes: decoding is a reshape
        and dtype.kind in "biuf"
        and dtype != np.uint64  # stored bitcast to int64
    ):
        # Numbers stored as int64 or float lists: one conversion for the batch.
        size = int(np.prod(shape))
        stacked = np.asarray(np.zeros((), dtype).item()).dtype if not shape else dtype

        def decode_numbers(values: list) -> np.ndarray:
            flat = np.fromiter(itertools.chain.from_iterable(values), dtype, len(values) * size)
            return flat.reshape(len(values), *shape).astype(stacked, copy=False)

        return decode_numbers

    def decode_each(values: list) -> np.ndarray:
        # Anything else (images, bytes-encoded tensors, text), one value at a time.
        return _stack_leaves(*(feature.decode_example_np(_parse(v, dtype, shape)) for v in values))

    return decode_each


def _parse(values: Any, dtype: np.dtype, shape: tuple[int, ...]) -> Any:
    value = np.array(values, dtype=dtype)
    return value.item() if not shape else value.reshape(shape)


_FIXED_SHAPES = (
    "Batches stack raw examples before preprocessing, so every feature needs one "
    "shape across the split."
)


def read_batch(source: Sequence[Example], indices: Sequence[int]) -> Batch:
    """Reads the examples at ``indices`` as one batch: features stacked on a new axis 0.

    A `CachedSource` gathers them from memory and a `RecordSource` decodes
    them a feature at a time; any other source is read with one
    ``__getitems__`` call where it has one.

    Args:
        source: random-access examples whose features have one shape each.
        indices: positions in ``source``, repeats allowed.

    Returns:
        A dict like an example's, each array with a leading axis of ``len(indices)``.

    Raises:
        ValueError: the examples' features differ in shape.

    >>> read_batch([{"x": np.float32(0)}, {"x": np.float32(1)}], [1, 1, 0])["x"].tolist()
    [1.0, 1.0, 0.0]
    """
    if hasattr(source, "read_batch"):  # RecordSource, CachedSource: a batch at once
        return source.read_batch(indices)
    return _stack(_read_examples(source, indices))


def _read_examples(source: Sequence[Example], indices: Sequence[int]) -> list[Example]:
    indices = [int(i) for i in indices]
    getitems = getattr(source, "__getitems__", None)
    # tfds' __getitems__ starts a thread pool per call: worth it for many reads only.
    if getitems is not None and len(indices) > 1:
        try:
            return list(getitems(indices))
        except TypeError:
            # tfds.testing.mock_data (tfds 4.9.10) installs a __getitems__ that
            # fails this way; reading one by one still works, or raises the real error.
            pass
    return [source[i] for i in indices]


def _stack(examples: Sequence[Example]) -> Batch:
    try:
        return jax.tree.map(_stack_leaves, *examples)
    except ValueError as e:
        raise DatasetError(f"Cannot stack examples into a batch: {e}. {_FIXED_SHAPES}") from e


def _stack_leaves(*leaves: Any) -> np.ndarray:
    stacked = np.stack(leaves)
    # Strings (tfds Text features) stack to the width of the longest in the
    # batch; as objects they keep one dtype across batches and the cache.
    return stacked.astype(object) if stacked.dtype.kind in "SU" else stacked
