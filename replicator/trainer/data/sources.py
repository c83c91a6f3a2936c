"""Opening tfds splits as random-access sources: prepared data, or built offline.

TensorFlow is never needed: tfds writes and reads array_record files. A split
that fits in memory is wrapped in a `CachedSource`, decoded once in the
background; others are read a batch at a time through `RecordSource`.
"""

import difflib
from collections.abc import Sequence

import jax
import numpy as np
import tensorflow_datasets as tfds

from replicator.trainer.data.cache import CachedSource
from replicator.trainer.data.records import _FILE_FORMAT, Example, RecordSource


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
