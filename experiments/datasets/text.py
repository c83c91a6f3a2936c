"""Byte-level text as tfds datasets of fixed-length token windows, built offline.

Three builders cut documents into the examples a language model trains on:

* ``python_stdlib``: the sources of the Python standard library that ship with
  the interpreter running the build (``sysconfig.get_paths()["stdlib"]``; real
  text, nothing to download). Configs: ``modules_128`` (the 168 top-level
  modules, 4.7 MB on CPython 3.11.7: builds in seconds), ``all_1024``,
  ``all_2048`` and ``all_4096`` (every ``.py`` file, the test suite included: 1,790 files,
  31.5 MB on 3.11.7). Another CPython version gives slightly different text.
* ``text_files``: your own corpus, from a glob of UTF-8 text files (one
  document each, read as bytes) or ``.npy`` arrays of integer token ids (from a
  tokenizer of yours; set the model's ``vocab_size`` to match). Name it with
  tfds' builder-argument syntax, e.g. as a config's ``dataset``::

      text_files/block_size=1024,files=/data/corpus/**/*.txt

  The prepared copy lives under ``DATA_DIR/text_files/block1024_<digest>``,
  the digest naming the glob and the files' paths and sizes, so adding files
  builds a new copy instead of reading a stale one.
* ``text_tfds``: a tfds text dataset (``lm1b``, ``wiki40b/en``, ...): each
  example's text feature is a document, its bytes windowed as above. The
  source must be prepared in the same data_dir in array_record format
  (``tfds build lm1b --file_format=array_record`` on a machine with network);
  nothing is downloaded here::

      text_tfds/source=lm1b,block_size=1024          # feature=text, train/test splits

Every example is ``{"tokens": int32[block_size + 1]}``: a window of the split's
documents concatenated (text documents each followed by the byte 0, which text
files do not contain, as a document boundary). Consecutive windows overlap by
one token, so every token after the first is a prediction target exactly once;
the last partial window is dropped. Byte tokens are 0..255 (vocabulary 256).

Splits are by document: a document is in ``test`` when the hash of its path
(relative to the corpus root) falls in the test fraction (5%), so the split is
the same on every machine. A corpus whose documents all land on one side (one
big file, say) holds out the last 5% of every document instead.

Build one with::

    import experiments.datasets.text  # registers both builders
    import tensorflow_datasets as tfds
    tfds.builder("python_stdlib/modules_128", data_dir=DIR).download_and_prepare(
        file_format="array_record")

or let ``replicator.trainer.data.load_data_source`` prepare it on first use.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import os
import pathlib
import re
import sys
import sysconfig
from collections.abc import Iterable, Iterator, Sequence

import numpy as np
import tensorflow_datasets as tfds

from experiments.datasets.base import LocalBuilder

BYTE_VOCAB_SIZE = 256
DOCUMENT_SEPARATOR = 0  # the byte after every text document
TEST_FRACTION = 0.05
_EXCLUDED_DIRS = {"site-packages", "dist-packages", "__pycache__"}


@dataclasses.dataclass(frozen=True)
class Document:
    """One document of a corpus: its name (a path relative to the corpus root) and file."""

    name: str
    path: pathlib.Path


@dataclasses.dataclass(eq=False)
class WindowConfig(tfds.core.BuilderConfig):
    """A builder config: how long the windows are, and which documents they come from.

    Attributes:
      block_size: a model's context; examples hold ``block_size + 1`` tokens.
      subset: ``python_stdlib`` only: ``"modules"`` (top-level modules) or ``"all"``.
      files: ``text_files`` only: the glob of documents.
      source: ``text_tfds`` only: the tfds dataset the text comes from.
    """

    block_size: int = 1024
    subset: str = "all"
    files: str = ""
    source: str = ""


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


def file_documents(pattern: str) -> list[Document]:
    """The files that ``pattern`` (a glob, ``**`` recursive) matches, named relative to their root.

    Raises:
      ValueError: nothing matches.
    """
    paths = sorted(p for p in glob.glob(os.path.expanduser(pattern), recursive=True))
    paths = [pathlib.Path(p).resolve() for p in paths if os.path.isfile(p)]
    if not paths:
        raise ValueError(f"text_files: no file matches files={pattern!r}.")
    root = pathlib.Path(os.path.commonpath([p.parent for p in paths]))
    return [Document(p.relative_to(root).as_posix(), p) for p in paths]


def read_tokens(document: Document) -> np.ndarray:
    """A document's tokens: a ``.npy`` file's integers, or any other file's bytes then 0.

    >>> import tempfile
    >>> with tempfile.NamedTemporaryFile(suffix=".txt") as f:
    ...     _ = f.write("hé".encode()); f.flush()
    ...     read_tokens(Document("x", pathlib.Path(f.name))).tolist()
    [104, 195, 169, 0]
    """
    if document.path.suffix == ".npy":
        tokens = np.load(document.path).reshape(-1)
        if tokens.dtype.kind not in "iu" or (
            tokens.size and not 0 <= tokens.min() <= tokens.max() < 2**31
        ):
            raise ValueError(
                f"{document.path}: token arrays must hold integers in [0, 2**31), "
                f"got {tokens.dtype} values."
            )
        return tokens.astype(np.int32)
    text = np.frombuffer(document.path.read_bytes(), np.uint8)
    return np.append(text, np.uint8(DOCUMENT_SEPARATOR)).astype(np.int32)


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


def split_documents(
    documents: Sequence[Document], test_fraction: float = TEST_FRACTION
) -> dict[str, Iterator[np.ndarray]]:
    """Each split's token sequences, lazily: whole documents by hash, else every document's tail.

    Returns:
      ``{"train": ..., "test": ...}``, iterators of token arrays.
    """
    is_test = [is_test_document(d.name, test_fraction) for d in documents]
    if any(is_test) and not all(is_test):
        return {
            "train": (read_tokens(d) for d, t in zip(documents, is_test) if not t),
            "test": (read_tokens(d) for d, t in zip(documents, is_test) if t),
        }

    def part(split: str) -> Iterator[np.ndarray]:
        for document in documents:
            tokens = read_tokens(document)
            cut = len(tokens) - int(round(len(tokens) * test_fraction))
            yield tokens[:cut] if split == "train" else tokens[cut:]

    return {"train": part("train"), "test": part("test")}


class _WindowBuilder(LocalBuilder, skip_registration=True):
    """What the three builders share: examples are windows of ``block_size + 1``
    tokens cut from each split's documents, built here on first use."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Initial release."}

    def _window_info(self, description: str) -> tfds.core.DatasetInfo:
        length = self.builder_config.block_size + 1
        features = tfds.features.FeaturesDict(
            {"tokens": tfds.features.Tensor(shape=(length,), dtype=np.int32)}
        )
        return tfds.core.DatasetInfo(builder=self, description=description, features=features)

    def _generate_examples(self, tokens: Iterable[np.ndarray]) -> Iterator[tuple[int, dict]]:
        # The key is the window's position in its split.
        for index, window in enumerate(cut_windows(tokens, self.builder_config.block_size)):
            yield index, {"tokens": window}


