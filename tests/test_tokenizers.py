"""Tokenizers (bytes, Hugging Face, sentencepiece, tiktoken) and tokenized corpora.

Every tokenizer is trained here on local text: a byte-level BPE with the
``tokenizers`` library, a sentencepiece BPE, and a tiktoken file written from the
BPE's vocabulary. Corpora of text, JSONL and parquet files prepare into windows
whose tokens decode back to the documents; the LM refuses data of another
tokenizer and a vocabulary too small for its tokenizer, in one line.
"""

import base64
import dataclasses
import json
import os
import pathlib

import numpy as np
import pytest
import tensorflow_datasets as tfds

from experiments.datasets import corpus, text
from experiments.datasets.tokenizers import TIKTOKEN_PRESETS, load_tokenizer
from experiments.lm.task import check_tokenizer
from replicator.errors import ConfigError
from replicator.trainer import data
from tests.helpers.cli import assert_one_line_error, run_cli

DOCUMENTS = [
    "def f(x):\n    return x * 2  # doubled\n",
    "Ünïcödé text — with  two spaces, tabs\tand emoji 😀.",
    " leading space and trailing newline\n\n",
    "The quick brown fox jumps over the lazy dog. " * 3,
    "数字 123 4567 and 'quotes' \"double\" [brackets] {braces}",
] + [f"document {i}: lorem ipsum dolor sit amet, {i * i} consectetur\n" for i in range(120)]


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte (HF's ByteLevel pre-tokenizer)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    chars = printable + [256 + i for i in range(len(others))]
    return {chr(c): b for b, c in zip(printable + others, chars)}


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict[str, str]:
    """A spec for each kind of tokenizer, trained on ``DOCUMENTS``."""
    import sentencepiece
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    root = tmp_path_factory.mktemp("tokenizers")
    corpus = root / "corpus.txt"
    corpus.write_text("\n".join(DOCUMENTS))
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    bpe.train_from_iterator(DOCUMENTS, trainer)
    (root / "hf").mkdir()
    bpe.save(str(root / "hf" / "tokenizer.json"))
    sentencepiece.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(root / "sp"), vocab_size=400, model_type="bpe",
        normalization_rule_name="identity", remove_extra_whitespaces=False,
        byte_fallback=True, character_coverage=1.0, minloglevel=2,
    )  # fmt: skip
    # tiktoken's format from the BPE: each token's bytes, ranked in the order BPE learnt them.
    vocab = json.loads((root / "hf" / "tokenizer.json").read_text())["model"]["vocab"]
    decoder = _byte_decoder()
    ranked = sorted((i, t) for t, i in vocab.items() if t != "<|endoftext|>")
    lines = [
        f"{base64.b64encode(bytes(decoder[c] for c in t)).decode()} {rank}"
        for rank, (_, t) in enumerate(ranked)
    ]
    (root / "bpe.tiktoken").write_text("\n".join(lines) + "\n")
    return {
        "hf": str(root / "hf" / "tokenizer.json"),
        "sentencepiece": str(root / "sp.model"),
        "tiktoken": str(root / "bpe.tiktoken"),
        "tiktoken_gpt2": str(root / "bpe.tiktoken") + ":gpt2",
    }


@pytest.mark.parametrize("kind", ["bytes", "hf", "sentencepiece", "tiktoken", "tiktoken_gpt2"])
def test_each_tokenizer_round_trips_a_corpus(trained, kind):
    spec = "bytes" if kind == "bytes" else trained[kind]
    tokenizer = load_tokenizer(spec)
    for document in DOCUMENTS:
        ids = tokenizer.encode(document)
        assert tokenizer.decode(ids) == document
        assert all(0 <= i < tokenizer.vocab_size for i in ids)
    corpus = "".join(DOCUMENTS)
    ids = tokenizer.encode(corpus)
    assert tokenizer.decode(ids) == corpus
    if kind != "bytes":  # a trained vocabulary: fewer tokens than bytes
        assert len(ids) < 0.8 * len(corpus.encode())
    assert tokenizer.eos_id is not None and 0 <= tokenizer.eos_id < tokenizer.vocab_size
    assert tokenizer.eos_id not in ids  # the separator is no text's token
    assert tokenizer.fingerprint.startswith(kind.split("_")[0])
    assert all(os.path.isfile(f) for f in tokenizer.files)


