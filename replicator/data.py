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
slow: a batch's shuffled indices come from NumPy, its examples are read with
one call (`read_batch`) and stacked, and ``preprocess`` runs once on the whole
batch. grain iterates over the batches and can compute them on threads.
Decoding a stored example (about 30 us for an 8x8 digit, 100-200 us for a
28x28 PNG on a CPU core) costs a good part of what the small models of
``experiments/`` spend training on it, so `load_data_source` keeps the decoded
examples of a split that fits in memory (`CachedSource`), like tf.data's
``cache()``.
"""

import difflib
import functools
import json
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grain
import jax
import numpy as np
import tensorflow_datasets as tfds

Example = dict[str, Any]
Batch = dict[str, np.ndarray]

_FILE_FORMAT = "array_record"
# grain's MapDataset needs a length; the training stream is endless in practice.
_ENDLESS = 2**62


class DatasetNotPreparedError(ValueError):
    """A dataset's files are missing and cannot be built on this machine."""


def load_data_source(
    name: str,
    split: str,
    *,
    data_dir: str | None = None,
    prepare: bool = True,
    max_cache_bytes: int = 2**30,
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
        return CachedSource(source)
    return source


def _open_split(name: str, split: str, *, data_dir: str | None, prepare: bool) -> Sequence:
    builder = _get_builder(name, data_dir)
    if prepare and getattr(builder, "BUILDS_OFFLINE", False) and not builder.is_prepared():
        builder = _prepare_offline(name, data_dir)
    # Reading first and explaining failures after lets tfds.testing.mock_data,
    # which fakes as_data_source but not is_prepared, stand in for real files.
    try:
        return builder.as_data_source(split=split)
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
        self._lock = threading.Lock()

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
            with self._lock:  # Grain threads may fill the cache concurrently.
                self._fill(np.unique(indices[~self._filled[indices]]))
        return jax.tree.map(lambda column: column[indices], self._columns)

    def _fill(self, indices: np.ndarray) -> None:
        batch = _stack(_read_examples(self._source, indices))
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


def _check_feature_shapes(columns: Batch, batch: Batch) -> None:
    want = jax.tree.map(lambda x: (x.shape[1:], x.dtype), columns)
    got = jax.tree.map(lambda x: (x.shape[1:], x.dtype), batch)
    if want != got:
        raise ValueError(f"Examples differ in shape or dtype: {want} and {got}. {_FIXED_SHAPES}")


def read_batch(source: Sequence[Example], indices: Sequence[int]) -> Batch:
    """Reads the examples at ``indices`` as one batch: features stacked on a new axis 0.

    A `CachedSource` gathers them from memory; any other source is read with
    one ``__getitems__`` call where it has one (tfds data sources then read
    the records of several files in parallel).

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
    if isinstance(source, CachedSource):
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
