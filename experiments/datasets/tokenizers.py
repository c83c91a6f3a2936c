"""Tokenizers for the language model: bytes, or a local tokenizer file of the common kinds.

`load_tokenizer` takes the config's ``tokenizer`` value:

* ``"bytes"``: UTF-8 bytes, vocabulary 256, documents separated by the byte 0.
* a Hugging Face ``tokenizer.json`` (the ``tokenizers`` library; Llama 3, Qwen2,
  GPT-2, Mistral ship one). A ``tokenizer_config.json`` beside it names the
  ``eos_token``/``bos_token``; without one the usual names are looked up
  (``</s>``, ``<|endoftext|>``, ``<|end_of_text|>``, ``<eos>``). Both files (and
  ``special_tokens_map.json``) are what an export copies.
* a sentencepiece model (``.model``, protobuf; Llama 2, Mistral, T5): its own
  ``eos_id``/``bos_id``.
* a tiktoken BPE file (lines of ``base64-token rank``; ``.tiktoken``, or
  Llama 3's original ``tokenizer.model``): tiktoken's `load_tiktoken_bpe` and
  an `tiktoken.Encoding` with a split pattern and special tokens from a preset,
  chosen with a suffix ``PATH:PRESET``; the default is ``llama3``:

  ============  ================================  ==================================
  preset        split pattern                     special tokens (ids after the file's)
  ============  ================================  ==================================
  ``llama3``    Llama 3's (= cl100k's, written    Llama 3's 256: ``<|begin_of_text|>``
                without possessive quantifiers)   (bos), ``<|end_of_text|>`` (eos), ...
  ``cl100k``    cl100k_base's                     ``<|endoftext|>`` (eos)
  ``o200k``     o200k_base's                      ``<|endoftext|>`` (eos)
  ``gpt2``      GPT-2's (r50k_base)               ``<|endoftext|>`` (eos)
  ============  ================================  ==================================

Every file is local and read once; a missing or unreadable one is a one-line
`ConfigError`. A ``.model`` file is told apart by its content (a tiktoken file
is text, a sentencepiece model protobuf). `Tokenizer.fingerprint` names the kind
and a digest of the file's bytes (and, for tiktoken, of the preset), so data
tokenized by one tokenizer is never read as another's; `Tokenizer.files` are what
an export copies beside the weights.
"""

from __future__ import annotations

import abc
import base64
import functools
import hashlib
import json
import os
from collections.abc import Sequence

from replicator.errors import ConfigError

BYTES = "bytes"
# The names a tokenizer.json's end-of-document / start-of-document tokens go by.
EOS_NAMES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|eos|>")
BOS_NAMES = ("<s>", "<|begin_of_text|>", "<bos>", "<|startoftext|>")
_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_SPECIALS = (
    "<|begin_of_text|>", "<|end_of_text|>",
    *(f"<|reserved_special_token_{i}|>" for i in range(4)),
    "<|start_header_id|>", "<|end_header_id|>", "<|reserved_special_token_4|>", "<|eot_id|>",
    *(f"<|reserved_special_token_{i}|>" for i in range(5, 251)),
)  # fmt: skip


