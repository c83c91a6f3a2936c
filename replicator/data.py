"""Input pipeline: tfds array_record data sources, read by grain, split by process.

Each process reads only its own disjoint part of a split and yields
process-local numpy batches; ``Replicator.shard_batch`` / ``distribute`` then
assemble them into global arrays. TensorFlow is never needed: tfds writes and
reads array_record files, grain runs the batch pipeline.

* Training (``make_train_iterator``) is an endless, per-epoch reshuffled stream
  whose position can be saved and restored (``get_state`` / ``set_state``).
* Evaluation (``make_eval_iterator``) visits every example of a split exactly
  once across all processes. The last batches are padded and carry a ``mask``
  (False for padding), and every process yields the same number of batches,
  because SPMD processes must take every step together.

Both work a batch at a time, because per-example Python is what made loading
slow: a batch's shuffled indices come from NumPy, its records are read with one
call and decoded a feature at a time (`RecordSource`), and ``preprocess`` runs
once on the whole batch. A split that fits in memory is decoded once
(`CachedSource`, like tf.data's ``cache()``), by a background thread that
starts when the run opens its data, so the first epoch's decoding overlaps
compilation; later epochs are NumPy gathers. grain iterates over the batches
and can compute them on threads.
"""

import atexit
import difflib
import functools
import itertools
import json
import logging
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grain
import jax
import numpy as np
import tensorflow_datasets as tfds
from array_record.python.array_record_data_source import ArrayRecordDataSource
from tensorflow_datasets.proto import tf_example_pb2

Example = dict[str, Any]
Batch = dict[str, np.ndarray]

_FILE_FORMAT = "array_record"
# grain's MapDataset needs a length; the training stream is endless in practice.
_ENDLESS = 2**62
_DECODE = tfds.decode.DeserializeMethod.DESERIALIZE_AND_DECODE


class DatasetNotPreparedError(ValueError):
    """A dataset's files are missing and cannot be built on this machine."""


def load_data_source(
    name: str,
    split: str,
    *,
    data_dir: str | None = None,
    prepare: bool = True,
    max_cache_bytes: int = 2**30,
    fill_in_background: bool = False,
) -> Sequence[Example]:
    """Opens one split of a tfds dataset as a random-access data source.

    Builders that need no download (their class sets ``BUILDS_OFFLINE = True``,
    like ``digits`` in ``experiments.datasets``) are built under ``data_dir``
    on first use. Download-based builders (``mnist``, ``cifar10``, ...) must
    already be prepared there in array_record format; this function never
    downloads, so it cannot hang on a machine without network. Under
    ``tfds.testing.mock_data`` any registered dataset reads as fake examples.

    Args:
        name: tfds name, optionally with config and version (``"mnist:3.*.*"``).
            Builders defined in this repository are known to tfds once their
            module is imported (``import experiments.datasets``).
        split: tfds split, slices included (``"train"``, ``"train[:90%]"``).
        data_dir: root of the tfds data; None means tfds' default
            (``$TFDS_DATA_DIR`` or ``~/tensorflow_datasets``).
        prepare: build an offline dataset that is missing; with False a
            missing dataset is an error.
        max_cache_bytes: keep decoded examples in memory (`CachedSource`) if
            the whole split would take at most this many bytes, estimated from
            its first example; 0 never caches.
        fill_in_background: start decoding a cached split right away, on a
            thread (`CachedSource.fill_in_background`).

    Returns:
        A sequence of example dicts of numpy values with ``len`` and
        ``source[i]``, ready for `read_batch`, ``make_train_iterator`` and
        ``make_eval_iterator``.

    Raises:
        DatasetNotPreparedError: the dataset's files are missing; the message
            says where it looked and gives the command that prepares them.
        ValueError: unknown dataset or split, or files stored in a format
            without random access (TFRecord).

    >>> import experiments.datasets  # Registers "digits" with tfds.
    >>> source = load_data_source("digits", "test", data_dir=data_dir)
    >>> len(source), source[0]["image"].shape, int(source[0]["label"]) in range(10)
    (360, (8, 8, 1), True)
    """
    source = _open_split(name, split, data_dir=data_dir, prepare=prepare)
    if len(source) and len(source) * _num_bytes(source[0]) <= max_cache_bytes:
        source = CachedSource(source)
        if fill_in_background:
            source.fill_in_background()
    return source


