"""Text as tfds datasets of fixed-length token windows, tokenized once, built offline.

Three builders cut documents into the examples a language model trains on:

* ``python_stdlib``: the sources of the Python standard library that ship with
  the interpreter running the build (``sysconfig.get_paths()["stdlib"]``; real
  text, nothing to download). Configs: ``modules_128`` (the 168 top-level
  modules, 4.7 MB on CPython 3.11.7: builds in seconds), ``all_1024``,
  ``all_2048``, ``all_4096`` and ``all_8192`` (every ``.py`` file, the test suite
  included: 1,790 files, 31.5 MB on 3.11.7). Another CPython version gives
  slightly different text.
* ``text_files``: your own corpus, from a glob of files, each read by its
  extension: ``.jsonl`` (one document per line, its ``field``, default
  ``"text"``), ``.parquet`` (one document per row of the column ``field``;
  needs pyarrow), ``.npy`` (integer token ids, already tokenized: set the
  model's ``vocab_size`` to match) and any other file one UTF-8 text document.
  Name it with tfds' builder-argument syntax, e.g. as a config's ``dataset``::

      text_files/block_size=1024,files=/data/corpus/**/*.txt
      text_files/block_size=2048,files=/data/web/*.jsonl,field=content,tokenizer=/tok/tokenizer.json

  The prepared copy lives under ``DATA_DIR/text_files/block1024_<digest>``
  (``..._<tokenizer fingerprint>`` with a tokenizer), the digest naming the
  glob and the files' paths and sizes, so adding files builds a new copy
  instead of reading a stale one.
* ``text_tfds``: a tfds text dataset (``lm1b``, ``wiki40b/en``, ...): each
  example's text feature is a document, tokenized as above. The source must be
  prepared in the same data_dir in array_record format (``tfds build lm1b
  --file_format=array_record`` on a machine with network); nothing is
  downloaded here::

      text_tfds/source=lm1b,block_size=1024          # feature=text, train/test splits

Every builder takes ``tokenizer=`` (`experiments.datasets.tokenizers`: ``bytes``,
the default, or a local tokenizer.json, sentencepiece model or tiktoken file;
``python_stdlib/modules_128/tokenizer=PATH`` for the named configs). Every
example is ``{"tokens": int32[block_size + 1]}``: a window of the split's
documents concatenated, each document followed by the tokenizer's ``eos_id``
as a boundary (the byte 0 for bytes, which text files do not contain).
Consecutive windows overlap by one token, so every token after the first is a
prediction target exactly once; the last partial window is dropped. The corpus
is tokenized once, in parallel (``workers=N`` processes; by default one per CPU
for a corpus over 8 MB and a tokenizer other than bytes), with a progress bar,
and the tokenizer's fingerprint is recorded in the prepared copy's
``metadata.json``; the LM refuses data whose tokenizer is not
``config.tokenizer`` (`recorded_tokenizer`). A tokenized corpus, as a config's
keys::

    c.tokenizer = "/tok/tokenizer.json"
    c.dataset = "text_files/block_size=1024,files=/data/*.jsonl,tokenizer=/tok/tokenizer.json"
    c.model.vocab_size = 32_768  # >= the tokenizer's vocabulary (a multiple of 128 is fastest)

Splits are by document: a document is in ``test`` when the hash of its name
(its path relative to the corpus root; ``PATH:LINE`` or ``PATH:ROW`` for a
JSONL or parquet file's) falls in the test fraction (5%), so the split is the
same on every machine. A corpus whose documents all land on one side (one big
file, say) holds out the last 5% of every document instead.

Build one with::

    import experiments.datasets.text  # registers the builders
    import tensorflow_datasets as tfds
    tfds.builder("python_stdlib/modules_128", data_dir=DIR).download_and_prepare(
        file_format="array_record")

or let ``replicator.trainer.data.load_data_source`` prepare it on first use.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import pathlib
import re
import sys
import sysconfig
from collections.abc import Callable, Iterable, Iterator, Sequence

import numpy as np
import tensorflow_datasets as tfds

from experiments.datasets.base import LocalBuilder
from experiments.datasets.corpus import DOCUMENT_SEPARATOR as DOCUMENT_SEPARATOR
from experiments.datasets.corpus import Document as Document
from experiments.datasets.corpus import TokenStore as TokenStore
from experiments.datasets.corpus import encode_document as encode_document
from experiments.datasets.corpus import file_documents as file_documents
from experiments.datasets.corpus import map_in_order, progress_bar
from experiments.datasets.corpus import read_texts as read_texts
from experiments.datasets.corpus import read_tokens as read_tokens
from experiments.datasets.corpus import tokenize_files as tokenize_files
from experiments.datasets.tokenizers import BYTES, load_tokenizer

BYTE_VOCAB_SIZE = 256
TEST_FRACTION = 0.05
_EXCLUDED_DIRS = {"site-packages", "dist-packages", "__pycache__"}


@dataclasses.dataclass(eq=False)
class WindowConfig(tfds.core.BuilderConfig):
    """A builder config: how long the windows are, and which documents they come from.

    Attributes:
      block_size: a model's context; examples hold ``block_size + 1`` tokens.
      subset: ``python_stdlib`` only: ``"modules"`` (top-level modules) or ``"all"``.
      files: ``text_files`` only: the glob of documents.
      source: ``text_tfds`` only: the tfds dataset the text comes from.
      tokenizer: the `load_tokenizer` spec the documents are tokenized with.
    """

    block_size: int = 1024
    subset: str = "all"
    files: str = ""
    source: str = ""
    tokenizer: str = BYTES


def stdlib_documents(subset: str = "all") -> list[Document]:
    """The ``.py`` files of this interpreter's standard library, sorted by name.

    Args:
      subset: ``"modules"``: only the files directly in the stdlib folder;
        ``"all"``: every package too (tests included), never ``site-packages``.

    >>> names = [d.name for d in stdlib_documents("modules")]
    >>> "os.py" in names and "json/decoder.py" not in names
    True
    """
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    if subset not in ("modules", "all"):
        raise ValueError(f"Unknown python_stdlib subset {subset!r}; use 'modules' or 'all'.")
    paths = root.glob("*.py") if subset == "modules" else root.rglob("*.py")
    documents = [
        Document(path.relative_to(root).as_posix(), path)
        for path in paths
        if not _EXCLUDED_DIRS.intersection(path.relative_to(root).parts)
    ]
    return sorted(documents, key=lambda d: d.name)


def is_test_document(name: str, test_fraction: float = TEST_FRACTION) -> bool:
    """Whether the document ``name`` belongs to the test split (a hash of the name, stable)."""
    digest = hashlib.sha256(name.encode()).digest()
    return int.from_bytes(digest[:8], "big") < test_fraction * 2**64


def cut_windows(documents: Iterable[np.ndarray], block_size: int) -> Iterator[np.ndarray]:
    """Cuts the concatenation of ``documents`` into windows of ``block_size + 1`` tokens.

    Window ``i`` starts at token ``i * block_size``: neighbours share one token,
    so each token but the first is a target once. The last partial window is
    dropped. Only one document and one window are held in memory at a time.

    >>> [w.tolist() for w in cut_windows([np.arange(4), np.arange(4, 8)], 3)]
    [[0, 1, 2, 3], [3, 4, 5, 6]]
    """
    carry = np.zeros(0, np.int32)
    for tokens in documents:
        stream = np.concatenate([carry, tokens])
        count = max(0, (len(stream) - 1) // block_size)
        for i in range(count):
            yield stream[i * block_size : (i + 1) * block_size + 1]
        carry = stream[count * block_size :]


def split_tokens(
    names: Sequence[str],
    read: Callable[[int], np.ndarray],
    test_fraction: float = TEST_FRACTION,
) -> dict[str, Iterator[np.ndarray]]:
    """Each split's token sequences, lazily: whole documents by the hash of their names,
    else (all on one side) every document's tail.

    Args:
      names: the documents' names.
      read: ``read(i)``, document ``i``'s tokens.
      test_fraction: the share of documents (or of each document's tokens) held out.

    Returns:
      ``{"train": ..., "test": ...}``, iterators of token arrays.

    >>> tokens = [np.arange(20)]
    >>> splits = split_tokens(["one"], tokens.__getitem__)
    >>> [len(t) for t in splits["train"]], [len(t) for t in splits["test"]]
    ([19], [1])
    """
    is_test = [is_test_document(name, test_fraction) for name in names]
    if any(is_test) and not all(is_test):
        return {
            "train": (read(i) for i, test in enumerate(is_test) if not test),
            "test": (read(i) for i, test in enumerate(is_test) if test),
        }

    def part(split: str) -> Iterator[np.ndarray]:
        for i in range(len(names)):
            tokens = read(i)
            cut = len(tokens) - int(round(len(tokens) * test_fraction))
            yield tokens[:cut] if split == "train" else tokens[cut:]

    return {"train": part("train"), "test": part("test")}


def split_documents(
    documents: Sequence[Document],
    test_fraction: float = TEST_FRACTION,
    *,
    tokenizer: str = BYTES,
    field: str = "text",
    workers: int | None = None,
) -> dict[str, Iterator[np.ndarray]]:
    """Each split's token sequences: the files' documents, tokenized once (`tokenize_files`)
    and split by `split_tokens`.

    Returns:
      ``{"train": ..., "test": ...}``, iterators of token arrays.
    """
    store = tokenize_files(documents, tokenizer, field=field, workers=workers)
    return split_tokens(store.names, store.read, test_fraction)


def recorded_tokenizer(dataset: str) -> str | None:
    """The fingerprint of the tokenizer that ``dataset``'s tokens come from, or None where
    it is not known.

    For the builders here, the ``tokenizer=`` the name gives (``bytes`` by default),
    which the prepared copy's directory name and ``metadata.json`` carry (as for
    ``chat/...`` and ``preferences/...``, `experiments.datasets.chat`); for
    ``array_record:PATTERN``, the ``tokenizer`` of a ``metadata.json`` beside the
    files, if there is one.

    >>> recorded_tokenizer("python_stdlib/modules_128"), recorded_tokenizer("mnist")
    ('bytes', None)
    """
    if dataset.startswith("array_record:"):
        from replicator import storage

        pattern = dataset.removeprefix("array_record:").replace("{split}", "train")
        path = storage.join(os.path.dirname(pattern), "metadata.json")
        try:
            metadata = json.loads(storage.read_text(path))
        except (OSError, ValueError):
            return None
        return metadata.get("tokenizer") if isinstance(metadata, dict) else None
    try:
        name, kwargs = tfds.core.naming.parse_builder_name_kwargs(dataset)
    except ValueError:
        return None
    if name.name in ("chat", "preferences"):  # experiments.datasets.chat: no default tokenizer
        spec = kwargs.get("tokenizer")
        return load_tokenizer(str(spec)).fingerprint if spec else None
    if name.name not in ("python_stdlib", "text_files", "text_tfds"):
        return None
    return load_tokenizer(str(kwargs.get("tokenizer", BYTES))).fingerprint


class _WindowBuilder(LocalBuilder, skip_registration=True):
    """What the three builders share: examples are windows of ``block_size + 1``
    tokens cut from each split's documents, built here on first use."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Initial release."}

    def _window_info(self, description: str) -> tfds.core.DatasetInfo:
        config = self.builder_config
        length = config.block_size + 1
        features = tfds.features.FeaturesDict(
            {"tokens": tfds.features.Tensor(shape=(length,), dtype=np.int32)}
        )
        tokenizer = load_tokenizer(config.tokenizer)
        # metadata.json beside the data: which tokenizer its ids are, for recorded_tokenizer.
        metadata = tfds.core.MetadataDict(
            tokenizer=tokenizer.fingerprint, tokenizer_spec=config.tokenizer,
            vocab_size=tokenizer.vocab_size, eos_id=tokenizer.eos_id,
        )  # fmt: skip
        return tfds.core.DatasetInfo(
            builder=self, description=description, features=features, metadata=metadata
        )

    def _generate_examples(self, tokens: Iterable[np.ndarray]) -> Iterator[tuple[int, dict]]:
        # The key is the window's position in its split.
        for index, window in enumerate(cut_windows(tokens, self.builder_config.block_size)):
            yield index, {"tokens": window}


