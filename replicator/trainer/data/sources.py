"""Opening a dataset's split as a random-access source: tfds data, or data of one's own.

A dataset is a tfds name, prepared or built where it is (`load_data_source`),
or one's own: a Python function ``'module:function'`` or array_record files
``'array_record:PATTERN'`` (`replicator.trainer.data.user_sources`).
TensorFlow is never needed: tfds writes and reads array_record files. A split
that fits in memory is wrapped in a `CachedSource`, decoded once in the
background; others are read a batch at a time through `RecordSource`.

tfds builders come in two kinds. Those of tfds' own catalog (``mnist``,
``cifar10``, ...) download their data: replicator never prepares them, so it
cannot hang on a machine without network; they are prepared elsewhere with
``tfds build``. Any other builder, one defined in your package or in
``experiments.datasets``, is yours: it is prepared where it is (under
``data_dir``) on first use, as ``tfds.load`` would, with no flag to set.

A data_dir may be a bucket (``gs://...``). ArrayRecord cannot read or write
there (see `replicator.trainer.data.remote`), so each machine reads the
dataset's version from a copy on its own disk, made on first use, and a
dataset of your own missing from the bucket is built on a disk and uploaded.
"""

import difflib
import os
import re
from collections.abc import Sequence

import jax
import numpy as np
import tensorflow_datasets as tfds

from replicator import storage
from replicator.errors import DatasetError
from replicator.errors import DatasetNotPreparedError as DatasetNotPreparedError
from replicator.runtime import compat
from replicator.trainer.data import remote, user_sources
from replicator.trainer.data.cache import CachedSource
from replicator.trainer.data.records import _FILE_FORMAT, Example, RecordSource


def load_data_source(
    name: str,
    split: str,
    *,
    data_dir: str | None = None,
    prepare: bool = True,
    max_cache_bytes: int = 2**30,
    fill_in_background: bool = False,
    cache_dir: str | os.PathLike | None = None,
) -> Sequence[Example]:
    """Opens one split of a dataset as a random-access data source.

    ``name`` is a tfds name, or one's own data (`replicator.trainer.data.user_sources`:
    ``'MODULE:FUNCTION'``, ``'MODULE:BuilderClass'``, ``'array_record:PATTERN'``). tfds builders
    of your own (outside tfds' catalog: in your package, beside your config, or ``digits`` in
    ``experiments.datasets``) are built under ``data_dir`` on first use. tfds' catalog builders
    (``mnist``, ``cifar10``, ...) must already be prepared there in array_record format; this
    function never downloads, so it cannot hang on a machine without network. Under
    ``tfds.testing.mock_data`` any registered dataset reads as fake examples.

    A ``gs://`` data_dir is read through a local copy of the dataset's version directory under
    ``cache_dir``, made once per machine (the processes of one machine share it). A dataset of
    your own missing from the bucket is built locally by each machine, and process 0 uploads it;
    a catalog one must be put there first (the error says how).

    Args:
        name: tfds name, optionally with config and version (``"mnist:3.*.*"``;
            a builder is known once its module is imported), or one's own.
        split: split name, tfds' slices included (``"train"``, ``"train[:90%]"``).
        data_dir: root of the tfds data; None means tfds' default
            (``$TFDS_DATA_DIR`` or ``~/tensorflow_datasets``). A function that
            takes ``data_dir`` gets it as it is.
        prepare: build a dataset of your own that is missing; with False a
            missing dataset is an error.
        max_cache_bytes: keep decoded examples in memory (`CachedSource`) if
            the whole split would take at most this many bytes, estimated from
            its first example; 0 never caches.
        fill_in_background: start decoding a cached split right away, on a
            thread (`CachedSource.fill_in_background`).
        cache_dir: where copies of data in a bucket are kept (default
            ``$XDG_CACHE_HOME/replicator/tfds``, i.e. ``~/.cache/...``); a
            bucket's ``gs://B/P`` is copied to ``cache_dir/B/P``.

    Returns:
        A sequence of example dicts of numpy values with ``len`` and
        ``source[i]``, ready for `read_batch`, ``make_train_iterator`` and
        ``make_eval_iterator``.

    Raises:
        DatasetNotPreparedError: the dataset's files are missing; the message
            says where it looked and gives the command that prepares them.
        ValueError: unknown dataset or split, or files stored in a format
            without random access (TFRecord); a `ConfigError` for a function or
            array_record dataset that cannot be read as asked.
        replicator.storage.StorageError: a bucket data_dir that does not
            exist, cannot be read, or does not answer.

    >>> import tempfile, experiments.datasets  # (the latter registers "digits" with tfds)
    >>> data_dir = tempfile.TemporaryDirectory()  # a dataset of one's own is built there
    >>> source = load_data_source("digits", "test", data_dir=data_dir.name)  # doctest: +ELLIPSIS
    Downloading and preparing dataset ...
    >>> len(source), source[0]["image"].shape, int(source[0]["label"]) in range(10)
    (360, (8, 8, 1), True)
    >>> own = load_data_source("experiments.datasets.digits:make_source", "test")
    >>> len(own), own[0]["image"].tolist() == source[0]["image"].tolist()
    (360, True)
    >>> data_dir.cleanup()
    """
    tfds_name = _tfds_name(name)
    if tfds_name is None:
        source = user_sources.open_split(name, split, data_dir=data_dir, cache_dir=cache_dir)
    else:
        source = _open_split(
            tfds_name, split, data_dir=data_dir, prepare=prepare, cache_dir=cache_dir
        )
    if len(source) and len(source) * _num_bytes(source[0]) <= max_cache_bytes:
        source = CachedSource(source)
        if fill_in_background:
            source.fill_in_background()
    return source