def _open_split(name: str, split: str, *, data_dir: str | None, prepare: bool) -> Sequence:
    builder = _get_builder(name, data_dir)
    if prepare and getattr(builder, "BUILDS_OFFLINE", False) and not builder.is_prepared():
        builder = _prepare_offline(name, data_dir)
    # Reading first and explaining failures after lets tfds.testing.mock_data,
    # which fakes as_data_source but not is_prepared, stand in for real files.
    try:
        return RecordSource.wrap(builder.as_data_source(split=split))
    except (KeyError, ValueError, NotImplementedError) as e:
        if not builder.is_prepared():
            raise DatasetNotPreparedError(_not_prepared_message(name, builder, prepare)) from e
        raise ValueError(
            f"Cannot read split {split!r} of dataset {name!r} at {builder.data_dir}, which "
            f"has splits {sorted(builder.info.splits)} stored as "
            f"{builder.info.file_format.value}: {e}"
        ) from e


def _num_bytes(example: Example) -> int:
    return sum(np.asarray(leaf).nbytes for leaf in jax.tree.leaves(example))


def _get_builder(name: str, data_dir: str | None) -> tfds.core.DatasetBuilder:
    try:
        return tfds.builder(name, data_dir=data_dir, file_format=_FILE_FORMAT)
    except tfds.core.DatasetNotFoundError:
        # tfds' own message lists every known dataset; say something shorter.
        known = tfds.list_builders(with_community_datasets=False)
        close = difflib.get_close_matches(name.split(":")[0], known, n=5)
        raise ValueError(
            f"Unknown dataset {name!r}. Close matches: {close or 'none'}. "
            f"tfds knows {len(known)} datasets (tfds.list_builders()); builders "
            "defined in this repository register when their module is imported, "
            "e.g. `import experiments.datasets` for 'digits'."
        ) from None


def _prepare_offline(name: str, data_dir: str | None) -> tfds.core.DatasetBuilder:
    builder = _get_builder(name, data_dir)
    try:
        builder.download_and_prepare(file_format=_FILE_FORMAT)
    except OSError:
        # Processes sharing a data_dir race to rename their finished copy into
        # place; losing that race is fine, as long as someone won it.
        if not builder.is_prepared():
            raise
    # A fresh builder reads the dataset info back from the finished files.
    return _get_builder(name, data_dir)


def _not_prepared_message(name: str, builder: tfds.core.DatasetBuilder, prepare: bool) -> str:
    where = f"Dataset {name!r} is not prepared in {_FILE_FORMAT} format at {builder.data_dir}."
    if getattr(builder, "BUILDS_OFFLINE", False) and not prepare:
        return f"{where} It needs no download: call load_data_source(..., prepare=True)."
    return (
        f"{where}\nIts builder downloads the data, which replicator never does. On a "
        "machine with network and TensorFlow (tfds encodes images with it), run\n"
        f"  tfds build {name} --data_dir=DIR --file_format={_FILE_FORMAT}\n"
        f"then copy DIR/{builder.name} to {builder.data_dir_root}/{builder.name} here."
    )


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
                    raise ValueError(f"Record {index} of {self._source!r} has no feature {name!r}.")
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