def _tokenized_name(name: str, tokenizer: str) -> str:
    """A config's name, with the tokenizer's fingerprint unless it is bytes."""
    fingerprint = load_tokenizer(tokenizer).fingerprint
    return name if fingerprint == BYTES else f"{name}_{fingerprint}"


def _stdlib_config(subset: str, block_size: int) -> WindowConfig:
    return WindowConfig(
        name=f"{subset}_{block_size}",
        block_size=block_size,
        subset=subset,
        description=f"{subset} stdlib sources, windows of {block_size + 1} bytes",
    )


class PythonStdlib(_WindowBuilder):
    """The Python standard library's source files as token windows (no download needed):
    ``python_stdlib/modules_128``, or ``python_stdlib/modules_128/tokenizer=PATH``.

    Args:
      tokenizer: a `load_tokenizer` spec (default ``bytes``).
      workers: processes that tokenize (`tokenize_files`).
      **kwargs: `tfds.core.DatasetBuilder`'s (``config``, ``data_dir``...).
    """

    BUILDER_CONFIGS = [
        _stdlib_config("modules", 128),
        _stdlib_config("all", 1024),
        _stdlib_config("all", 2048),
        _stdlib_config("all", 4096),
        _stdlib_config("all", 8192),  # configs/llama3_8b.py's context
    ]

    def __init__(self, *, tokenizer: str = BYTES, workers: int | None = None, **kwargs):
        self._workers = workers
        if tokenizer != BYTES:  # a config of its own, so the bytes' copy is never reused
            named = kwargs.get("config") or self.BUILDER_CONFIGS[0].name
            base = next((c for c in self.BUILDER_CONFIGS if c.name == named), None)
            if base is None:
                names = [c.name for c in self.BUILDER_CONFIGS]
                raise ValueError(f"python_stdlib has no config {named!r}; it has {names}.")
            kwargs["config"] = dataclasses.replace(
                base, name=_tokenized_name(base.name, tokenizer), tokenizer=tokenizer,
                description=f"{base.subset} stdlib sources, tokenized by {tokenizer}",
            )  # fmt: skip
        super().__init__(**kwargs)

    def _info(self) -> tfds.core.DatasetInfo:
        return self._window_info(
            f"Token windows of the Python {sys.version.split()[0]} standard library's "
            f"sources ({self.builder_config.subset}), split by file: 5% of files test.",
        )

    def _split_generators(self, dl_manager: tfds.download.DownloadManager) -> dict:
        del dl_manager  # Everything comes from the running interpreter's files.
        config = self.builder_config
        splits = split_documents(
            stdlib_documents(config.subset), tokenizer=config.tokenizer, workers=self._workers
        )
        return {name: self._generate_examples(tokens) for name, tokens in splits.items()}


