"""A tokenizer written as transformers loads it: what an export writes beside the weights.

`write_for_transformers` writes any `experiments.datasets.tokenizers.Tokenizer` so that
``transformers.AutoTokenizer.from_pretrained(DIR)`` gives the same ids for a text (its
``encode(text, add_special_tokens=False)``, for text that holds no special token's
string) and the same end, start and pad tokens; `write_tokenizer` is the LM's export
hook (`replicator.trainer.export`). A tokenizer.json stays as it is; a sentencepiece
model is written where transformers looks for one (``tokenizer.model``), and it converts
it as it loads it, following the model's normalizer; a tiktoken file, and the bytes,
become a byte-level BPE tokenizer.json of the same ids. This module reads the
tokenizers' own settings (their private attributes: it is their exporter).
"""

from __future__ import annotations

import json
import os
import shutil

from experiments.datasets.tokenizers import (
    CHAT_TEMPLATE_FILE,
    CHAT_TEMPLATES_DIR,
    ByteTokenizer,
    HuggingFaceTokenizer,
    SentencePieceTokenizer,
    TiktokenTokenizer,
    Tokenizer,
    _read_json,
    load_tokenizer,
)
from replicator.errors import ConfigError

TRANSFORMERS_CLASS = "PreTrainedTokenizerFast"  # transformers' class of a tokenizer.json
TOKENIZER_CONFIG = "tokenizer_config.json"
_BESIDE = ("special_tokens_map.json", CHAT_TEMPLATE_FILE, CHAT_TEMPLATES_DIR)


def write_tokenizer(spec: str, directory: str) -> tuple[str, ...]:
    """The LM's export hook (`replicator.trainer.export`): `write_for_transformers` of the
    tokenizer ``spec`` names (``config.tokenizer``); returns the names written."""
    return write_for_transformers(load_tokenizer(spec), directory)


def write_for_transformers(tokenizer: Tokenizer, directory: str) -> tuple[str, ...]:
    """Writes ``tokenizer`` into ``directory`` as ``transformers.AutoTokenizer.from_pretrained``
    loads it: the same ids (``encode(text, add_special_tokens=False)``, text without
    special tokens' strings in it), the same end, start and pad tokens.

    Every kind gets a ``tokenizer_config.json`` naming the class (``PreTrainedTokenizerFast``)
    and the ``eos_token``/``bos_token``/``pad_token``; beside it:

    * a ``tokenizer.json``: itself (under that name), with ``special_tokens_map.json``
      and the chat template files that lie beside it; a ``tokenizer_config.json`` there
      is the one written, its chat template and settings kept, the tokens added where
      it names none;
    * a sentencepiece model: as ``tokenizer.model``, the name transformers looks for;
      it converts the model as it loads it, following the model's own normalizer;
    * a tiktoken file: converted to a byte-level BPE ``tokenizer.json`` (the merges from
      the ranks, the preset's split pattern and special tokens, the same ids);
    * the bytes: a byte-level ``tokenizer.json`` of the 256 bytes, each id its byte; no
      ``eos_token`` (the byte 0 is text to transformers; ``config.json`` has the id).

    Args:
      tokenizer: from `load_tokenizer`.
      directory: where to write (made if need be).

    Returns:
      The names written.

    Raises:
      ConfigError: a tiktoken file whose ranks are not 0 to n - 1 (no BPE has those ids).
    """
    os.makedirs(directory, exist_ok=True)
    if isinstance(tokenizer, HuggingFaceTokenizer):
        written, config = _copy_tokenizer_json(tokenizer, directory)
    elif isinstance(tokenizer, SentencePieceTokenizer):
        processor = tokenizer._processor
        with open(os.path.join(directory, "tokenizer.model"), "wb") as f:
            f.write(processor.serialized_model_proto())
        written, config = ["tokenizer.model"], {}
        if processor.unk_id() >= 0:
            config["unk_token"] = processor.id_to_piece(processor.unk_id())
    else:
        is_tiktoken = isinstance(tokenizer, TiktokenTokenizer)
        converted = _tiktoken_as_bpe(tokenizer) if is_tiktoken else _bytes_as_bpe()
        converted.save(os.path.join(directory, "tokenizer.json"))
        written, config = ["tokenizer.json"], {}
    config.setdefault("tokenizer_class", TRANSFORMERS_CLASS)
    named = {"eos_token": tokenizer.eos_id, "bos_token": tokenizer.bos_id}
    named["pad_token"] = tokenizer.pad_id
    for key, index in named.items():
        if index is not None and not config.get(key) and not isinstance(tokenizer, ByteTokenizer):
            config[key] = token_text(tokenizer, index)
    with open(os.path.join(directory, TOKENIZER_CONFIG), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)
        f.write("\n")
    return (*written, TOKENIZER_CONFIG)