class CachedSource(Sequence[Example]):
    """A data source that keeps in memory, stacked, every example it has read.

    Examples are decoded once, when first read, and then served from memory,
    so that from the second epoch on a batch costs one NumPy gather
    (`read_batch`). Every feature must have one shape across the split, as
    batching needs anyway. Reads return copies: preprocessing may change them.

    Args:
        source: random-access examples, e.g. a tfds data source.

    >>> source = CachedSource([{"x": np.arange(3)}, {"x": np.arange(3, 6)}])
    >>> source.read_batch([1, 0, 1])["x"].tolist()
    [[3, 4, 5], [0, 1, 2], [3, 4, 5]]
    """

    def __init__(self, source: Sequence[Example]):
        self._source = source
        self._filled = np.zeros(len(source), bool)
        self._columns: Batch | None = None  # Allocated at the first read, filled lazily.
        self._lock = threading.Lock()  # Guards _columns and _filled.
        self._filler: threading.Thread | None = None
        self._stop_filling = threading.Event()

    def fill_in_background(self, chunk_size: int = 1024) -> None:
        """Starts decoding the whole split, in order, on a daemon thread.

        Reads run meanwhile: they take what is already decoded and decode
        what is missing themselves. Started when a run opens its data, the
        first epoch's decoding overlaps model setup and compilation instead of
        the first steps. Decoding releases the GIL for most of its time
        (array_record reads, image codecs). A failure stops the filling and is
        logged; the read that needs the example raises it again.
        """
        if self._filler is None and not self._filled.all():
            self._filler = threading.Thread(
                target=self._fill_all, args=(chunk_size,), name="CachedSource", daemon=True
            )
            self._filler.start()
            _FILLING.add(self)

    def stop_filling(self) -> None:
        """Stops the background filling (after the chunk in progress) and waits for it."""
        self._stop_filling.set()
        if self._filler is not None:
            self._filler.join()

    def _fill_all(self, chunk_size: int) -> None:
        try:
            for start in range(0, len(self), chunk_size):
                if self._stop_filling.is_set():
                    return
                chunk = np.arange(start, min(start + chunk_size, len(self)))
                if not self._filled[chunk].all():
                    self._fill(chunk[~self._filled[chunk]])
        except Exception as e:  # noqa: BLE001  (the reader that needs the example re-raises)
            logging.warning("Stopped decoding %r in the background: %s", self._source, e)

    def __len__(self) -> int:
        return len(self._filled)

    def __getitem__(self, index: int) -> Example:  # type: ignore[override]
        if not -len(self) <= index < len(self):
            raise IndexError(f"index {index} is out of range for {len(self)} examples.")
        return jax.tree.map(lambda x: x[0], self.read_batch([index % len(self)]))

    def read_batch(self, indices: Sequence[int]) -> Batch:
        """Returns the examples at ``indices`` stacked, reading missing ones in one call."""
        indices = np.asarray(indices, np.int64)
        if not self._filled[indices].all():
            self._fill(np.unique(indices[~self._filled[indices]]))
        return jax.tree.map(lambda column: column[indices], self._columns)

    def _fill(self, indices: np.ndarray) -> None:
        # Decoding runs unlocked, so that grain threads and the background
        # filler decode side by side; two may decode the same example, once.
        batch = read_batch(self._source, indices)
        with self._lock:
            if self._columns is None:
                # np.zeros leaves untouched pages unallocated: memory grows as examples arrive.
                self._columns = jax.tree.map(
                    lambda x: np.zeros((len(self), *x.shape[1:]), x.dtype), batch
                )
            _check_feature_shapes(self._columns, batch)
            jax.tree.map(lambda column, x: column.__setitem__(indices, x), self._columns, batch)
            self._filled[indices] = True

    def __repr__(self) -> str:
        return f"CachedSource({self._source!r})"


# Sources still filling when the interpreter exits are stopped first: a daemon
# thread inside a decoder or array_record's thread pool at shutdown can crash it.
_FILLING: weakref.WeakSet[CachedSource] = weakref.WeakSet()


@atexit.register
def _stop_all_filling() -> None:
    for source in list(_FILLING):
        source.stop_filling()


