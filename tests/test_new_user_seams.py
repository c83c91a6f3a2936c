"""What a new user met on the way from a Hugging Face checkpoint and back (issue 57).

A damaged checkpoint (truncated, random bytes, a shard missing, a shape or vocabulary
that its config.json does not imply, a PyTorch ``.bin`` alone) is one line, exit status
2, before anything is written: no workdir made, no ``log.txt`` in an existing one, and
no line about the model keys it would have changed. ``init_from`` naming such a
directory without ``hf:`` says to add it. ``sample`` with no checkpoint says so, and
its plain line shows the prompt. Every kind of tokenizer is exported as transformers'
``AutoTokenizer`` loads it, with our ids, and ``export --dtype bfloat16`` writes bf16
weights that transformers loads.
"""

import contextlib
import json
import logging
import os
import shutil
import struct

import numpy as np
import pytest

from replicator.errors import ConfigError
from replicator.trainer import pretrained
from replicator.trainer.safetensors_files import (
    SINGLE,
    SafetensorsDir,
    file_names,
    write_file,
    write_index,
)
from tests.helpers.cli import assert_refused, run_cli, snapshot

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# Each damage and the words of its one line.
WORDS = {
    "truncated": "does not fit the file",
    "random_bytes": "is not a safetensors file",
    "missing_shard": "names files that are not there",
    "wrong_shape": "config.json says",
    "wrong_vocab": "model.embed_tokens.weight is",
    "bin_only": "holds no *.safetensors",
}


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> str:
    from tests.helpers.tiny_hf import write_tiny_llama

    return write_tiny_llama(str(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="module")
def damaged(good, tmp_path_factory) -> dict[str, str]:
    """A copy of ``good`` for each damage of `WORDS`."""
    root = tmp_path_factory.mktemp("damaged")
    return {case: _damage(good, str(root / case), case) for case in WORDS}


def _damage(good: str, directory: str, case: str) -> str:
    shutil.copytree(good, directory)
    weights = os.path.join(directory, SINGLE)
    if case == "truncated":
        os.truncate(weights, os.path.getsize(weights) // 2)
    elif case == "random_bytes":
        with open(weights, "wb") as f:
            f.write(np.random.default_rng(0).bytes(4096))
    elif case == "missing_shard":
        _split_in_three(directory)
        os.remove(os.path.join(directory, file_names(3)[1]))
    elif case in ("wrong_shape", "wrong_vocab"):
        path = os.path.join(directory, "config.json")
        with open(path) as f:
            config = json.load(f)
        config["intermediate_size" if case == "wrong_shape" else "vocab_size"] -= 16
        with open(path, "w") as f:
            json.dump(config, f)
    elif case == "bin_only":
        os.remove(weights)
        with open(os.path.join(directory, "pytorch_model.bin"), "wb") as f:
            f.write(bytes(64))
    return directory


def _split_in_three(directory: str) -> None:
    """``model.safetensors`` as three files and the index, as save_pretrained shards."""
    files = SafetensorsDir(directory)
    names = sorted(files.shapes)
    weight_map = {}
    for file, part in zip(file_names(3), np.array_split(np.array(names), 3), strict=True):
        entries = [(n, files.shapes[n], files.dtypes[n]) for n in part]
        write_file(
            os.path.join(directory, file), entries, [np.asarray(files.read(n)) for n in part]
        )
        weight_map.update({n: file for n in part})
    write_index(directory, weight_map, 0)
    os.remove(os.path.join(directory, SINGLE))


def lm_config(init_from: str):
    from tests.helpers.configs import CONFIG_DIR, load_config

    config = load_config(CONFIG_DIR / "lm_tiny.py", "smoke")
    config.init_from = init_from
    return config


@contextlib.contextmanager
def replicator_lines():
    """What replicator's logger says meanwhile (whatever handlers a console left on it)."""
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger("replicator")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


# ---- A damaged checkpoint: one line, nothing said or written before it


def test_a_whole_checkpoint_passes_the_check_and_names_what_it_changed(good):
    with replicator_lines() as lines:
        shaped = pretrained.checkpoint_model(lm_config(f"hf:{good}"), check_files=True)
    assert shaped.model.embed_dim == 32
    assert any("config.model changed" in line for line in lines), lines


@pytest.mark.parametrize("case", WORDS)
def test_a_damaged_checkpoint_is_one_config_error_with_no_line_before(case, damaged):
    with replicator_lines() as lines, pytest.raises(ConfigError) as raised:
        pretrained.checkpoint_model(lm_config(f"hf:{damaged[case]}"), check_files=True)
    message = str(raised.value)
    assert WORDS[case] in message and "\n" not in message, message
    assert message.startswith("config.init_from='hf:"), message
    assert lines == []  # not the line naming the model keys it changed


def test_a_header_entry_of_other_types_is_one_config_error(tmp_path):
    """A float shape passes the byte count (2.0 * 4 == 8) and would fail only when read."""
    header = json.dumps({"w": {"dtype": "F32", "shape": [2.0], "data_offsets": [0, 8]}})
    (tmp_path / SINGLE).write_bytes(struct.pack("<Q", len(header)) + header.encode() + bytes(8))
    with pytest.raises(ConfigError, match="tensor w's header entry is malformed"):
        SafetensorsDir(str(tmp_path))


def _train(init_from: str, workdir: str, *more: str):
    return run_cli("train", "--config", "configs/lm_tiny.py:smoke", "--workdir", workdir,
                   f"--config.init_from={init_from}", *more, devices=1)  # fmt: skip


def _assert_said_nothing_else(done) -> None:
    """No line before the error but (sample's) the one naming the config it read."""
    assert "config.model changed" not in done.stderr, done.stderr
    before = [line for line in done.stderr.splitlines() if line.strip()][:-1]
    assert [line.split(":")[0] for line in before] in ([], ["sample"]), done.stderr


# Each refusal by the CLI takes 10-15 s on a loaded 2-core machine: one damage here, the
# others test-slow (each is refused in-process above, by the same check).
CLI_CASES = [c if c == "truncated" else pytest.param(c, marks=pytest.mark.slow)
             for c in WORDS]  # fmt: skip


@pytest.mark.parametrize("case", CLI_CASES)
def test_train_from_a_damaged_checkpoint_writes_nothing_in_an_existing_workdir(
    case, damaged, tmp_path
):
    workdir = tmp_path / "run"
    workdir.mkdir()
    (workdir / "notes.txt").write_text("mine\n")
    before = snapshot(str(workdir))
    done = _train(f"hf:{damaged[case]}", str(workdir))
    assert_refused(done, "config.init_from='hf:")
    assert WORDS[case] in done.stderr
    _assert_said_nothing_else(done)
    assert snapshot(str(workdir)) == before  # no log.txt either


@pytest.mark.slow  # two refusals by the CLI: 25 s
def test_train_and_sample_from_a_truncated_checkpoint_make_no_workdir(damaged, tmp_path):
    spec = f"hf:{damaged['truncated']}"
    done = _train(spec, str(tmp_path / "new"))
    assert_refused(done, "config.init_from='hf:")
    assert not (tmp_path / "new").exists()
    done = run_cli("sample", "--config", "configs/lm_tiny.py:smoke", "--workdir",
                   str(tmp_path / "other"), f"--config.init_from={spec}", "--prompt", "def ",
                   devices=1)  # fmt: skip
    assert_refused(done, "config.init_from='hf:")
    _assert_said_nothing_else(done)
    assert not (tmp_path / "other").exists()


def test_an_hf_directory_without_the_prefix_is_refused_with_a_hint(good):
    with pytest.raises(ConfigError, match=f"write --config.init_from=hf:{good}"):
        pretrained.checkpoint_model(lm_config(good))
    with pytest.raises(ConfigError, match="hf:"):  # a step after it: the same directory
        pretrained.checkpoint_model(lm_config(f"{good}:5"))


# ---- sample with no checkpoint


@pytest.mark.slow  # a sampler compiled: 15-20 s
def test_sample_without_a_checkpoint_says_so_and_echoes_the_prompt(good, tmp_path):
    workdir = tmp_path / "empty"
    done = run_cli("sample", "--config", "configs/lm_tiny.py:smoke", "--workdir", str(workdir),
                   f"--config.init_from=hf:{good}", "--prompt", "def ", "--max_new_tokens", "3",
                   "--temperature", "0", devices=1)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    said = f"{workdir}/checkpoints holds no checkpoint: sampling the weights of config.init_from"
    assert said in done.stderr, done.stderr
    # One line per sample (after a first build's progress bar of the config's dataset).
    lines = [line for line in done.stdout.split("\n") if line.startswith("[")]
    assert len(lines) == 1, done.stdout
    line = lines[0]
    assert line.startswith("[0.0] 'def ' + '") and line.endswith("(3 tokens, length)"), line
    assert not workdir.exists()


# ---- Exported tokenizers: what AutoTokenizer loads, with our ids

TEXTS = (
    "def f(x):\n    return x * 2  # doubled\n",
    "Ünïcödé text — with  two spaces, tabs\tand emoji 😀.",
    " leading space and trailing newline\n\n",
    "数字 123 4567 and 'quotes' \"double\" [brackets] {braces}",
)


@pytest.fixture(scope="module")
def tokenizer_specs(tmp_path_factory) -> dict[str, str]:
    """A tokenizer of each kind, trained on `TEXTS` as tests/test_tokenizers.py trains them:
    a byte-level BPE tokenizer.json (also under another name, with no tokenizer_config.json
    beside it), sentencepiece BPE and unigram models, a tiktoken file of the BPE's ranks."""
    import base64

    import sentencepiece
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from tests.test_tokenizers import _byte_decoder

    root = tmp_path_factory.mktemp("tokenizers")
    texts = [*TEXTS, *(f"line {i}: lorem ipsum dolor sit amet {i * i}\n" for i in range(60))]
    (root / "corpus.txt").write_text("\n".join(texts))
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=360, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    ))  # fmt: skip
    (root / "hf").mkdir()
    bpe.save(str(root / "hf" / "tokenizer.json"))
    bpe.save(str(root / "my_tokenizer.json"))
    for kind, size in (("bpe", 400), ("unigram", 120)):
        sentencepiece.SentencePieceTrainer.train(
            input=str(root / "corpus.txt"), model_prefix=str(root / f"sp_{kind}"),
            vocab_size=size, model_type=kind, byte_fallback=kind == "bpe", hard_vocab_limit=False,
            minloglevel=2,
        )  # fmt: skip
    vocab = json.loads((root / "hf" / "tokenizer.json").read_text())["model"]["vocab"]
    decoder, ranked = _byte_decoder(), sorted((i, t) for t, i in vocab.items() if i > 0)
    lines = [f"{base64.b64encode(bytes(decoder[c] for c in t)).decode()} {rank}"
             for rank, (_, t) in enumerate(ranked)]  # fmt: skip
    (root / "bpe.tiktoken").write_text("\n".join(lines) + "\n")
    return {
        "bytes": "bytes",
        "hf": str(root / "hf" / "tokenizer.json"),
        "hf_renamed_without_config": str(root / "my_tokenizer.json"),
        "sentencepiece_bpe": str(root / "sp_bpe.model"),
        "sentencepiece_unigram": str(root / "sp_unigram.model"),
        "tiktoken_llama3": str(root / "bpe.tiktoken"),
        "tiktoken_gpt2": str(root / "bpe.tiktoken") + ":gpt2",
    }