def test_special_tokens_ids_and_fingerprints(trained, tmp_path):
    hf = load_tokenizer(trained["hf"])
    assert hf.decode([hf.eos_id]) == "<|endoftext|>" and hf.bos_id is None
    sp = load_tokenizer(trained["sentencepiece"])
    assert (sp.bos_id, sp.eos_id, sp.vocab_size) == (1, 2, 400)  # sentencepiece's defaults
    llama3, gpt2 = load_tokenizer(trained["tiktoken"]), load_tokenizer(trained["tiktoken_gpt2"])
    ranks = 399  # the BPE's tokens without its special one
    assert (llama3.bos_id, llama3.eos_id, llama3.vocab_size) == (ranks, ranks + 1, ranks + 256)
    assert (gpt2.bos_id, gpt2.eos_id, gpt2.vocab_size) == (None, ranks, ranks + 1)
    # GPT-2's split pattern is the byte-level BPE's: the same ids, shifted past its special.
    shift = lambda i: i + 1 if i < ranks else i  # noqa: E731
    assert [shift(i) for i in gpt2.encode(DOCUMENTS[3])] == hf.encode(DOCUMENTS[3])
    fingerprints = {load_tokenizer(s).fingerprint for s in ["bytes", *trained.values()]}
    assert len(fingerprints) == 5  # the preset is part of a tiktoken file's fingerprint
    # The fingerprint follows the content, not the path.
    copy = tmp_path / "copy.model"
    copy.write_bytes(pathlib.Path(trained["sentencepiece"]).read_bytes())
    assert load_tokenizer(str(copy)).fingerprint == sp.fingerprint
    # tokenizer_config.json beside a tokenizer.json names its eos (as HF's hub files do).
    config = pathlib.Path(trained["hf"]).parent / "tokenizer_config.json"
    config.write_text(json.dumps({"eos_token": {"content": "Ġthe"}}))
    try:
        named = load_tokenizer(trained["hf"])
        assert named.eos_id == hf._tokenizer.token_to_id("Ġthe") and str(config) in named.files
    finally:
        config.unlink()
    assert TIKTOKEN_PRESETS.keys() == {"llama3", "cl100k", "o200k", "gpt2"}


def test_a_missing_or_unreadable_tokenizer_is_one_line(trained, tmp_path):
    garbage = tmp_path / "garbage.model"
    garbage.write_bytes(bytes(range(256)) * 4)
    notes = tmp_path / "notes.txt"
    notes.write_text("not a tokenizer\n")
    cases = {
        str(tmp_path / "missing.json"): "cannot be read",
        str(garbage): "not a sentencepiece model",
        str(notes): "of no known kind",
        trained["sentencepiece"] + ":gpt2": "a preset applies to tiktoken files only",
        str(tmp_path): "cannot be read",
    }
    for spec, expected in cases.items():
        with pytest.raises(ConfigError, match=expected) as caught:
            load_tokenizer(spec)
        assert "\n" not in str(caught.value)


def _corpus(root: pathlib.Path) -> list[str]:
    """Text files, a JSONL file and a parquet file holding ``DOCUMENTS``; returns them."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    (root / "notes").mkdir(parents=True)
    for i, document in enumerate(DOCUMENTS[:5]):
        (root / "notes" / f"{i}.txt").write_text(document)
    with open(root / "lines.jsonl", "w") as f:
        for document in DOCUMENTS[5:65]:
            f.write(json.dumps({"body": document, "id": 1}) + "\n")
    pq.write_table(pa.table({"body": DOCUMENTS[65:], "n": range(60)}), root / "rows.parquet")
    return DOCUMENTS


def _windows(source) -> list[tuple[int, ...]]:
    return sorted(tuple(source[i]["tokens"].tolist()) for i in range(len(source)))


def _expected_windows(named_documents, tokenizer, test: bool, block: int) -> list[tuple]:
    """The windows of the split's documents, each encoded then followed by eos, as documented."""
    stream = [
        token
        for name, document in named_documents
        if text.is_test_document(name) == test
        for token in tokenizer.encode(document) + [tokenizer.eos_id]
    ]
    count = (len(stream) - 1) // block
    return sorted(tuple(stream[i * block : (i + 1) * block + 1]) for i in range(count))


@pytest.mark.parametrize("kind", ["hf", "sentencepiece", "tiktoken"])
def test_a_corpus_of_text_jsonl_and_parquet_prepares_into_windows_that_decode_back(
    trained, tmp_path, kind
):
    documents = _corpus(tmp_path / "corpus")
    spec = trained[kind]
    tokenizer = load_tokenizer(spec)
    data_dir = str(tmp_path / "tfds")
    name = f"text_files/block_size=16,files={tmp_path}/corpus/**/*,field=body,tokenizer={spec}"
    sources = {s: data.load_data_source(name, s, data_dir=data_dir) for s in ("train", "test")}
    # Documents by name, in the files' order: lines.jsonl's lines, notes/*.txt, rows.parquet's.
    named = [
        *((f"lines.jsonl:{i + 1}", d) for i, d in enumerate(documents[5:65])),
        *((f"notes/{i}.txt", d) for i, d in enumerate(documents[:5])),
        *((f"rows.parquet:{i}", d) for i, d in enumerate(documents[65:])),
    ]
    for split, source in sources.items():
        windows = _windows(source)
        assert windows == _expected_windows(named, tokenizer, split == "test", 16)
        assert len(windows) > (2 if split == "test" else 50)  # the JSONL's and parquet's too
    # What the windows hold decodes back to the documents.
    assert tokenizer.decode(tokenizer.encode("".join(documents))) == "".join(documents)
    # The tokenizer is recorded beside the data, and names the prepared copy.
    builder = tfds.builder(name, data_dir=data_dir)
    assert builder.builder_config.name.endswith(tokenizer.fingerprint)
    metadata = json.loads((pathlib.Path(builder.data_dir) / "metadata.json").read_text())
    assert metadata["tokenizer"] == tokenizer.fingerprint == text.recorded_tokenizer(name)
    bytes_name = name.rsplit(",tokenizer=", 1)[0]
    assert tfds.builder(bytes_name, data_dir=data_dir).builder_config.name != (
        builder.builder_config.name
    )