class Tokenizer(abc.ABC):
    """Text to token ids and back.

    Attributes:
      vocab_size: ids are in ``[0, vocab_size)`` (special tokens included).
      eos_id: the id that ends a document (the separator between documents), or None.
      bos_id: the id that starts one, or None.
      fingerprint: ``KIND`` or ``KIND-DIGEST``: which tokenizer this is, by content.
      files: the tokenizer's files, which an export copies beside the weights.
    """

    vocab_size: int
    eos_id: int | None
    bos_id: int | None
    fingerprint: str
    files: tuple[str, ...]

    @abc.abstractmethod
    def encode(self, text: str) -> list[int]:
        """The ids of ``text``, without special tokens added."""

    @abc.abstractmethod
    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids``."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.fingerprint}, vocab_size={self.vocab_size})"


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes: vocabulary 256, documents separated by the byte 0."""

    vocab_size, eos_id, bos_id, fingerprint, files = 256, 0, None, BYTES, ()

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class HuggingFaceTokenizer(Tokenizer):
    """A Hugging Face ``tokenizer.json``, through the ``tokenizers`` library."""

    def __init__(self, path: str, data: bytes, named: dict[str, str]):
        import tokenizers

        try:
            self._tokenizer = tokenizers.Tokenizer.from_str(data.decode("utf-8"))
        except Exception as e:  # the library raises a bare Exception on bad JSON
            message = f"tokenizer {path} is not a Hugging Face tokenizer.json: {e}"
            raise ConfigError(message) from None
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        self.eos_id = self._first_id(named.get("eos_token"), *EOS_NAMES)
        self.bos_id = self._first_id(named.get("bos_token"), *BOS_NAMES)
        # The separator the data holds is part of what the tokenizer is.
        self.fingerprint = f"hf-{_digest(data + f'{self.eos_id},{self.bos_id}'.encode())}"
        beside = ("tokenizer_config.json", "special_tokens_map.json")
        others = [os.path.join(os.path.dirname(path), name) for name in beside]
        self.files = (path, *(f for f in others if os.path.isfile(f)))

    def _first_id(self, *names: str | None) -> int | None:
        ids = (self._tokenizer.token_to_id(n) for n in names if n)
        return next((i for i in ids if i is not None), None)

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)


class SentencePieceTokenizer(Tokenizer):
    """A sentencepiece model (``.model``), through the ``sentencepiece`` library."""

    def __init__(self, path: str, data: bytes):
        spm = _import("sentencepiece", path)
        self._processor = spm.SentencePieceProcessor()
        try:
            self._processor.LoadFromSerializedProto(data)
        except (RuntimeError, OSError, TypeError) as e:
            raise ConfigError(f"tokenizer {path} is not a sentencepiece model: {e}") from None
        self.vocab_size = self._processor.get_piece_size()
        self.eos_id = _id_or_none(self._processor.eos_id())
        self.bos_id = _id_or_none(self._processor.bos_id())
        self.fingerprint = f"sentencepiece-{_digest(data)}"
        self.files = (path,)

    def encode(self, text: str) -> list[int]:
        return self._processor.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self._processor.decode([int(i) for i in ids])


class TiktokenTokenizer(Tokenizer):
    """A tiktoken BPE file (``base64-token rank`` lines) with a preset's split pattern and
    special tokens (`TIKTOKEN_PRESETS`), whose ids follow the file's ranks."""

    def __init__(self, path: str, data: bytes, preset: str = "llama3"):
        tiktoken = _import("tiktoken", path)
        from tiktoken.load import load_tiktoken_bpe

        try:  # the hash keeps tiktoken's cache (by path) from serving an older file
            ranks = load_tiktoken_bpe(path, expected_hash=hashlib.sha256(data).hexdigest())
        except ValueError as e:
            raise ConfigError(f"tokenizer {path} is not a tiktoken BPE file: {e}") from None
        pattern, specials, eos, bos = TIKTOKEN_PRESETS[preset]
        first = max(ranks.values(), default=-1) + 1
        special_ids = {name: first + i for i, name in enumerate(specials)}
        self._encoding = tiktoken.Encoding(
            name=os.path.basename(path), pat_str=pattern, mergeable_ranks=ranks,
            special_tokens=special_ids,
        )  # fmt: skip
        self.vocab_size = self._encoding.n_vocab
        self.eos_id, self.bos_id = special_ids.get(eos), special_ids.get(bos)
        self.fingerprint = f"tiktoken-{_digest(data + preset.encode())}"
        self.files = (path,)

    def encode(self, text: str) -> list[int]:
        return self._encoding.encode_ordinary(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self._encoding.decode([int(i) for i in ids])


_CL100K_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++"""
    r"""[\r\n]*+|\s++$|\s*[\r\n]|\s+(?!\S)|\s"""
)
_O200K_PATTERN = "|".join(
    [
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"""
        r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"""
        r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)
_GPT2_PATTERN = (
    r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
)
_ENDOFTEXT = ("<|endoftext|>",)

# preset -> (split pattern, special tokens in id order, eos, bos): the patterns are
# tiktoken_ext.openai_public's and Meta's llama3 tokenizer.py's.
TIKTOKEN_PRESETS = {
    "llama3": (_LLAMA3_PATTERN, _LLAMA3_SPECIALS, "<|end_of_text|>", "<|begin_of_text|>"),
    "cl100k": (_CL100K_PATTERN, _ENDOFTEXT, "<|endoftext|>", None),
    "o200k": (_O200K_PATTERN, _ENDOFTEXT, "<|endoftext|>", None),
    "gpt2": (_GPT2_PATTERN, _ENDOFTEXT, "<|endoftext|>", None),
}


def load_tokenizer(spec: str) -> Tokenizer:
    """The tokenizer that ``spec`` names: ``"bytes"`` or a local tokenizer file.

    Args:
      spec: ``"bytes"``; a ``tokenizer.json`` (Hugging Face); a sentencepiece
        ``.model``; a tiktoken BPE file, optionally ``PATH:PRESET`` with a
        preset of `TIKTOKEN_PRESETS` (default ``llama3``).

    Returns:
      The `Tokenizer`; the same object for the same spec and file content.

    Raises:
      ConfigError: the file is missing or unreadable, or of no known kind.

    >>> tokenizer = load_tokenizer("bytes")
    >>> tokenizer.encode("hé"), tokenizer.decode([104, 195, 169]), tokenizer.eos_id
    ([104, 195, 169], 'hé', 0)
    """
    if spec == BYTES:
        return ByteTokenizer()
    path, preset = _split_preset(spec)
    try:
        with open(os.path.expanduser(path), "rb") as f:
            data = f.read()
    except OSError as e:
        raise ConfigError(
            f"tokenizer {spec!r} cannot be read ({e.strerror or e}); name 'bytes' or a local "
            "tokenizer.json, sentencepiece .model or tiktoken BPE file"
        ) from None
    path = os.path.expanduser(path)
    named = _configured_specials(os.path.join(os.path.dirname(path), "tokenizer_config.json"))
    return _cached(path, preset, data, tuple(sorted(named.items())))


@functools.lru_cache(maxsize=8)
def _cached(path: str, preset: str | None, data: bytes, named: tuple) -> Tokenizer:
    kind = _kind(path, data)
    if preset is not None and kind != "tiktoken":
        raise ConfigError(f"tokenizer {path}:{preset}: a preset applies to tiktoken files only")
    if kind == "hf":
        return HuggingFaceTokenizer(path, data, dict(named))
    if kind == "tiktoken":
        return TiktokenTokenizer(path, data, preset or "llama3")
    return SentencePieceTokenizer(path, data)


def _split_preset(spec: str) -> tuple[str, str | None]:
    """``PATH:PRESET`` -> (PATH, PRESET) when PRESET is a tiktoken preset's name."""
    path, _, preset = spec.rpartition(":")
    if path and preset in TIKTOKEN_PRESETS and not os.path.exists(os.path.expanduser(spec)):
        return path, preset
    return spec, None


def _kind(path: str, data: bytes) -> str:
    """'hf', 'tiktoken' or 'sentencepiece', by extension and then by content."""
    if path.endswith(".json") or data.lstrip()[:1] == b"{":
        return "hf"
    if path.endswith(".tiktoken") or _looks_like_tiktoken(data):
        return "tiktoken"
    if path.endswith(".model"):
        return "sentencepiece"
    raise ConfigError(
        f"tokenizer {path} is of no known kind: expected a Hugging Face tokenizer.json, a "
        "sentencepiece .model or a tiktoken BPE file (.tiktoken)"
    )


def _looks_like_tiktoken(data: bytes) -> bool:
    head = data[:4096].splitlines()[:-1] or data.splitlines()[:1]
    try:
        for line in head:
            token, rank = line.split()
            base64.b64decode(token, validate=True)
            int(rank)
    except ValueError:  # binascii.Error is a ValueError; so is a bad split
        return False
    return bool(head)


def _configured_specials(path: str) -> dict[str, str]:
    """``eos_token``/``bos_token`` of a ``tokenizer_config.json`` (strings or AddedToken dicts)."""
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return {}
    named = {}
    for key in ("eos_token", "bos_token"):
        value = config.get(key) if isinstance(config, dict) else None
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            named[key] = value
    return named


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def _id_or_none(index: int) -> int | None:
    return index if index >= 0 else None


def _import(module: str, path: str):
    try:
        return __import__(module)
    except ImportError:
        raise ConfigError(
            f"tokenizer {path} needs the {module} package: pip install -e '.[tokenizers]'"
        ) from None