def _check_feature_shapes(columns: Batch, batch: Batch) -> None:
    want = jax.tree.map(lambda x: (x.shape[1:], x.dtype), columns)
    got = jax.tree.map(lambda x: (x.shape[1:], x.dtype), batch)
    if want != got:
        raise ValueError(f"Examples differ in shape or dtype: {want} and {got}. {_FIXED_SHAPES}")


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
    if isinstance(source, (CachedSource, RecordSource)):
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
        raise ValueError(f"Cannot stack examples into a batch: {e}. {_FIXED_SHAPES}") from e


def _stack_leaves(*leaves: Any) -> np.ndarray:
    stacked = np.stack(leaves)
    # Strings (tfds Text features) stack to the width of the longest in the
    # batch; as objects they keep one dtype across batches and the cache.
    return stacked.astype(object) if stacked.dtype.kind in "SU" else stacked


def local_batch_size(global_batch_size: int, process_count: int) -> int:
    """Returns the batch size that each process loads.

    Args:
        global_batch_size: examples per step summed over all processes.
        process_count: number of processes (hosts) that load data.

    Returns:
        ``global_batch_size // process_count``.

    Raises:
        ValueError: if the global batch does not split evenly over processes.

    >>> local_batch_size(96, 4)
    24
    """
    if global_batch_size <= 0 or global_batch_size % process_count:
        raise ValueError(
            f"global_batch_size={global_batch_size} must be a positive multiple of "
            f"the number of processes, process_count={process_count}; every "
            "process loads an equal share of each batch."
        )
    return global_batch_size // process_count


def shard_bounds(num_examples: int, *, process_index: int, process_count: int) -> tuple[int, int]:
    """Returns the contiguous range of examples that one process reads.

    Args:
        num_examples: size of the split.
        process_index: this process.
        process_count: all processes.

    Returns:
        ``(start, end)``: process ``p`` reads ``[p * n // P, (p + 1) * n // P)``;
        the shards are disjoint, cover the split and differ in size by at most one.

    >>> [shard_bounds(10, process_index=p, process_count=3) for p in range(3)]
    [(0, 3), (3, 6), (6, 10)]
    """
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index={process_index} is not in [0, {process_count}).")
    start = process_index * num_examples // process_count
    return start, (process_index + 1) * num_examples // process_count


def _read_options(num_threads: int) -> grain.ReadOptions:
    # Threads pay off when reading waits on storage or decoding releases the
    # GIL; for examples served from memory they only contend for the GIL.
    return grain.ReadOptions(num_threads=num_threads, prefetch_buffer_size=2 * num_threads)


class _EpochShuffle:
    """The endless stream of positions ``range(size)``, reshuffled every epoch."""

    def __init__(self, size: int, seed: Sequence[int]):
        self._size, self._seed = size, tuple(seed)
        self._latest: tuple[int, np.ndarray] = (-1, np.empty(0, np.int64))

    def take(self, first: int, count: int) -> np.ndarray:
        """Positions ``first, ..., first + count - 1`` of the stream."""
        epochs, offsets = np.divmod(np.arange(first, first + count), self._size)
        parts = [self._permutation(int(e))[offsets[epochs == e]] for e in np.unique(epochs)]
        return np.concatenate(parts)

    def _permutation(self, epoch: int) -> np.ndarray:
        latest = self._latest  # One read: another thread may replace it meanwhile.
        if latest[0] != epoch:
            rng = np.random.default_rng([*self._seed, epoch])
            latest = self._latest = (epoch, rng.permutation(self._size))
        return latest[1]


def _read_train_batch(
    source: Sequence[Example],
    preprocess: Callable[[Batch], Batch],
    order: _EpochShuffle,
    global_batch_size: int,
    first_row: int,
    batch_size: int,
    batch_number: int,
) -> Batch:
    # This process's rows [first_row, first_row + batch_size) of global batch k.
    positions = order.take(batch_number * global_batch_size + first_row, batch_size)
    return preprocess(read_batch(source, positions))