def prepare_dataset(
    name: str,
    data_dir: str | os.PathLike | None = None,
    *,
    cache_dir: str | os.PathLike | None = None,
) -> str:
    """Prepares an offline tfds dataset in ``data_dir``, a local directory or a bucket.

    Does nothing where the dataset is prepared already. Into a bucket, the
    dataset is built locally (under ``cache_dir``, where it stays as this
    machine's copy) and uploaded, its metadata last, so that a run reading the
    bucket meanwhile never takes a partial upload for the dataset; one printed
    line then names the bucket's copy, which the runs read.

    Args:
        name: tfds name, optionally with config and version, of a builder of
            your own (not of tfds' catalog, whose builders download).
        data_dir: root of the tfds data, local or ``gs://``; None means tfds'
            default (``$TFDS_DATA_DIR`` or ``~/tensorflow_datasets``).
        cache_dir: where the local build for a bucket goes (as for
            `load_data_source`).

    Returns:
        The dataset's version directory, ``DATA_DIR/NAME/CONFIG/VERSION``.

    Raises:
        DatasetNotPreparedError: the dataset is missing and its builder needs a
            download; the message says how to build it elsewhere and copy it in.
        replicator.storage.StorageError: the bucket does not exist, cannot be
            written, or does not answer.

    >>> import tempfile
    >>> import experiments.datasets  # Registers "digits" with tfds.
    >>> data_dir = tempfile.TemporaryDirectory()
    >>> prepare_dataset("digits", data_dir.name)  # doctest: +ELLIPSIS
    Downloading and preparing dataset ...
    '.../digits/1.0.0'
    >>> prepare_dataset("digits", data_dir.name)  # prepared: nothing done  # doctest: +ELLIPSIS
    '.../digits/1.0.0'
    >>> data_dir.cleanup()
    """
    name = _tfds_name(name) or name
    if data_dir is not None and storage.is_remote(data_dir):
        builder = _bucket_builder(name, storage.normalize(data_dir))
        version_url = storage.normalize(builder.data_dir)
        if not remote.is_uploaded(version_url):
            if not builds_here(builder):
                raise DatasetNotPreparedError(_not_prepared_message(name, builder, True))
            local_dir = _build_copy(name, builder, cache_dir)
            remote.upload(local_dir, version_url)
            # tfds reports the build in this machine's copy; the runs read the bucket's.
            print(f"Dataset {name} prepared in {version_url} (uploaded from {local_dir}).")
        else:
            print(f"Dataset {name} is prepared in {version_url} already.")
        return version_url
    builder = _get_builder(name, data_dir)
    if not builder.is_prepared():
        if not builds_here(builder):
            raise DatasetNotPreparedError(_not_prepared_message(name, builder, True))
        builder = _prepare_offline(name, data_dir)
    return os.fspath(builder.data_dir)