def _stdlib_config(subset: str, block_size: int) -> WindowConfig:
    return WindowConfig(
        name=f"{subset}_{block_size}",
        block_size=block_size,
        subset=subset,
        description=f"{subset} stdlib sources, windows of {block_size + 1} bytes",
    )


class PythonStdlib(_WindowBuilder):
    """The Python standard library's source files as byte windows (no download needed)."""

    BUILDER_CONFIGS = [
        _stdlib_config("modules", 128),
        _stdlib_config("all", 1024),
        _stdlib_config("all", 2048),
        _stdlib_config("all", 4096),
    ]

    def _info(self) -> tfds.core.DatasetInfo:
        return self._window_info(
            f"Byte windows of the Python {sys.version.split()[0]} standard library's "
            f"sources ({self.builder_config.subset}), split by file: 5% of files test.",
        )

    def _split_generators(self, dl_manager: tfds.download.DownloadManager) -> dict:
        del dl_manager  # Everything comes from the running interpreter's files.
        config = self.builder_config
        splits = split_documents(stdlib_documents(config.subset))
        return {name: self._generate_examples(tokens) for name, tokens in splits.items()}


class TextFiles(_WindowBuilder):
    """Your own text or ``.npy`` token files as windows: ``text_files/block_size=N,files=GLOB``.

    Args:
      files: a glob of documents (``**`` matches folders recursively).
      block_size: tokens per window, plus one.
      **kwargs: `tfds.core.DatasetBuilder`'s (``data_dir``, ``file_format``...).
    """

    def __init__(self, *, files: str = "", block_size: int = 1024, **kwargs):
        if not files or kwargs.get("config") is not None:
            raise ValueError(
                "Name the text_files dataset by its files, e.g. "
                "'text_files/block_size=1024,files=/data/corpus/*.txt'."
            )
        documents = file_documents(files)
        # The prepared copy is named by what it holds, so new files mean a new copy.
        digest = hashlib.sha256(repr(files).encode())
        for document in documents:
            digest.update(f"{document.name}\0{document.path.stat().st_size}\0".encode())
        self._documents = documents
        config = WindowConfig(
            name=f"block{block_size}_{digest.hexdigest()[:12]}",
            block_size=block_size,
            files=files,
            description=f"{len(documents)} files matching {files!r}",
        )
        super().__init__(config=config, **kwargs)

    def _info(self) -> tfds.core.DatasetInfo:
        return self._window_info(
            f"Windows of {self.builder_config.description}, split by file: 5% of files test.",
        )

    def _split_generators(self, dl_manager: tfds.download.DownloadManager) -> dict:
        del dl_manager  # The files are local.
        splits = split_documents(self._documents)
        return {name: self._generate_examples(tokens) for name, tokens in splits.items()}


