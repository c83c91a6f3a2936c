"""Conversations and preference pairs as tfds datasets of packed token windows, built offline.

Two builders read JSONL files (one row a line, as Hugging Face datasets hold chat
data) and tokenize them once, with a progress bar, into windows for post-training:

* ``chat/files=GLOB,tokenizer=PATH[,template=PATH][,block_size=N][,pack=True|False]``
  (supervised fine-tuning). A row is ``{"messages": [{"role", "content"}, ...]}``:
  rendered through the chat template, the loss on the assistant's tokens; or
  ``{"prompt", "completion"}``: strings, the text ``prompt + completion`` with the
  eos token appended to the completion, the loss on the completion's tokens (TRL's
  SFTTrainer); or message lists, ``prompt + completion`` rendered, the loss on the
  completion's assistant tokens (TRL's ``completion_only_loss`` with
  ``assistant_only_loss``).
* ``preferences/files=GLOB,tokenizer=PATH[,template=PATH][,block_size=N][,pack=...]``
  (DPO and its kin). A row is ``{"prompt", "chosen", "rejected"}``: strings,
  ``prompt + chosen`` and ``prompt + rejected`` each with the eos token appended; or
  a prompt message list and chosen/rejected assistant message lists, rendered through
  the template. Without ``prompt`` (TRL's implicit prompt), ``chosen`` and
  ``rejected`` are whole conversations and their shared beginning is the prompt. As
  in TRL's DPOTrainer, the prompt is the tokens that the prompt alone (with the
  assistant header) shares with both sequences, and the loss covers every token
  after it.

``tokenizer=`` is a Hugging Face ``tokenizer.json`` or the directory holding it; its
chat template is the one transformers would use
(`experiments.datasets.tokenizers.find_chat_template`), or ``template=PATH``'s (a jinja
file), rendered and encoded as ``apply_chat_template`` does
(`experiments.datasets.chat_template`; plain strings as ``tokenizer(text)`` encodes
them, with the tokenizer.json's own special tokens). Rows may carry ``tools`` (JSON
schemas) and ``chat_template_kwargs``, as TRL reads them.

Every example is ``{"tokens": int32[L + 1], "segments": int32[L + 1], "loss_mask":
uint8[L + 1]}`` with ``L = block_size`` (default 1024). Each sequence starts at its
first token (its BOS where the template writes one). ``segments`` numbers a window's
sequences from 1 (0 is padding): conversations 1, 2, ...; pair ``p`` has its chosen
sequence in ``2p + 1`` and its rejected one in ``2p + 2``, chosen first.
``loss_mask[t]`` is 1 where token ``t`` is to be predicted; a sequence's first token
never is (nothing before it in its sequence predicts it). Padding is the tokenizer's
pad token (else its eos, else 0), segment 0, mask 0. With ``pack=True`` (the default)
whole conversations (whole pairs) are placed in windows by first-fit decreasing, never
split; with ``pack=False`` each has a window of its own. One longer than a window is
truncated and counted: a conversation keeps its start (and is dropped, counted, when
no assistant token is left); a pair keeps its prompt and cuts its responses' ends,
the longer first, and is dropped when its prompt twice (and a token of each response)
does not fit.

Splits: a row is in ``test`` when the hash of its name (``FILE:LINE``, the file
relative to the files' common folder) falls in the test fraction (5%), so the split is
the same on every machine; files so small that one split would be empty hold out their
last 5% of rows instead (at least one, of the rows that fit a window). The prepared copy
lives under ``DATA_DIR/chat/block1024_<digest>_<tokenizer fingerprint>``
(``block1024_unpacked_...`` with ``pack=False``), the digest naming the files'
contents, the template and its variables, the pad token, the block size and the
packing: a change to any builds a new copy. Its ``metadata.json`` records the tokenizer
(`experiments.datasets.text.recorded_tokenizer`: the LM refuses another
``config.tokenizer``), the template's digest and per split the rows, windows, tokens,
trained tokens, fill rate, truncated and dropped rows, which `describe` puts in a line.
Rows are tokenized in pieces of about 1 MB, on one process per CPU (``workers=N``
overrides it) when the files pass 8 MB: a script that builds the data needs the
``if __name__ == "__main__":`` guard of spawned processes.

A row that cannot be used (not JSON, a message without ``role``/``content``, a
conversation without an assistant turn, a preference row without ``chosen`` or
``rejected``, messages and no chat template, a template that fails on the row) is a
`DatasetError` naming ``FILE:LINE``, raised before anything is written to data_dir.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import tensorflow_datasets as tfds

from experiments.datasets.base import LocalBuilder
from experiments.datasets.chat_template import ChatEncoder, Encoded, load_encoder
from experiments.datasets.corpus import (
    Document,
    TokenStore,
    file_documents,
    map_in_order,
    progress_bar,
)
from experiments.datasets.text import TEST_FRACTION, is_test_document
from replicator.errors import ConfigError, DatasetError, UserError

_PARALLEL_BYTES = 8 * 2**20  # files this big are tokenized by several processes
_TASK_BYTES = 2**20  # and handed to them in line-aligned pieces of about this size
KINDS = {"chat": ("conversations", "assistant"), "preferences": ("pairs", "responses")}


@dataclasses.dataclass(eq=False)
class ConversationConfig(tfds.core.BuilderConfig):
    """A builder config: which files, tokenized how, in which windows.

    Attributes:
      files: the glob of JSONL files.
      tokenizer: a ``tokenizer.json`` or its directory.
      template: a jinja file that wins over the tokenizer's chat template, or None.
      block_size: examples hold ``block_size + 1`` tokens.
      pack: several conversations (pairs) per window.
    """

    files: str = ""
    tokenizer: str = ""
    template: str | None = None
    block_size: int = 1024
    pack: bool = True


def pack_windows(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """First-fit decreasing: the indices of ``lengths`` in windows of ``capacity`` tokens,
    longest first, each in the first window with room (every length <= capacity).

    >>> pack_windows([3, 5, 2, 4, 1], 6)
    [[1, 4], [3, 2], [0]]
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    leaves = 1 << max(0, len(lengths) - 1).bit_length()
    room = [capacity] * (2 * leaves)  # a max tree: node k holds the most room below it
    windows: list[list[int]] = []
    for index in order:
        size, node = lengths[index], 1
        while node < leaves:
            node = 2 * node if room[2 * node] >= size else 2 * node + 1
        window = node - leaves
        room[node] -= size
        while node > 1:
            node //= 2
            room[node] = max(room[2 * node], room[2 * node + 1])
        if window == len(windows):
            windows.append([])
        windows[window].append(index)
    return windows


