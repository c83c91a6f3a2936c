"""Tokenizers for the language model: bytes, or a local tokenizer file of the common kinds.

`load_tokenizer` takes the config's ``tokenizer`` value:

* ``"bytes"``: UTF-8 bytes, vocabulary 256, documents separated by the byte 0.
* a Hugging Face ``tokenizer.json`` (the ``tokenizers`` library; Llama 3, Qwen2,
  GPT-2, Mistral ship one), or the directory holding it (a checkpoint's). A
  ``tokenizer_config.json`` beside it names the ``eos_token``/``bos_token``/``pad_token``;
  without one the usual names are looked up (``</s>``, ``<|endoftext|>``,
  ``<|end_of_text|>``, ``<eos>``). Both files (and ``special_tokens_map.json``) are
  what an export copies. Its chat template is found where transformers saves one
  (`find_chat_template`), with the special tokens' strings it sees
  (`template_variables`).
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
is text, a sentencepiece model protobuf); a directory stands for its ``tokenizer.json``
(else its ``tokenizer.model``). `Tokenizer.fingerprint` names the kind
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
import re
from collections.abc import Sequence

import numpy as np

from replicator.errors import ConfigError, DatasetError

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
      pad_id: the id a tokenizer_config.json names as its ``pad_token``, or None.
      fingerprint: ``KIND`` or ``KIND-DIGEST``: which tokenizer this is, by content.
      files: the tokenizer's files, which an export copies beside the weights.
    """

    vocab_size: int
    eos_id: int | None
    bos_id: int | None
    pad_id: int | None = None
    fingerprint: str
    files: tuple[str, ...]

    @abc.abstractmethod
    def encode(self, text: str) -> list[int]:
        """The ids of ``text``, without special tokens added."""

    @abc.abstractmethod
    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids``."""

    def token_bytes(self) -> np.ndarray:
        """``[vocab_size]`` int32: the UTF-8 bytes of text each id stands for (0 for a
        special token), so that a text's bytes are the sum over its ids: the denominator
        of bits per byte. (Here each id decoded alone; the kinds below read their
        vocabularies: a sentencepiece word-start mark counts as its space.)"""
        return np.array([len(self.decode([i]).encode()) for i in range(self.vocab_size)], np.int32)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.fingerprint}, vocab_size={self.vocab_size})"


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes: vocabulary 256, documents separated by the byte 0."""

    vocab_size, eos_id, bos_id, fingerprint, files = 256, 0, None, BYTES, ()

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def token_bytes(self) -> np.ndarray:
        return np.ones(self.vocab_size, np.int32)


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
        self.pad_id = self._first_id(named.get("pad_token"))
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

    def encode_with_offsets(
        self, text: str, *, add_special_tokens: bool = False
    ) -> tuple[list[int], list[tuple[int, int]]]:
        """The ids of ``text`` and each one's ``(start, end)`` characters in it, as
        transformers' fast tokenizers give them (``add_special_tokens``: the
        tokenizer.json's post-processor, BOS and the like, as ``tokenizer(text)`` adds)."""
        encoding = self._tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return encoding.ids, encoding.offsets

    def id_to_token(self, index: int) -> str | None:
        """The token string of ``index`` (``<|eot_id|>``), or None outside the vocabulary."""
        return self._tokenizer.id_to_token(int(index))

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)

    def token_bytes(self) -> np.ndarray:
        """Byte-level BPE (GPT-2, Llama 3, Qwen): a token's characters are its bytes (one
        character each, GPT-2's byte alphabet); else a sentencepiece-like vocabulary
        (``▁`` a space, ``<0xNN>`` one byte). Special tokens: 0."""
        description = json.loads(self._tokenizer.to_str())
        byte_level = "ByteLevel" in json.dumps(description.get("decoder"))
        specials = {t["id"] for t in description.get("added_tokens", ()) if t.get("special")}
        out = np.zeros(self.vocab_size, np.int32)
        for i in range(self.vocab_size):
            token = self._tokenizer.id_to_token(i)
            if token is None or i in specials:
                continue
            if byte_level:
                out[i] = len(token)
            elif re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", token):
                out[i] = 1
            else:
                out[i] = len(token.replace("\u2581", " ").encode())
        return out


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

    def token_bytes(self) -> np.ndarray:
        p, out = self._processor, np.zeros(self.vocab_size, np.int32)
        for i in range(self.vocab_size):
            if p.is_byte(i):
                out[i] = 1
            elif not (p.is_control(i) or p.is_unknown(i)):
                out[i] = len(p.id_to_piece(i).replace("\u2581", " ").encode())
        return out


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
        self._ranks, self._pattern, self._specials = ranks, pattern, specials  # tokenizer_export

    def encode(self, text: str) -> list[int]:
        return self._encoding.encode_ordinary(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self._encoding.decode([int(i) for i in ids])

    def token_bytes(self) -> np.ndarray:
        out = np.zeros(self.vocab_size, np.int32)
        specials = self._encoding.special_tokens_set
        for i in range(self.vocab_size):
            try:
                piece = self._encoding.decode_single_token_bytes(i)
            except KeyError:  # an id between the ranks (none in the presets' files)
                continue
            out[i] = 0 if piece.decode("utf-8", "replace") in specials else len(piece)
        return out


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
      spec: ``"bytes"``; a ``tokenizer.json`` (Hugging Face) or the directory holding
        it (`tokenizer_file`); a sentencepiece ``.model``; a tiktoken BPE file,
        optionally ``PATH:PRESET`` with a preset of `TIKTOKEN_PRESETS` (default ``llama3``).

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
    path = tokenizer_file(path)
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


def tokenizer_file(path: str) -> str:
    """The tokenizer file ``path`` names: itself, or for a directory (a checkpoint's) its
    ``tokenizer.json``, else its ``tokenizer.model``; a directory holding neither stays
    as it is (and cannot be read).

    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as d:
    ...     _ = open(os.path.join(d, "tokenizer.json"), "w").close()
    ...     tokenizer_file(d) == os.path.join(d, "tokenizer.json")
    True
    """
    if not os.path.isdir(os.path.expanduser(path)):
        return path
    names = ("tokenizer.json", "tokenizer.model")
    found = (os.path.join(path, n) for n in names if os.path.isfile(os.path.join(path, n)))
    return next(found, path)


# Where transformers saves a tokenizer's chat templates: one file, or named ones in a folder.
CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATES_DIR = "additional_chat_templates"


def find_chat_template(tokenizer: str, template: str | None = None) -> tuple[str, str] | None:
    """The chat template that goes with ``tokenizer``, found where transformers keeps it.

    In order: ``template`` (a jinja file) when given; ``additional_chat_templates/default.jinja``
    and ``chat_template.jinja`` beside the tokenizer; ``chat_template`` in
    ``tokenizer_config.json`` (a string, or a list of ``{name, template}``: the one named
    ``default``). As in transformers, template files win over tokenizer_config.json.

    Args:
      tokenizer: a ``tokenizer.json`` or the directory holding it.
      template: a jinja file that wins over the tokenizer's own.

    Returns:
      ``(source, origin)``: the template's text and where it was found, or None when the
      tokenizer has none.

    Raises:
      DatasetError: ``template`` cannot be read, or the tokenizer has several templates
        and none named ``default``.

    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as d:
    ...     _ = open(os.path.join(d, CHAT_TEMPLATE_FILE), "w").write("{{ messages }}")
    ...     find_chat_template(d)[0]
    '{{ messages }}'
    """
    if template is not None:
        try:
            with open(os.path.expanduser(template), encoding="utf-8") as f:
                return f.read(), template
        except (OSError, UnicodeDecodeError) as e:
            raise DatasetError(
                f"chat template {template!r} cannot be read ({getattr(e, 'strerror', None) or e}); "
                "name a jinja file with template=PATH"
            ) from None
    directory = _tokenizer_dir(tokenizer)
    # transformers reads the named templates after chat_template.jinja: a default.jinja wins.
    for name in (os.path.join(CHAT_TEMPLATES_DIR, "default.jinja"), CHAT_TEMPLATE_FILE):
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                return f.read(), path
    others = os.path.join(directory, CHAT_TEMPLATES_DIR)
    if os.path.isdir(others) and any(n.endswith(".jinja") for n in os.listdir(others)):
        raise DatasetError(
            f"{others} holds chat templates and none named 'default'; name one with template=PATH"
        )
    config_path = os.path.join(directory, "tokenizer_config.json")
    configured = _read_json(config_path).get("chat_template")
    if isinstance(configured, str):
        return configured, f"{config_path} (chat_template)"
    if isinstance(configured, list):
        named = {t.get("name"): t.get("template") for t in configured if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return named["default"], f"{config_path} (chat_template 'default')"
        raise DatasetError(
            f"{config_path} has chat templates {sorted(map(str, named))} and none named "
            "'default'; name one with template=PATH"
        )
    return None


def template_variables(tokenizer: str) -> dict[str, str]:
    """The special tokens' strings a chat template sees, as transformers passes them:
    ``bos_token``, ``eos_token``, ``pad_token``, ... (any ``*_token`` of
    ``tokenizer_config.json``, strings or AddedToken dicts, and its named
    ``extra_special_tokens``; ``special_tokens_map.json``'s where the config lists no
    ``added_tokens_decoder``, as transformers' legacy path reads it).

    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as d:
    ...     config = {"bos_token": {"content": "<s>"}, "add_bos_token": True}
    ...     _ = open(os.path.join(d, "tokenizer_config.json"), "w").write(json.dumps(config))
    ...     template_variables(d)
    {'bos_token': '<s>'}
    """
    directory = _tokenizer_dir(tokenizer)
    config = _read_json(os.path.join(directory, "tokenizer_config.json"))
    entries = dict(config)
    if "added_tokens_decoder" not in config:
        entries.update(_read_json(os.path.join(directory, "special_tokens_map.json")))
    extra = entries.get("extra_special_tokens")
    entries.update(extra if isinstance(extra, dict) else {})
    variables = {}
    for key, value in entries.items():
        value = value.get("content") if isinstance(value, dict) else value
        if key.endswith("_token") and isinstance(value, str):
            variables[key] = value
    return variables


def _tokenizer_dir(tokenizer: str) -> str:
    path = os.path.expanduser(tokenizer)
    return path if os.path.isdir(path) else os.path.dirname(path)


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


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
    """``eos_token``/``bos_token``/``pad_token`` of a ``tokenizer_config.json`` (strings or
    AddedToken dicts)."""
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return {}
    named = {}
    for key in ("eos_token", "bos_token", "pad_token"):
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