class TextTfds(_WindowBuilder):
    """A tfds text dataset as byte windows: ``text_tfds/source=NAME,block_size=N``.

    Each example's ``feature`` (a string) is one document: its UTF-8 bytes, then
    the byte 0. The source's own train and test splits are kept.

    Args:
      source: the tfds dataset, with its config (``wiki40b/en``), prepared in
        array_record format under the same ``data_dir``.
      feature: the source's text feature.
      block_size: tokens per window, plus one.
      train_split: the source's split that becomes ``train``.
      test_split: the source's split that becomes ``test``.
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
        **kwargs,
    ):
        if not source or kwargs.get("config") is not None:
            raise ValueError(
                "Name the text_tfds dataset by its source, e.g. "
                "'text_tfds/source=lm1b,block_size=1024'."
            )
        self._feature = feature
        self._splits = {"train": train_split, "test": test_split}
        self._source_dir = kwargs.get("data_dir")
        name = f"{source}_{feature}_{train_split}_{test_split}".replace("/", "_")
        config = WindowConfig(
            name=f"block{block_size}_{re.sub(r'[^A-Za-z0-9_]', '_', name)}",
            block_size=block_size,
            source=source,
            description=f"the {feature!r} feature of tfds {source!r}",
        )
        super().__init__(config=config, **kwargs)

    def _info(self) -> tfds.core.DatasetInfo:
        return self._window_info(f"Byte windows of {self.builder_config.description}.")

    def _split_generators(self, dl_manager: tfds.download.DownloadManager) -> dict:
        del dl_manager  # the source is prepared locally
        return {
            split: self._generate_examples(self._documents(source_split))
            for split, source_split in self._splits.items()
        }

    def _documents(self, split: str) -> Iterator[np.ndarray]:
        examples = tfds.data_source(
            self.builder_config.source, split=split, data_dir=self._source_dir, download=False
        )
        for index in range(len(examples)):
            value = examples[index][self._feature]
            data = value.encode() if isinstance(value, str) else bytes(value)
            text = np.frombuffer(data, np.uint8)
            yield np.append(text, np.uint8(DOCUMENT_SEPARATOR)).astype(np.int32)