def truncate_pair(chosen: int, rejected: int, prompt: int, capacity: int) -> tuple[int, int] | None:
    """The lengths a pair keeps to fit in ``capacity`` tokens: its prompt whole in both
    sequences, the responses cut at their ends, the longer first; None (dropped) when
    the prompt twice and a token of each response do not fit.

    >>> truncate_pair(10, 4, 2, 20), truncate_pair(10, 4, 2, 12), truncate_pair(8, 8, 5, 11)
    ((10, 4), (8, 4), None)
    """
    if chosen + rejected <= capacity:
        return chosen, rejected
    budget = capacity - 2 * prompt
    if budget < 2:
        return None
    kept_chosen = min(chosen - prompt, max(budget // 2, budget - (rejected - prompt)))
    kept_rejected = min(rejected - prompt, budget - kept_chosen)
    return prompt + kept_chosen, prompt + kept_rejected


def test_rows(
    names: Sequence[str], usable: np.ndarray | None = None, test_fraction: float = TEST_FRACTION
) -> np.ndarray:
    """Which rows are in ``test``: by the hash of their names, or where that leaves no
    ``usable`` row (one that fits a window) on one side, the last ``ceil(test_fraction)``
    of the usable rows, at least one.

    >>> test_rows(["a.jsonl:1", "a.jsonl:2", "a.jsonl:3"]).tolist()
    [False, False, True]
    """
    flags = np.array([is_test_document(name, test_fraction) for name in names], bool)
    usable = np.ones(len(names), bool) if usable is None else np.asarray(usable, bool)
    if flags[usable].all() or not flags[usable].any():
        indices = np.flatnonzero(usable)
        held_out = max(1, math.ceil(test_fraction * len(indices)))
        flags = np.zeros(len(names), bool)
        flags[indices[len(indices) - held_out :]] = True
    return flags


def describe(metadata: Mapping[str, Any], split: str = "train") -> str:
    """One line on a prepared split, for the start of a run.

    Args:
      metadata: the dataset's ``info.metadata`` (its ``metadata.json``).
      split: which split.

    >>> stats = {"rows": 1203, "dropped": 3, "windows": 310, "tokens": 290000, "trained": 120000,
    ...          "fill": 0.968, "truncated": 3}
    >>> print(describe({"kind": "chat", "block_size": 1024, "splits": {"train": stats}}))
    ... # doctest: +NORMALIZE_WHITESPACE
    chat data: 1,200 conversations in 310 windows of 1,025 (fill 96.8%), 290,000 tokens,
    120,000 trained (assistant); 3 truncated, 3 dropped
    """
    stats, (rows, trained) = metadata["splits"][split], KINDS[metadata["kind"]]
    kind = "preference" if metadata["kind"] == "preferences" else metadata["kind"]
    kept, windows = stats["rows"] - stats["dropped"], stats["windows"]
    line = (
        f"{kind} data: {kept:,} {rows if kept != 1 else rows[:-1]} in {windows:,} "
        f"window{'s' if windows != 1 else ''} of {metadata['block_size'] + 1:,} "
        f"(fill {stats['fill']:.1%}), {stats['tokens']:,} tokens, {stats['trained']:,} "
        f"trained ({trained})"
    )
    counts = [f"{stats[k]:,} {k}" for k in ("truncated", "dropped") if stats[k]]
    return line + (f"; {', '.join(counts)}" if counts else "")


class _Inputs(NamedTuple):
    """What a builder reads, checked: its files, tokenizer and template, and its name."""

    documents: list[Document]
    encoder: ChatEncoder
    name: str


def _inputs(kind: str, config: ConversationConfig) -> _Inputs:
    example = f"{kind}/files=GLOB,tokenizer=PATH"
    if not config.files or not config.tokenizer:
        missing = "files" if not config.files else "tokenizer"
        raise DatasetError(f"name the {kind} dataset's {missing}: {example}")
    if isinstance(config.block_size, bool) or not isinstance(config.block_size, int):
        raise DatasetError(f"{kind}: block_size must be a whole number, got {config.block_size!r}")
    if config.block_size < 1:
        raise DatasetError(f"{kind}: block_size must be at least 1, got {config.block_size}")
    try:
        documents = file_documents(config.files)
    except ValueError:
        message = f"{kind}: no file matches files={config.files!r}; name JSONL files (a glob)"
        raise DatasetError(message) from None
    try:
        encoder = load_encoder(config.tokenizer, config.template)
    except ConfigError as e:  # the tokenizer cannot be read: a mistake in the data's name
        raise DatasetError(str(e)) from None
    digest = hashlib.sha256(repr((kind, config.block_size, config.pack)).encode())
    digest.update(f"{encoder.template_digest}\0{encoder.pad_id}\0".encode())
    for document in documents:
        digest.update(f"{document.name}\0{_file_digest(document)}\0".encode())
    packing = "" if config.pack else "_unpacked"
    name = f"block{config.block_size}{packing}_{digest.hexdigest()[:12]}_{encoder.fingerprint}"
    return _Inputs(documents, encoder, name)


def _encoder_description(encoder: ChatEncoder) -> dict[str, Any]:
    """What the metadata records of the tokenizer and the template."""
    template = encoder.template
    return {
        "tokenizer": encoder.fingerprint, "vocab_size": encoder.tokenizer.vocab_size,
        "eos_id": encoder.tokenizer.eos_id, "pad_id": encoder.pad_id,
        "template": encoder.template_digest,
        "template_origin": template.origin if template is not None else None,
    }  # fmt: skip


def _file_digest(document: Document) -> str:
    stat = document.path.stat()
    return _content_digest(str(document.path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=4096)
def _content_digest(path: str, size: int, mtime_ns: int) -> str:
    del size, mtime_ns  # the cache's key: a file rewritten is read again
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(2**20), b""):
            digest.update(block)
    return digest.hexdigest()


class _Chunk(NamedTuple):
    """Whole lines of one file: bytes ``[start, stop)``, the first being line ``first_line``."""

    path: str
    name: str
    first_line: int
    start: int
    stop: int


def _chunks(documents: Sequence[Document]) -> list[_Chunk]:
    chunks = []
    for document in documents:
        size, start, line = document.path.stat().st_size, 0, 1
        with open(document.path, "rb") as f:
            while start < size:
                f.seek(min(start + _TASK_BYTES, size) - 1)
                f.readline()
                stop = f.tell()
                f.seek(start)
                chunks.append(_Chunk(str(document.path), document.name, line, start, stop))
                line += f.read(stop - start).count(b"\n")
                start = stop
    return chunks


def _encode_chunk(task: tuple) -> list[tuple[str, Encoded]]:
    chunk, kind, settings = task
    encoder = _worker_encoder(*settings)
    with open(chunk.path, "rb") as f:
        f.seek(chunk.start)
        lines = f.read(chunk.stop - chunk.start).split(b"\n")
    encoded = []
    for number, line in enumerate(lines, chunk.first_line):
        if not line.strip():
            continue
        where = f"{chunk.path}:{number}"
        try:
            row = json.loads(line.decode("utf-8"))
            if not isinstance(row, dict):
                raise DatasetError(f"each line must be a JSON object, not {type(row).__name__}")
            encoded.append((f"{chunk.name}:{number}", encoder.encode(kind, row)))
        except UnicodeDecodeError:
            raise DatasetError(f"{where}: not UTF-8 text") from None
        except json.JSONDecodeError as e:
            raise DatasetError(f"{where}: not a JSON line ({e.msg}, column {e.colno})") from None
        except DatasetError as e:
            raise DatasetError(f"{where}: {e}") from None
    return encoded


@functools.lru_cache(maxsize=4)
def _worker_encoder(*settings) -> ChatEncoder:
    return ChatEncoder.from_settings(settings)


class _Rows:
    """Every row's sequences, tokenized, in scratch files; their lengths and trained
    tokens in memory."""

    def __init__(self, per_row: int):
        self.per_row, self.names, self.prompts = per_row, [], []
        self.lengths: list[tuple[int, ...]] = []
        self.trained: list[tuple[int, ...]] = []
        self._ids, self._masks = TokenStore(), TokenStore()

    def append(self, name: str, encoded: Encoded) -> None:
        self.names.append(name)
        self.prompts.append(encoded.prompt)
        self.lengths.append(tuple(len(ids) for ids, _ in encoded.sequences))
        self.trained.append(tuple(int(mask.sum()) for _, mask in encoded.sequences))
        for ids, mask in encoded.sequences:
            self._ids.append(name, ids)
            self._masks.append(name, mask.astype(np.int32))

    def sequences(self, row: int) -> list[tuple[np.ndarray, np.ndarray]]:
        first = row * self.per_row
        return [
            (self._ids.read(i), self._masks.read(i).astype(np.uint8))
            for i in range(first, first + self.per_row)
        ]


def _encode_files(inputs: _Inputs, kind: str, workers: int | None) -> _Rows:
    chunks = _chunks(inputs.documents)
    total = sum(chunk.stop - chunk.start for chunk in chunks)
    if workers is None:
        workers = (os.cpu_count() or 1) if total > _PARALLEL_BYTES else 0
    rows = _Rows(per_row=1 if kind == "chat" else 2)
    tasks = [(chunk, kind, inputs.encoder.settings) for chunk in chunks]
    files = f"{len(inputs.documents)} file{'s' if len(inputs.documents) != 1 else ''}"
    with progress_bar(
        f"Tokenizing {kind}: {files} ({inputs.encoder.fingerprint})", total
    ) as advance:
        for chunk, encoded in zip(chunks, map_in_order(_encode_chunk, tasks, workers)):
            for name, row in encoded:
                rows.append(name, row)
            advance(chunk.stop - chunk.start)
    return rows


class _Split(NamedTuple):
    """One split's windows (each a list of ``(row, kept lengths)``) and its counts."""

    windows: list[list[tuple[int, tuple[int, ...]]]]
    stats: dict[str, int | float]


def _fit(rows: _Rows, row: int, capacity: int) -> tuple[tuple[int, ...] | None, int]:
    """The lengths row ``row``'s sequences keep in a window (None: dropped), and how many
    tokens of them are trained."""
    lengths = rows.lengths[row]
    if sum(lengths) <= capacity:
        return lengths, sum(rows.trained[row])
    if rows.per_row == 1:
        ((_, mask),) = rows.sequences(row)
        trained = int(mask[:capacity].sum())
        return ((capacity,), trained) if trained else (None, 0)
    kept = truncate_pair(*lengths, rows.prompts[row], capacity)
    if kept is None:
        return None, 0
    return kept, sum(int(m[:n].sum()) for (_, m), n in zip(rows.sequences(row), kept))


def _pack_split(
    rows: _Rows, members: np.ndarray, fits: list[tuple], capacity: int, pack: bool
) -> _Split:
    units, trained, truncated, dropped = [], 0, 0, 0
    for row in members.tolist():
        kept, kept_trained = fits[row]
        truncated += kept is not None and kept != rows.lengths[row]
        dropped += kept is None
        if kept is not None:
            units.append((row, kept))
            trained += kept_trained
    sizes = [sum(kept) for _, kept in units]
    groups = pack_windows(sizes, capacity) if pack else [[i] for i in range(len(units))]
    tokens = sum(sizes)
    stats = {
        "rows": len(members), "windows": len(groups), "tokens": tokens, "trained": trained,
        "fill": tokens / (len(groups) * capacity) if groups else 0.0,
        "truncated": truncated, "dropped": dropped,
    }  # fmt: skip
    return _Split([[units[i] for i in group] for group in groups], stats)


def _lay_out(
    rows: _Rows, window: list[tuple[int, tuple[int, ...]]], capacity: int, pad_id: int
) -> dict[str, np.ndarray]:
    tokens = np.full(capacity, pad_id, np.int32)
    segments, loss_mask = np.zeros(capacity, np.int32), np.zeros(capacity, np.uint8)
    at = segment = 0
    for row, kept in window:
        for (ids, mask), length in zip(rows.sequences(row), kept):
            segment += 1
            tokens[at : at + length] = ids[:length]
            segments[at : at + length] = segment
            loss_mask[at : at + length] = mask[:length]
            at += length
    return {"tokens": tokens, "segments": segments, "loss_mask": loss_mask}


class _Plan(NamedTuple):
    rows: _Rows
    splits: dict[str, _Split]


class _ConversationBuilder(LocalBuilder, skip_registration=True):
    """What the two builders share: rows of JSONL files, tokenized once, packed into
    windows of ``block_size + 1`` tokens, every row checked before anything is written."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Initial release."}
    KIND = ""

    def __init__(
        self,
        *,
        files: str = "",
        tokenizer: str = "",
        template: str | None = None,
        block_size: int = 1024,
        pack: bool | str = True,
        workers: int | None = None,
        **kwargs,
    ):
        if kwargs.get("config") is not None:
            raise ValueError(
                f"Name the {self.KIND} dataset by its files: {self.KIND}/files=GLOB,..."
            )
        if isinstance(pack, str) and pack.lower() in ("true", "false"):
            pack = pack.lower() == "true"
        config = ConversationConfig(
            name="", files=files, tokenizer=tokenizer, template=template, block_size=block_size,
            pack=pack, description=f"{self.KIND} rows of files matching {files!r}",
        )  # fmt: skip
        self._workers, self._plan, self._problem = workers, None, None
        try:
            if not isinstance(pack, bool):
                raise DatasetError(f"{self.KIND}: pack is True or False, got {pack!r}")
            self._inputs = _inputs(self.KIND, config)
            config.name = self._inputs.name
        except UserError as e:
            # tfds prefixes what a builder's constructor raises with its arguments; the
            # mistake is raised as it is when the dataset is built (download_and_prepare).
            self._inputs, self._problem = None, e
            arguments = repr((files, tokenizer, template, block_size, pack)).encode()
            config.name = f"unusable_{hashlib.sha256(arguments).hexdigest()[:12]}"
        super().__init__(config=config, **kwargs)

    def _info(self) -> tfds.core.DatasetInfo:
        config = self.builder_config
        usable = self._inputs is not None  # else the block size may not even be a number
        shape = (config.block_size + 1,) if usable else (None,)
        features = tfds.features.FeaturesDict(
            {
                "tokens": tfds.features.Tensor(shape=shape, dtype=np.int32),
                "segments": tfds.features.Tensor(shape=shape, dtype=np.int32),
                "loss_mask": tfds.features.Tensor(shape=shape, dtype=np.uint8),
            }
        )
        metadata = tfds.core.MetadataDict(
            kind=self.KIND,
            block_size=config.block_size,
            pack=config.pack,
            tokenizer_spec=config.tokenizer,
        )
        if self._inputs is not None:
            metadata.update(_encoder_description(self._inputs.encoder))
        description = f"{self.KIND} windows of {config.description}; 5% of rows test."
        return tfds.core.DatasetInfo(
            builder=self, description=description, features=features, metadata=metadata
        )

    def download_and_prepare(self, *args, **kwargs) -> None:
        # Every row is read, checked and packed first: a mistake leaves data_dir untouched.
        if self._plan is None and not self.is_prepared():
            self._plan = self._make_plan()
        super().download_and_prepare(*args, **kwargs)

    def _make_plan(self) -> _Plan:
        if self._problem is not None:
            raise self._problem
        config = self.builder_config
        rows = _encode_files(self._inputs, self.KIND, self._workers)
        if not rows.names:
            raise DatasetError(f"{self.KIND}: the files matching {config.files!r} hold no rows")
        capacity = config.block_size + 1
        fits = [_fit(rows, row, capacity) for row in range(len(rows.names))]
        usable = np.array([kept is not None for kept, _ in fits])
        if usable.sum() < 2:
            raise DatasetError(
                f"{self.KIND}: {int(usable.sum())} of the {len(usable)} rows in files matching "
                f"{config.files!r} fit a window of {capacity} tokens; a train and a test split "
                "need two (more rows, or a larger block_size)"
            )
        tests = test_rows(rows.names, usable)
        splits = {
            split: _pack_split(rows, np.flatnonzero(members), fits, capacity, config.pack)
            for split, members in (("train", ~tests), ("test", tests))
        }
        return _Plan(rows, splits)

    def summary(self, split: str) -> str:
        """`describe` of a prepared ``split`` (the train command logs it as it starts)."""
        return describe(self.info.metadata, split)

    def _split_generators(self, dl_manager: tfds.download.DownloadManager) -> dict:
        del dl_manager  # the files are local
        plan = self._plan or self._make_plan()
        self.info.metadata["splits"] = {name: split.stats for name, split in plan.splits.items()}
        return {name: self._generate_examples(plan, name) for name in plan.splits}

    def _generate_examples(self, plan: _Plan, split: str) -> Iterator[tuple[int, dict]]:
        capacity, pad_id = self.builder_config.block_size + 1, self._inputs.encoder.pad_id
        for index, window in enumerate(plan.splits[split].windows):
            yield index, _lay_out(plan.rows, window, capacity, pad_id)


class Chat(_ConversationBuilder):
    """Conversations for supervised fine-tuning:
    ``chat/files=GLOB,tokenizer=PATH[,template=PATH][,block_size=N][,pack=False]``
    (the module docstring says what a row is and how windows are laid out).

    Args:
      files: a glob of JSONL files (``**`` matches folders recursively).
      tokenizer: a Hugging Face ``tokenizer.json`` or the directory holding it.
      template: a jinja chat template that wins over the tokenizer's.
      block_size: examples hold ``block_size + 1`` tokens.
      pack: several conversations per window (first-fit decreasing) or one each.
      workers: processes that tokenize (None: one per CPU for files over 8 MB).
      **kwargs: `tfds.core.DatasetBuilder`'s (``data_dir``, ``file_format``...).
    """

    KIND = "chat"


class Preferences(_ConversationBuilder):
    """Preference pairs for DPO and its kin:
    ``preferences/files=GLOB,tokenizer=PATH[,template=PATH][,block_size=N][,pack=False]``
    (the module docstring says what a row is and how windows are laid out).

    Args: as `Chat`'s; ``pack`` places whole pairs, chosen then rejected.
    """

    KIND = "preferences"
