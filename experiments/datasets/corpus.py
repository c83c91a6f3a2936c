"""A corpus's documents: read by file format, tokenized once, in parallel, kept on disk.

The text builders (`experiments.datasets.text`) read their files through
`read_texts` (text, ``.jsonl``, ``.parquet``; ``.npy`` token ids as they are)
and tokenize them with `tokenize_files`: groups of files on several processes,
in order, with a progress bar, into a `TokenStore` on disk that the windows are
then cut from, so a corpus larger than memory is tokenized once for both splits.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import glob
import json
import multiprocessing
import os
import pathlib
import shutil
import tempfile
import weakref
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from experiments.datasets.tokenizers import BYTES, Tokenizer, load_tokenizer
from replicator.errors import DatasetError

DOCUMENT_SEPARATOR = 0  # the byte after every text document
_PARALLEL_BYTES = 8 * 2**20  # a corpus this big is tokenized by several processes
_TASK_BYTES = 2**20  # files are handed to the processes in groups of about this size


@dataclasses.dataclass(frozen=True)
class Document:
    """One file of a corpus: its name (a path relative to the corpus root) and path."""

    name: str
    path: pathlib.Path


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


def read_texts(document: Document, field: str = "text") -> Iterator[tuple[str, str | bytes]]:
    """The documents in one file, as ``(name, text)``, by the file's extension.

    ``.jsonl``: each line's ``field`` (``name:LINE``, from 1); ``.parquet``: each
    row's column ``field`` (``name:ROW``, from 0); any other file: its bytes.

    >>> import tempfile
    >>> with tempfile.NamedTemporaryFile("w", suffix=".jsonl") as f:
    ...     _ = f.write('{"text": "a"}\\n\\n{"text": "b", "id": 2}\\n'); f.flush()
    ...     list(read_texts(Document("x.jsonl", pathlib.Path(f.name))))
    [('x.jsonl:1', 'a'), ('x.jsonl:3', 'b')]
    """
    suffix = document.path.suffix.lower()
    if suffix == ".jsonl":
        with open(document.path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if line.strip():
                    yield f"{document.name}:{number}", _field(json.loads(line), field, document)
    elif suffix == ".parquet":
        for row, text in enumerate(_parquet_column(document, field)):
            yield f"{document.name}:{row}", text if text is not None else ""
    else:
        yield document.name, document.path.read_bytes()


def _field(record: object, field: str, document: Document) -> str:
    if not isinstance(record, dict) or not isinstance(record.get(field), str):
        raise DatasetError(
            f"{document.path}: a JSONL line without a string {field!r} field; name the text "
            "field with the dataset's field=NAME"
        )
    return record[field]


def _parquet_column(document: Document, field: str) -> list:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DatasetError(f"{document.path}: reading parquet needs pyarrow") from None
    table = pq.read_table(document.path)
    if field not in table.column_names:
        raise DatasetError(
            f"{document.path} has no column {field!r} (it has {table.column_names}); name the "
            "text column with the dataset's field=NAME"
        )
    return table.column(field).to_pylist()


def encode_document(text: str | bytes, tokenizer: Tokenizer) -> np.ndarray:
    """A document's tokens, then ``tokenizer.eos_id`` (when it has one), as int32.

    Bytes are read as they are by the bytes tokenizer, as UTF-8 (errors replaced)
    by the others.

    >>> from experiments.datasets.tokenizers import load_tokenizer
    >>> encode_document("hé", load_tokenizer("bytes")).tolist()
    [104, 195, 169, 0]
    """
    if isinstance(text, bytes):
        if tokenizer.fingerprint == BYTES:
            ids = np.frombuffer(text, np.uint8)
            return np.append(ids, np.uint8(DOCUMENT_SEPARATOR)).astype(np.int32)
        text = text.decode("utf-8", errors="replace")
    ids = tokenizer.encode(text)
    ids = ids + [tokenizer.eos_id] if tokenizer.eos_id is not None else ids
    return np.asarray(ids, np.int32)


def read_tokens(
    document: Document, tokenizer: Tokenizer | None = None, field: str = "text"
) -> np.ndarray:
    """A file's tokens: a ``.npy`` file's integers, or its documents' tokens, each then
    the tokenizer's ``eos_id`` (bytes, separated by 0, by default).

    >>> import tempfile
    >>> with tempfile.NamedTemporaryFile(suffix=".txt") as f:
    ...     _ = f.write("hé".encode()); f.flush()
    ...     read_tokens(Document("x", pathlib.Path(f.name))).tolist()
    [104, 195, 169, 0]
    """
    return np.concatenate(
        [tokens for _, tokens in _file_tokens(document, tokenizer or load_tokenizer(BYTES), field)]
        or [np.zeros(0, np.int32)]
    )


def _file_tokens(
    document: Document, tokenizer: Tokenizer, field: str
) -> Iterator[tuple[str, np.ndarray]]:
    """``(name, tokens)`` of each document in one file."""
    if document.path.suffix == ".npy":
        tokens = np.load(document.path).reshape(-1)
        if tokens.dtype.kind not in "iu" or (
            tokens.size and not 0 <= tokens.min() <= tokens.max() < 2**31
        ):
            raise ValueError(
                f"{document.path}: token arrays must hold integers in [0, 2**31), "
                f"got {tokens.dtype} values."
            )
        yield document.name, tokens.astype(np.int32)
        return
    for name, text in read_texts(document, field):
        yield name, encode_document(text, tokenizer)


class TokenStore:
    """Tokenized documents in a scratch file on disk, read back one at a time.

    The scratch directory (under ``$TMPDIR``: it needs 4 bytes per token) goes when
    the store does (it is garbage collected).

    >>> store = TokenStore()
    >>> store.append("a", np.array([1, 2])); store.append("b", np.array([3]))
    >>> store.names, store.read(1).tolist(), store.num_tokens
    (['a', 'b'], [3], 3)
    """

    def __init__(self):
        self._dir = tempfile.mkdtemp(prefix="replicator-tokens-")
        weakref.finalize(self, shutil.rmtree, self._dir, True)
        self._file = open(os.path.join(self._dir, "tokens.int32"), "wb")
        weakref.finalize(self, self._file.close)
        self.names: list[str] = []
        self._offsets = [0]
        self._tokens: np.ndarray | None = None

    @property
    def num_tokens(self) -> int:
        return self._offsets[-1]

    def append(self, name: str, tokens: np.ndarray) -> None:
        self._file.write(np.asarray(tokens, np.int32).tobytes())
        self.names.append(name)
        self._offsets.append(self._offsets[-1] + len(tokens))

    def read(self, index: int) -> np.ndarray:
        if self._tokens is None:
            self._file.close()
            path, count = self._file.name, self.num_tokens
            self._tokens = np.memmap(path, np.int32, "r") if count else np.zeros(0, np.int32)
        return np.array(self._tokens[self._offsets[index] : self._offsets[index + 1]])


def tokenize_files(
    documents: Sequence[Document],
    tokenizer: str = BYTES,
    *,
    field: str = "text",
    workers: int | None = None,
) -> TokenStore:
    """Tokenizes every document of ``documents`` (files, `read_texts`) once, in order.

    Args:
      documents: the corpus's files.
      tokenizer: a `load_tokenizer` spec.
      field: the text field of JSONL files, the text column of parquet files.
      workers: processes that tokenize groups of files side by side (0 or 1: this
        process); None: one per CPU for a corpus over 8 MB with a tokenizer
        other than bytes, else this process. They are fresh processes (spawned),
        so a script of yours that builds the data needs the usual
        ``if __name__ == "__main__":`` guard.

    Returns:
      A `TokenStore` of every document's tokens, each followed by the tokenizer's eos_id.
    """
    groups, sizes = _groups(documents)
    total = sum(sizes)
    if workers is None:
        big = total > _PARALLEL_BYTES and tokenizer != BYTES
        workers = (os.cpu_count() or 1) if big else 0
    store = TokenStore()
    tasks = [(group, tokenizer, field) for group in groups]
    files = f"{len(documents)} file{'s' if len(documents) != 1 else ''}"
    what = f"Tokenizing {files} ({load_tokenizer(tokenizer).fingerprint})"
    with progress_bar(what, total) as advance:
        for size, results in zip(sizes, map_in_order(_tokenize_group, tasks, workers)):
            for name, tokens in results:
                store.append(name, tokens)
            advance(size)
    return store


def _groups(documents: Sequence[Document]) -> tuple[list[list[Document]], list[int]]:
    """Consecutive files in groups of about ``_TASK_BYTES``, and each group's bytes."""
    groups, sizes = [], []
    for document in documents:
        size = document.path.stat().st_size
        if not groups or sizes[-1] + size > _TASK_BYTES:
            groups.append([])
            sizes.append(0)
        groups[-1].append(document)
        sizes[-1] += size
    return groups, sizes


def _tokenize_group(task: tuple) -> list[tuple[str, np.ndarray]]:
    documents, spec, field = task
    tokenizer = load_tokenizer(spec)  # read once per group; the same object for the same file
    return [item for document in documents for item in _file_tokens(document, tokenizer, field)]


def map_in_order(function: Callable, tasks: Sequence, workers: int) -> Iterator:
    """``map(function, tasks)``, on ``workers`` fresh processes when more than one."""
    workers = min(workers, len(tasks))
    if workers <= 1:
        yield from map(function, tasks)
        return
    # Fresh processes: a fork of this one would copy JAX's threads and locks.
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context) as pool:
        yield from pool.map(function, tasks)


@contextlib.contextmanager
def progress_bar(description: str, total: int) -> Iterator[Callable[[int], None]]:
    """A rich progress bar over ``total`` units (bytes, documents), as ``advance(n)``."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    columns = (TextColumn("{task.percentage:>3.0f}%"), TimeRemainingColumn())
    with Progress(TextColumn(description), BarColumn(), *columns) as progress:
        task = progress.add_task(description, total=max(total, 1))
        yield lambda n: progress.advance(task, n)