class TrainIterator(Iterator[Batch]):
    """Endless training batches whose position can be saved and restored.

    Made by `make_train_iterator`. Batch ``k`` is a pure function of ``k`` and
    the iterator's arguments, so the position is just ``k``; the state also
    records the arguments that shape the stream, and restoring a state into an
    iterator over a different stream is an error.

    Args:
        batches: batch ``k`` of the stream at position ``k``.
        num_threads: grain threads that compute batches ahead.
        stream: what identifies the stream (seed, sizes, shard), saved with it.
    """

    def __init__(self, batches: grain.MapDataset, *, num_threads: int, stream: dict[str, int]):
        self._iterator = iter(batches.to_iter_dataset(_read_options(num_threads)))
        self._stream = stream

    def __next__(self) -> Batch:
        return next(self._iterator)

    def get_state(self) -> bytes:
        """The position after the last batch returned, as JSON bytes."""
        return json.dumps({"stream": self._stream, "grain": self._iterator.get_state()}).encode()

    def set_state(self, state: bytes) -> None:
        """Continues after the batch at which ``state`` was taken.

        Raises:
            ValueError: ``state`` comes from an iterator over another stream.
        """
        saved = json.loads(state)
        if not isinstance(saved, dict) or saved.get("stream") != self._stream:
            raise ValueError(
                f"Cannot restore the training iterator: the state was saved for the stream "
                f"{saved.get('stream') if isinstance(saved, dict) else saved!r}, but this "
                f"iterator reads {self._stream}. Resume with the same dataset split, seed "
                "and global batch size, or start from a new workdir."
            )
        self._iterator.set_state(saved["grain"])


def make_train_iterator(
    source: Sequence[Example],
    *,
    global_batch_size: int,
    preprocess: Callable[[Batch], Batch],
    seed: int,
    process_index: int,
    process_count: int,
    num_threads: int = 0,
) -> TrainIterator:
    """Returns this process's endless stream of shuffled training batches.

    The global stream is the whole split in a new order every epoch, drawn
    from ``seed`` and the epoch, cut into global batches that run across epoch
    boundaries. Process ``p`` reads only rows ``[p * b, (p + 1) * b)`` of each
    global batch (``b = global_batch_size // process_count``), the rows that
    its devices hold; the processes' rows are disjoint and together form the
    global batch. So the global batches are the same for any number of devices
    *and* processes (2 processes x 4 devices train exactly like 1 x 8), and the
    position, batch ``k``, can be restored on a different process count (on the
    same NumPy version, which draws the orders).

    Args:
        source: random-access examples, e.g. from ``load_data_source``.
        global_batch_size: examples per step over all processes.
        preprocess: maps a batch (the examples' dicts, stacked by
            `read_batch`) to the batch of numpy arrays that the step takes,
            keeping the leading batch axis. Elementwise NumPy code written for
            one example works unchanged.
        seed: shuffle seed, a non-negative integer.
        process_index: this process, ``jax.process_index()`` in a real run.
        process_count: all processes, ``jax.process_count()`` in a real run.
        num_threads: grain threads that compute batches ahead of the consumer;
            0 computes each batch when it is asked for. Threads help when the
            examples come from storage, not from a `CachedSource`.

    Returns:
        A `TrainIterator` of dicts of arrays with leading dimension
        ``global_batch_size // process_count``. Save its position with
        ``get_state()`` (bytes) and resume with ``set_state(state)``.

    Raises:
        ValueError: if ``global_batch_size`` does not divide by
            ``process_count``, the shard is empty or ``seed`` is negative.

    >>> source = [{"x": np.float32(i)} for i in range(10)]
    >>> it = make_train_iterator(source, global_batch_size=4, preprocess=dict, seed=0,
    ...                          process_index=1, process_count=2)
    >>> whole = make_train_iterator(source, global_batch_size=4, preprocess=dict, seed=0,
    ...                             process_index=0, process_count=1)
    >>> next(it)["x"].tolist() == next(whole)["x"][2:].tolist()  # rows 2-3 of global batch 0
    True
    """
    batch_size = local_batch_size(global_batch_size, process_count)
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index={process_index} is not in [0, {process_count}).")
    if seed < 0:
        raise ValueError(f"seed={seed} must be a non-negative integer.")
    order = _EpochShuffle(len(source), seed=(seed,))
    read = functools.partial(
        _read_train_batch,
        source,
        preprocess,
        order,
        global_batch_size,
        process_index * batch_size,
        batch_size,
    )
    # The stream does not depend on the process count, so neither does its state.
    stream = dict(num_examples=len(source), seed=seed, global_batch_size=global_batch_size)
    batches = grain.MapDataset.range(_ENDLESS).map(read)
    return TrainIterator(batches, num_threads=num_threads, stream=stream)


