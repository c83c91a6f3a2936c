"""The train and eval batch streams: step-indexed, per process, padded and masked.

* Training (``make_train_iterator``) is an endless, per-epoch reshuffled stream
  whose position can be saved and restored (``get_state`` / ``set_state``).
* Evaluation (``make_eval_iterator``) visits every example of a split exactly
  once across all processes. The last batches are padded and carry a ``mask``
  (False for padding), and every process yields the same number of batches,
  because SPMD processes must take every step together.
"""

import functools
import json
from collections.abc import Callable, Iterator, Sequence

import grain
import numpy as np

from replicator.errors import ConfigError
from replicator.trainer.data.records import Batch, Example, read_batch

# grain's MapDataset needs a length; the training stream is endless in practice.
_ENDLESS = 2**62


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
        raise ConfigError(
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
            raise ConfigError(
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