@pytest.mark.slow  # each fresh process imports tfds and JAX: 5-15 s on a loaded 2-core CPU
def test_several_processes_tokenize_as_one_does(trained, tmp_path):
    """Groups of files go to worker processes (spawned fresh) and come back in order."""
    _corpus(tmp_path / "corpus")
    documents = text.file_documents(f"{tmp_path}/corpus/**/*")
    corpus._TASK_BYTES, before = 1, corpus._TASK_BYTES  # a group per file
    try:
        alone = text.tokenize_files(documents, trained["hf"], field="body", workers=0)
        pooled = text.tokenize_files(documents, trained["hf"], field="body", workers=2)
    finally:
        corpus._TASK_BYTES = before
    assert pooled.names == alone.names and len(alone.names) == len(DOCUMENTS)
    for i in range(len(alone.names)):
        np.testing.assert_array_equal(pooled.read(i), alone.read(i))


def test_python_stdlib_and_text_tfds_take_a_tokenizer(trained, tmp_path):
    from tests.test_lm import TinyTextCorpus

    spec = trained["sentencepiece"]
    tokenizer = load_tokenizer(spec)
    stdlib = tfds.builder(f"python_stdlib/modules_128/tokenizer={spec}", data_dir=str(tmp_path))
    assert stdlib.builder_config.name == f"modules_128_{tokenizer.fingerprint}"
    assert stdlib.builder_config.block_size == 128
    assert text.recorded_tokenizer(f"python_stdlib/modules_128/tokenizer={spec}") == (
        tokenizer.fingerprint
    )
    data_dir = str(tmp_path / "tfds")
    tfds.builder("tiny_text_corpus", data_dir=data_dir).download_and_prepare(
        file_format="array_record"
    )
    name = f"text_tfds/source=tiny_text_corpus,block_size=4,test_split=validation,tokenizer={spec}"
    train = data.load_data_source(name, "train", data_dir=data_dir)
    named = [("train", t) for t in TinyTextCorpus.TEXTS["train"]]  # each a document, in order
    assert _windows(train) == _expected_windows(named, tokenizer, False, 4)
    assert len(train) > 3


def test_vocab_size_below_the_tokenizers_is_one_line(trained):
    import replicator as rp
    from experiments.lm import make_experiment
    from replicator.trainer.experiment import Settings

    with pytest.raises(ConfigError, match="vocab_size=256 is smaller than") as caught:
        check_tokenizer(trained["hf"], None, vocab_size=256)
    assert "\n" not in str(caught.value) and "at least 400 (e.g. 512" in str(caught.value)
    assert check_tokenizer(trained["hf"], None, vocab_size=400).vocab_size == 400
    # The LM checks its config's tokenizer when it is made, before any data or workdir.
    model = dict(vocab_size=256, num_layers=1, num_heads=2, embed_dim=32, mlp_dim=64, max_len=16)
    settings = Settings(
        repl=rp.Replicator(), model=model, learning_rate=1e-3, optimizer="adam",
        num_train_steps=1, grad_accum_steps=1, seed=0, options={"tokenizer": trained["tiktoken"]},
        dataset=f"text_files/block_size=16,files=/nowhere/*.txt,tokenizer={trained['tiktoken']}",
    )  # fmt: skip
    with pytest.raises(ConfigError, match="vocab_size=256 is smaller than.*655 ids"):
        make_experiment(settings)
    make_experiment(dataclasses.replace(settings, model={**model, "vocab_size": 768}))


def test_data_of_another_tokenizer_is_one_line_through_the_cli(trained, tmp_path):
    workdir = tmp_path / "run"
    args = ["train", "--config", "configs/lm_tiny.py:smoke", "--workdir", str(workdir)]
    # The dataset (python_stdlib, bytes by default) was not tokenized by config.tokenizer.
    done = run_cli(*args, f"--config.tokenizer={trained['hf']}", "--config.model.vocab_size=512")
    assert_one_line_error(done, "holds the tokens of tokenizer bytes", "is hf-")
    assert not workdir.exists()