def num_eval_batches(num_examples: int, *, global_batch_size: int, process_count: int) -> int:
    """Returns how many batches every process yields to evaluate a split once.

    Args:
        num_examples: size of the split.
        global_batch_size: examples per step over all processes.
        process_count: number of processes.

    Returns:
        Batches per process: enough for the largest shard, ``ceil(num_examples /
        process_count)`` examples.

    >>> num_eval_batches(360, global_batch_size=48, process_count=3)  # 120 each, 16 a batch.
    8
    """
    batch_size = local_batch_size(global_batch_size, process_count)
    largest_shard = -(-num_examples // process_count)
    return -(-largest_shard // batch_size)


def _read_eval_batch(
    source: Sequence[Example],
    preprocess: Callable[[Batch], Batch],
    start: int,
    end: int,
    batch_size: int,
    batch_number: int,
) -> Batch:
    positions = start + batch_number * batch_size + np.arange(batch_size)
    mask = positions < end
    # Padding repeats example 0, so that it holds finite, well-typed values.
    batch = preprocess(read_batch(source, np.where(mask, positions, 0)))
    return {**batch, "mask": mask}


def make_eval_iterator(
    source: Sequence[Example],
    *,
    global_batch_size: int,
    preprocess: Callable[[Batch], Batch],
    process_index: int,
    process_count: int,
    num_threads: int = 0,
) -> Iterator[Batch]:
    """Returns this process's batches for one pass over a split, padded and masked.

    Process ``p`` reads its `shard_bounds` in order, so the processes together
    see every example exactly once. Each yields ``num_eval_batches(...)``
    batches; positions past its shard are filled with a copy of example 0
    whose ``mask`` is False. Weigh losses and metrics by ``mask`` and count
    examples as ``mask.sum()``.

    Args:
        source: random-access examples, e.g. from ``load_data_source``.
        global_batch_size: examples per step over all processes.
        preprocess: maps a stacked batch to a batch, as in `make_train_iterator`.
        process_index: this process, ``jax.process_index()`` in a real run.
        process_count: all processes, ``jax.process_count()`` in a real run.
        num_threads: grain threads that compute batches ahead of the consumer.

    Returns:
        A finite iterator of dicts of arrays with leading dimension
        ``global_batch_size // process_count``, plus a boolean ``mask``.

    Raises:
        ValueError: if ``global_batch_size`` does not divide by ``process_count``.

    >>> source = [{"x": np.float32(i)} for i in range(5)]
    >>> batches = list(make_eval_iterator(source, global_batch_size=4, preprocess=dict,
    ...                                   process_index=0, process_count=1))
    >>> [b["mask"].tolist() for b in batches]
    [[True, True, True, True], [True, False, False, False]]
    """
    batch_size = local_batch_size(global_batch_size, process_count)
    num_batches = num_eval_batches(
        len(source), global_batch_size=global_batch_size, process_count=process_count
    )
    start, end = shard_bounds(len(source), process_index=process_index, process_count=process_count)
    read = functools.partial(_read_eval_batch, source, preprocess, start, end, batch_size)
    batches = grain.MapDataset.range(num_batches).map(read)
    return iter(batches.to_iter_dataset(_read_options(num_threads)))