class TextFiles(_WindowBuilder):
    """Your own corpus as windows: ``text_files/block_size=N,files=GLOB[,tokenizer=T]``.

    Args:
      files: a glob of documents (``**`` matches folders recursively): text files,
        ``.jsonl``, ``.parquet`` or ``.npy`` token ids (`read_texts`).
      block_size: tokens per window, plus one.
      tokenizer: a `load_tokenizer` spec (default ``bytes``).
      field: the text field of JSONL lines, the text column of parquet files.
      workers: processes that tokenize (`tokenize_files`).
      **kwargs: `tfds.core.DatasetBuilder`'s (``data_dir``, ``file_format``...).
    """

    def __init__(
        self,
        *,
        files: str = "",
        block_size: int = 1024,
        tokenizer: str = BYTES,
        field: str = "text",
        workers: int | None = None,
        **kwargs,
    ):
        if not files or kwargs.get("config") is not None:
            raise ValueError(
                "Name the text_files dataset by its files, e.g. "
                "'text_files/block_size=1024,files=/data/corpus/*.txt'."
            )
        documents = file_documents(files)
        # The prepared copy is named by what it holds, so new files mean a new copy.
        digest = hashlib.sha256(repr(files).encode() + (b"" if field == "text" else field.encode()))
        for document in documents:
            digest.update(f"{document.name}\0{document.path.stat().st_size}\0".encode())
        self._documents, self._field, self._workers = documents, field, workers
        config = WindowConfig(
            name=_tokenized_name(f"block{block_size}_{digest.hexdigest()[:12]}", tokenizer),
            block_size=block_size,
            files=files,
            tokenizer=tokenizer,
            description=f"{len(documents)} files matching {files!r}",
        )
        super().__init__(config=config, **kwargs)

    def _info(self) -> tfds.core.DatasetInfo:
        return self._window_info(
            f"Windows of {self.builder_config.description}, split by document: 5% test.",
        )

    def _split_generators(self, dl_manager: tfds.download.DownloadManager) -> dict:
        del dl_manager  # The files are local.
        splits = split_documents(
            self._documents, tokenizer=self.builder_config.tokenizer, field=self._field,
            workers=self._workers,
        )  # fmt: skip
        return {name: self._generate_examples(tokens) for name, tokens in splits.items()}