KINDS = ("bytes", "hf", "hf_renamed_without_config", "sentencepiece_bpe",
         "sentencepiece_unigram", "tiktoken_llama3", "tiktoken_gpt2")  # fmt: skip


@pytest.mark.parametrize("kind", KINDS)
def test_every_exported_tokenizer_loads_in_transformers_with_our_ids(
    kind, tokenizer_specs, tmp_path
):
    from experiments.datasets.tokenizers import load_tokenizer
    from replicator.trainer import export

    ours = load_tokenizer(tokenizer_specs[kind])
    config = lm_config(None)
    config.tokenizer = tokenizer_specs[kind]
    written = export._tokenizer_writer(config)(str(tmp_path))  # what export calls
    assert "tokenizer_config.json" in written and set(written) == set(os.listdir(tmp_path))
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    for text in TEXTS:
        ids = ours.encode(text)
        assert theirs.encode(text, add_special_tokens=False) == ids, text
        if not kind.startswith("sentencepiece"):  # (sentencepiece normalizes: NFKC, spaces)
            assert theirs.decode(ids) == text
    assert theirs.eos_token_id == (None if kind == "bytes" else ours.eos_id)
    assert theirs.bos_token_id == ours.bos_id
    assert len(theirs) == ours.vocab_size


# ---- export --dtype bfloat16


def test_an_export_in_bfloat16_is_what_transformers_loads_in_bfloat16(good, tmp_path):
    import ml_dtypes

    from replicator.trainer import export, init_from
    from tests.test_hf import import_params

    _, variables, _ = import_params(f"hf:{good}")
    _, hf_config = pretrained.read_hf_config(f"hf:{good}")
    model = pretrained.layout("experiments.lm", {"max_len": 64}, hf_config).model
    hf = pretrained.layout("experiments.lm", model, None)
    leaves = init_from.model_paths({"params": variables["params"]})
    out = str(tmp_path / "bf16")
    export._export_weights(out, hf, leaves, 0, export.MAX_FILE_BYTES, dtype="bfloat16")
    written, original = SafetensorsDir(out), SafetensorsDir(good)
    assert set(written.dtypes.values()) == {np.dtype(ml_dtypes.bfloat16)}
    for name in original.shapes:
        expected = np.asarray(original.read(name)).astype(ml_dtypes.bfloat16)
        np.testing.assert_array_equal(np.asarray(written.read(name)), expected)
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["torch_dtype"] == "bfloat16"
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info
    assert loaded.dtype == torch.bfloat16