def token_text(tokenizer: Tokenizer, index: int) -> str:
    """The string of token ``index`` as the tokenizer's vocabulary spells it
    (``<|end_of_text|>``, ``</s>``).

    >>> token_text(load_tokenizer("bytes"), 104)
    'h'
    """
    if isinstance(tokenizer, HuggingFaceTokenizer):
        return tokenizer.id_to_token(index)
    if isinstance(tokenizer, SentencePieceTokenizer):
        return tokenizer._processor.id_to_piece(int(index))
    return tokenizer.decode([index])


def _copy_tokenizer_json(tokenizer: HuggingFaceTokenizer, directory: str) -> tuple[list, dict]:
    """A tokenizer.json and the files beside it that transformers reads; the
    tokenizer_config.json there (or none), to complete."""
    source = tokenizer.files[0]
    shutil.copy(source, os.path.join(directory, "tokenizer.json"))
    written = ["tokenizer.json"]
    for name in _BESIDE:
        path = os.path.join(os.path.dirname(source), name)
        if os.path.isdir(path):
            shutil.copytree(path, os.path.join(directory, name))
        elif os.path.isfile(path):
            shutil.copy(path, directory)
        else:
            continue
        written.append(name)
    return written, _read_json(os.path.join(os.path.dirname(source), TOKENIZER_CONFIG))


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte-level alphabet, byte -> character (the ByteLevel pre-tokenizer's):
    printable bytes stand for themselves, the others for characters from U+0100 on."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}


def _byte_level_bpe(vocab: dict[str, int], merges: list[tuple[str, str]], pattern: str | None):
    """A byte-level BPE `tokenizers.Tokenizer`: text split by ``pattern`` (if any), each
    piece's bytes as GPT-2's characters; a piece in the vocabulary is one token, whole
    (``ignore_merges``, as tiktoken does)."""
    from tokenizers import Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    bpe = HFTokenizer(models.BPE(vocab, merges, fuse_unk=False, ignore_merges=True))
    split = [pre_tokenizers.Split(Regex(pattern), behavior="isolated")] if pattern else []
    bytes_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    bpe.pre_tokenizer = pre_tokenizers.Sequence([*split, bytes_level])
    bpe.decoder = decoders.ByteLevel()
    return bpe


def _bytes_as_bpe():
    alphabet = _byte_alphabet()
    return _byte_level_bpe({alphabet[b]: b for b in range(256)}, [], None)


def _tiktoken_as_bpe(tokenizer: TiktokenTokenizer):
    """The tiktoken file as a byte-level BPE with its ids: each token's merges are the
    splits of it into two tokens, ranked by the token's rank (tiktoken merges the pair
    whose union ranks lowest), then the preset's special tokens after the ranks."""
    from tokenizers import AddedToken

    ranks = tokenizer._ranks
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ConfigError(
            f"tokenizer {tokenizer.files[0]}: its ranks are not 0 to {len(ranks) - 1}, so no "
            "tokenizer.json has its ids; export cannot write it for transformers"
        )
    alphabet = _byte_alphabet()

    def spelled(piece: bytes) -> str:
        return "".join(alphabet[b] for b in piece)

    def splits(piece: bytes) -> list[tuple[bytes, bytes]]:
        pairs = [(piece[:i], piece[i:]) for i in range(1, len(piece))]
        pairs = [(a, b) for a, b in pairs if a in ranks and b in ranks]
        return sorted(pairs, key=lambda pair: (ranks[pair[0]], ranks[pair[1]]))

    ordered = sorted(ranks, key=ranks.__getitem__)
    merges = [(spelled(a), spelled(b)) for piece in ordered for a, b in splits(piece)]
    bpe = _byte_level_bpe({spelled(p): r for p, r in ranks.items()}, merges, tokenizer._pattern)
    specials = tokenizer._specials
    bpe.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    if any(bpe.token_to_id(s) != len(ranks) + i for i, s in enumerate(specials)):
        raise ConfigError(
            f"tokenizer {tokenizer.files[0]}: a special token of its preset is also one of its "
            "ranks; export cannot write it for transformers with the same ids"
        )
    return bpe