def prepare_own(name: str, data_dir: str | os.PathLike | None = None) -> None:
    """Builds ``name`` now where it is a tfds builder of your own, local and missing (the
    text, chat and preference builders): the CLI calls it before the workdir is touched,
    so that a mistake in the data (a file that does not parse, a conversation without
    an assistant turn) is one line and leaves nothing behind. Data in a bucket, tfds'
    catalog and datasets of functions are opened as the run starts, as before."""
    tfds_name = _tfds_name(name)
    if tfds_name is None or (data_dir is not None and storage.is_remote(data_dir)):
        return
    builder = _get_builder(tfds_name, data_dir)
    if builds_here(builder) and not builder.is_prepared():
        _prepare_offline(tfds_name, data_dir)


def summary(name: str, data_dir: str | os.PathLike | None, split: str) -> str | None:
    """A prepared local dataset's one line on ``split`` (its base name: ``train`` of
    ``train[:90%]``), for the start of a run, where its builder has a ``summary(split)``
    (the chat builders: conversations, windows, trained tokens); else None."""
    tfds_name = _tfds_name(name)
    if tfds_name is None or (data_dir is not None and storage.is_remote(data_dir)):
        return None
    builder = _get_builder(tfds_name, data_dir)
    base = re.split(r"[\[+]", split, maxsplit=1)[0]
    if not hasattr(builder, "summary") or not builder.is_prepared():
        return None
    return builder.summary(base) if base in builder.info.splits else None


def builds_here(builder: tfds.core.DatasetBuilder) -> bool:
    """Whether `load_data_source` prepares ``builder``'s dataset where it is on first
    use: any builder of your own does; those of tfds' catalog download, so never."""
    return not type(builder).__module__.startswith("tensorflow_datasets.")


def _tfds_name(name: str) -> str | None:
    """The tfds name ``name`` stands for ('module:Class' of a builder: the builder's),
    or None for a function or array_record dataset."""
    if not user_sources.is_user_source(name):
        return name
    builder_class = user_sources.builder_class(name)
    return None if builder_class is None else builder_class.name


def _open_split(
    name: str,
    split: str,
    *,
    data_dir: str | None,
    prepare: bool,
    cache_dir: str | os.PathLike | None = None,
) -> Sequence:
    bucket_builder = None
    if data_dir is not None and storage.is_remote(data_dir):
        bucket_builder = _bucket_builder(name, storage.normalize(data_dir))
        data_dir = _local_copy(name, bucket_builder, prepare=prepare, cache_dir=cache_dir)
    builder = _get_builder(name, data_dir)
    if prepare and builds_here(builder) and not builder.is_prepared():
        builder = _prepare_offline(name, data_dir)
    # Reading first and explaining failures after lets tfds.testing.mock_data,
    # which fakes as_data_source but not is_prepared, stand in for real files.
    try:
        return RecordSource.wrap(builder.as_data_source(split=split))
    except (KeyError, ValueError, NotImplementedError) as e:
        if not builder.is_prepared():
            message = _not_prepared_message(name, bucket_builder or builder, prepare)
            raise DatasetNotPreparedError(message) from e
        raise DatasetError(
            f"Cannot read split {split!r} of dataset {name!r} at {builder.data_dir}, which "
            f"has splits {sorted(builder.info.splits)} stored as "
            f"{builder.info.file_format.value}: {e}"
        ) from e


def _num_bytes(example: Example) -> int:
    return sum(np.asarray(leaf).nbytes for leaf in jax.tree.leaves(example))


def _get_builder(name: str, data_dir: str | None) -> tfds.core.DatasetBuilder:
    try:
        return tfds.builder(name, data_dir=data_dir, file_format=_FILE_FORMAT)
    except DatasetError:
        raise
    except tfds.core.DatasetNotFoundError:
        # tfds' own message lists every known dataset; say something shorter.
        known = tfds.list_builders(with_community_datasets=False)
        close = difflib.get_close_matches(name.split(":")[0], known, n=5)
        raise DatasetError(
            f"Unknown dataset {name!r}. Close matches: {close or 'none'}. "
            f"tfds knows {len(known)} datasets (tfds.list_builders()); a builder of "
            "your own registers when its module is imported: import it in your "
            "experiment's module (as experiments.classify imports experiments.datasets "
            "for 'digits'), or name it as the dataset 'module:BuilderClass'."
        ) from None
    except ValueError as e:  # a builder's config or arguments that do not exist or fit
        raise DatasetError(f"dataset {name!r}: {e}") from None


