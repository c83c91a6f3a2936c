"""Input pipeline: tfds array_record data sources, read by grain, split by process.

Each process reads only its own disjoint part of a split and yields
process-local numpy batches; ``Replicator.shard_batch`` / ``distribute`` then
assemble them into global arrays. TensorFlow is never needed: tfds writes and
reads array_record files, grain samples, preprocesses and batches them.

* Training (``make_train_iterator``) is an endless, per-epoch reshuffled stream
  whose position can be saved and restored (``get_state`` / ``set_state``).
* Evaluation (``make_eval_iterator``) visits every example of a split exactly
  once across all processes. The last batches are padded and carry a ``mask``
  (False for padding), and every process yields the same number of batches,
  because SPMD processes must take every step together.
"""

import difflib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grain
import numpy as np
import tensorflow_datasets as tfds

Example = dict[str, Any]
Batch = dict[str, np.ndarray]

_FILE_FORMAT = "array_record"


class DatasetNotPreparedError(ValueError):
    """A dataset's files are missing and cannot be built on this machine."""


def load_data_source(
    name: str, split: str, *, data_dir: str | None = None, prepare: bool = True
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

    Returns:
        A sequence of example dicts of numpy values, with ``len`` and fast
        ``source[i]``, ready for ``make_train_iterator``/``make_eval_iterator``.

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


class _Preprocess(grain.transforms.Map):
    """Runs a user's per-example function as a grain transform (picklable for workers)."""

    def __init__(self, fn: Callable[[Example], Example]):
        self._fn = fn

    def map(self, element: Example) -> Example:
        return self._fn(element)


def make_train_iterator(
    source: Sequence[Example],
    *,
    global_batch_size: int,
    preprocess: Callable[[Example], Example],
    seed: int,
    process_index: int,
    process_count: int,
    worker_count: int = 0,
) -> grain.DataLoaderIterator:
    """Returns this process's endless stream of shuffled training batches.

    The split is cut into ``process_count`` contiguous, disjoint shards (sizes
    differ by at most one); this process reads shard ``process_index``,
    reshuffled every epoch from ``seed``. Batches run across epoch boundaries.

    Args:
        source: random-access examples, e.g. from ``load_data_source``.
        global_batch_size: examples per step over all processes.
        preprocess: maps one example dict to a dict of numpy arrays. With
            ``worker_count > 0`` it must be picklable (a module-level function).
        seed: shuffle seed, an integer in [0, 2**32).
        process_index: this process, ``jax.process_index()`` in a real run.
        process_count: all processes, ``jax.process_count()`` in a real run.
        worker_count: grain worker processes for preprocessing; 0 runs it here.
            Each worker batches its own share of the records, so the batch
            sequence depends on it, and a saved state restores only with the
            same count. Workers read absl flags: parse them first (absl.app.run).

    Returns:
        An iterator of dicts of arrays with leading dimension
        ``global_batch_size // process_count``. Save its position with
        ``get_state()`` (bytes) and resume with ``set_state(state)``.

    Raises:
        ValueError: if ``global_batch_size`` does not divide by ``process_count``.

    >>> source = [{"x": np.float32(i)} for i in range(10)]
    >>> it = make_train_iterator(source, global_batch_size=4, preprocess=dict, seed=0,
    ...                          process_index=1, process_count=2)
    >>> next(it)["x"].shape
    (2,)
    """
    batch_size = local_batch_size(global_batch_size, process_count)
    shard = grain.sharding.ShardOptions(shard_index=process_index, shard_count=process_count)
    sampler = grain.samplers.IndexSampler(
        num_records=len(source), shard_options=shard, shuffle=True, num_epochs=None, seed=seed
    )
    loader = grain.DataLoader(
        data_source=source,
        sampler=sampler,
        operations=[
            _Preprocess(preprocess),
            grain.transforms.Batch(batch_size, drop_remainder=True),
        ],
        worker_count=worker_count,
        shard_options=shard,
    )
    return iter(loader)


class _MaskedShard(grain.transforms.Map):
    """Maps position i of a padded shard to its example, padding with masked-out example 0."""

    def __init__(self, source: Sequence[Example], preprocess: Callable, start: int, end: int):
        self._source, self._preprocess = source, preprocess
        self._start, self._end = start, end

    def map(self, element: int) -> Example:
        is_real = self._start + element < self._end
        # Padding reuses a real example so that it holds finite, well-typed values.
        example = self._preprocess(self._source[self._start + element if is_real else 0])
        return {**example, "mask": np.asarray(is_real)}


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


def make_eval_iterator(
    source: Sequence[Example],
    *,
    global_batch_size: int,
    preprocess: Callable[[Example], Example],
    process_index: int,
    process_count: int,
) -> Iterator[Batch]:
    """Returns this process's batches for one pass over a split, padded and masked.

    Process ``p`` reads the contiguous examples
    ``[p * n // process_count, (p + 1) * n // process_count)`` in order, so the
    processes together see every example exactly once. Each yields
    ``num_eval_batches(...)`` batches; positions past its shard are filled with
    a copy of example 0 whose ``mask`` is False. Weigh losses and metrics by
    ``mask`` and count examples as ``mask.sum()``.

    Args:
        source: random-access examples, e.g. from ``load_data_source``.
        global_batch_size: examples per step over all processes.
        preprocess: maps one example dict to a dict of numpy arrays.
        process_index: this process, ``jax.process_index()`` in a real run.
        process_count: all processes, ``jax.process_count()`` in a real run.

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
    start = process_index * len(source) // process_count
    end = (process_index + 1) * len(source) // process_count
    positions = grain.MapDataset.range(num_batches * batch_size)
    batches = positions.map(_MaskedShard(source, preprocess, start, end)).batch(batch_size)
    return iter(batches.to_iter_dataset())
