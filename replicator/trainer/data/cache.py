"""Decoded splits kept in memory (`CachedSource`), filled in the background."""

import atexit
import logging
import threading
import weakref
from collections.abc import Sequence

import jax
import numpy as np

from replicator.errors import DatasetError
from replicator.trainer.data.records import _FIXED_SHAPES, Batch, Example, read_batch


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
        self._claimed = np.zeros(len(source), bool)  # Being decoded by some thread now.
        self._lock = threading.Lock()  # Guards _columns, _filled and _claimed.
        self._decoded = threading.Condition(self._lock)
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
                self._decode(self._claim(chunk))  # Skips what a reader is decoding.
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
        """Decodes the missing ``indices``, waiting for those another thread is decoding."""
        while True:
            mine = self._claim(indices)
            if mine.size:
                self._decode(mine)
                continue
            with self._lock:
                missing = ~self._filled[indices]
                if not missing.any():
                    return
                if self._claimed[indices[missing]].all():
                    self._decoded.wait()  # Whoever claimed them notifies, even on failure.

    def _claim(self, indices: np.ndarray) -> np.ndarray:
        """Marks the ``indices`` nobody has decoded or is decoding as ours; returns them."""
        with self._lock:
            mine = indices[~self._filled[indices] & ~self._claimed[indices]]
            self._claimed[mine] = True
        return mine

    def _decode(self, indices: np.ndarray) -> None:
        # Decoding runs unlocked, so that grain threads and the background
        # filler decode side by side, each example once.
        if not indices.size:
            return
        try:
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
        finally:
            with self._lock:
                self._claimed[indices] = False
                self._decoded.notify_all()

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
        raise DatasetError(f"Examples differ in shape or dtype: {want} and {got}. {_FIXED_SHAPES}")