class TextTfds(_WindowBuilder):
    """A tfds text dataset as token windows: ``text_tfds/source=NAME,block_size=N``.

    Each example's ``feature`` (a string) is one document: its tokens, then the
    tokenizer's eos_id (for bytes: its UTF-8 bytes, then the byte 0). The
    source's own train and test splits are kept.

    Args:
      source: the tfds dataset, with its config (``wiki40b/en``), prepared in
        array_record format under the same ``data_dir``.
      feature: the source's text feature.
      block_size: tokens per window, plus one.
      train_split: the source's split that becomes ``train``.
      test_split: the source's split that becomes ``test``.
      tokenizer: a `load_tokenizer` spec (default ``bytes``).
      workers: processes that tokenize side by side (None: one per CPU with a
        tokenizer other than bytes, for a split of over 10,000 documents).
      **kwargs: `tfds.core.DatasetBuilder`'s (``data_dir``, ``file_format``...).
    """

    def __init__(
        self,
        *,
        source: str = "",
        feature: str = "text",
        block_size: int = 1024,
        train_split: str = "train",
        test_split: str = "test",
        tokenizer: str = BYTES,
        workers: int | None = None,
        **kwargs,
    ):
        if not source or kwargs.get("config") is not None:
            raise ValueError(
                "Name the text_tfds dataset by its source, e.g. "
                "'text_tfds/source=lm1b,block_size=1024'."
            )
        self._feature, self._workers = feature, workers
        self._splits = {"train": train_split, "test": test_split}
        self._source_dir = kwargs.get("data_dir")
        name = f"{source}_{feature}_{train_split}_{test_split}".replace("/", "_")
        name = f"block{block_size}_{re.sub(r'[^A-Za-z0-9_]', '_', name)}"
        config = WindowConfig(
            name=_tokenized_name(name, tokenizer),
            block_size=block_size,
            source=source,
            tokenizer=tokenizer,
            description=f"the {feature!r} feature of tfds {source!r}",
        )
        super().__init__(config=config, **kwargs)

    def _info(self) -> tfds.core.DatasetInfo:
        return self._window_info(f"Token windows of {self.builder_config.description}.")

    def _split_generators(self, dl_manager: tfds.download.DownloadManager) -> dict:
        del dl_manager  # the source is prepared locally
        return {
            split: self._generate_examples(self._documents(source_split))
            for split, source_split in self._splits.items()
        }

    def _documents(self, split: str) -> Iterator[np.ndarray]:
        config = self.builder_config
        count = len(_tfds_source(config.source, split, self._source_dir))
        step = 1000
        tasks = [
            (config.source, split, self._source_dir, self._feature, start, min(start + step, count),
             config.tokenizer)
            for start in range(0, count, step)
        ]  # fmt: skip
        workers = self._workers
        if workers is None:
            big = count > 10 * step and config.tokenizer != BYTES
            workers = (os.cpu_count() or 1) if big else 0
        fingerprint = load_tokenizer(config.tokenizer).fingerprint
        what = f"Tokenizing {split} of {config.source} ({fingerprint})"
        with progress_bar(what, count) as advance:
            for task, results in zip(tasks, map_in_order(_tokenize_examples, tasks, workers)):
                yield from results
                advance(task[5] - task[4])


def _tokenize_examples(task: tuple) -> list[np.ndarray]:
    source, split, data_dir, feature, start, stop, spec = task
    examples, tokenizer = _tfds_source(source, split, data_dir), load_tokenizer(spec)
    texts = (examples[index][feature] for index in range(start, stop))
    return [encode_document(t if isinstance(t, str) else bytes(t), tokenizer) for t in texts]


@functools.lru_cache(maxsize=4)
def _tfds_source(source: str, split: str, data_dir: str | None):
    return tfds.data_source(source, split=split, data_dir=data_dir, download=False)