def _prepare_offline(name: str, data_dir: str | None) -> tfds.core.DatasetBuilder:
    builder = _get_builder(name, data_dir)
    try:
        builder.download_and_prepare(file_format=_FILE_FORMAT)
    except ModuleNotFoundError as e:
        if e.name != "importlib_resources":
            raise
        # tfds 4.9.10 imports it for a builder that lives in a package, without
        # depending on it (tensorflow/datasets#11212).
        raise DatasetError(
            f"Building {name!r} ({type(builder).__module__}) needs the importlib_resources "
            "package, which tfds uses for builders in a package but does not install: "
            "pip install importlib_resources"
        ) from e
    except OSError:
        # Processes sharing a data_dir race to rename their finished copy into
        # place; losing that race is fine, as long as someone won it.
        if not builder.is_prepared():
            raise
    # A fresh builder reads the dataset info back from the finished files.
    return _get_builder(name, data_dir)


def _bucket_builder(name: str, data_dir: str) -> tfds.core.DatasetBuilder:
    """The builder of ``name`` over bucket ``data_dir``, which must exist (tfds itself
    would take a missing bucket for an empty data_dir)."""
    storage.check_bucket(data_dir)
    return storage.call("read", data_dir, lambda: _get_builder(name, data_dir))


def _local_copy(
    name: str,
    bucket_builder: tfds.core.DatasetBuilder,
    *,
    prepare: bool,
    cache_dir: str | os.PathLike | None,
) -> str:
    """The local data_dir that stands for the bucket's: it holds a copy of the
    dataset's version when the bucket has it, or when it can be built here."""
    version_url = storage.normalize(bucket_builder.data_dir)
    if remote.is_uploaded(version_url):
        remote.fill_once(
            version_url, lambda d: remote.download(version_url, d), cache_dir=cache_dir
        )
    elif prepare and builds_here(bucket_builder):
        # Every machine builds its own copy (the builder is deterministic and
        # needs no network) rather than wait for another's upload; one uploads.
        local_dir = _build_copy(name, bucket_builder, cache_dir)
        if _is_first_process():
            remote.upload(local_dir, version_url)
    # Whatever the bucket lacks stays missing here too: reading explains it.
    return remote.local_path(bucket_builder.data_dir_root, cache_dir)


def _build_copy(
    name: str, bucket_builder: tfds.core.DatasetBuilder, cache_dir: str | os.PathLike | None
) -> str:
    """Builds the offline dataset into this machine's copy of the bucket (once)."""
    local_root = remote.local_path(bucket_builder.data_dir_root, cache_dir)
    return remote.fill_once(
        bucket_builder.data_dir, lambda _: _prepare_offline(name, local_root), cache_dir=cache_dir
    )


def _is_first_process() -> bool:
    # Asking JAX before it has joined the other processes would start its
    # backends, after which it cannot join them: such a caller is on its own.
    if compat.backends_are_initialized() or compat.coordination_client() is not None:
        return jax.process_index() == 0
    return True


def _not_prepared_message(name: str, builder: tfds.core.DatasetBuilder, prepare: bool) -> str:
    where = f"Dataset {name!r} is not prepared in {_FILE_FORMAT} format at {builder.data_dir}."
    if builds_here(builder) and not prepare:
        return (
            f"{where} It is built where it is: call load_data_source(..., prepare=True) "
            f"or prepare_dataset({name!r}, {str(builder.data_dir_root)!r})."
        )
    root = os.fspath(builder.data_dir_root)
    copy = (
        f"then copy it into the bucket:\n  gcloud storage cp -r DIR/{builder.name} {root}/"
        if storage.is_remote(root)
        else f"then copy DIR/{builder.name} to {root}/{builder.name} here."
    )
    return (
        f"{where}\nIts builder downloads the data, which replicator never does. On a "
        "machine with network and TensorFlow (tfds encodes images with it), run\n"
        f"  tfds build {name} --data_dir=DIR --file_format={_FILE_FORMAT}\n{copy}"
    )
