"""Chat and preference data (`experiments.datasets.chat`), checked against the libraries
that define them: ids and assistant masks equal transformers' ``apply_chat_template(...,
return_assistant_tokens_mask=True)``; built rows equal TRL's own preparation
(`tests.helpers.chat`), each whole in its windows exactly once, laid out as the LM reads
them; every mistake is one DatasetError line through ``load_data_source`` and leaves
data_dir untouched."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import tensorflow_datasets as tfds

import experiments.datasets.chat as chat
from experiments.datasets.chat_template import ChatTemplate, encode_chat, load_encoder
from experiments.datasets.corpus import file_documents
from experiments.datasets.text import recorded_tokenizer
from experiments.datasets.tokenizers import find_chat_template, load_tokenizer
from replicator.errors import DatasetError
from replicator.trainer.data import load_data_source
from tests.helpers.chat import hf_tokenizer, trl_dpo, trl_sft, write_jsonl
from tests.helpers.tiny_hf import CHAT_TEMPLATE, write_tokenizer

PAD_ID = 5  # tiny_hf's <|pad|>


def _user(text: str) -> dict:
    return {"role": "user", "content": text}


def _assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


CONVERSATIONS = [
    [{"role": "system", "content": "Be brief."}, _user("What is 2+2?"), _assistant("4.")],
    [_user("Hi"), _assistant("Hello!"), _user("Capital of France?"), _assistant("Paris.")],
    [_user("Ünïcödé ✓ — naïve café"), _assistant("Très bien 😀 日本語")],
    [_user(""), _assistant(""), _user("again"), _assistant("  padded  ")],
]
# ChatML, whose end-of-turn text (its newline too) the generation marks cover.
CHATML = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' %}{% generation %}"
    "{{- message['content'] + '<|im_end|>\\n' }}{% endgeneration %}"
    "{%- else %}{{- message['content'] + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def _unmarked(template: str) -> str:
    return template.replace("{% generation %}", "").replace("{% endgeneration %}", "")


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> str:
    directory = str(tmp_path_factory.mktemp("tokenizer"))
    write_tokenizer(directory)
    return directory


@pytest.fixture(scope="module")
def hf(tokenizer_dir):
    return hf_tokenizer(tokenizer_dir)


@pytest.mark.parametrize("template", [CHAT_TEMPLATE, CHATML], ids=["llama3", "chatml"])
def test_ids_and_assistant_mask_equal_transformers_with_and_without_generation_marks(
    tokenizer_dir, hf, template
):
    encoder = load_encoder(tokenizer_dir)
    marked = ChatTemplate(template, encoder.template.variables)
    unmarked = ChatTemplate(_unmarked(template), encoder.template.variables)
    assert marked.has_generation_marks and not unmarked.has_generation_marks
    for conversation in CONVERSATIONS:
        theirs = hf.apply_chat_template(
            conversation, chat_template=template, tokenize=True, return_dict=True,
            return_assistant_tokens_mask=True,
        )  # fmt: skip
        for ours in (marked, unmarked):  # marks, then the prefix-rendering path
            ids, mask = encode_chat(ours, encoder.tokenizer, conversation)
            assert ids.tolist() == list(theirs["input_ids"])
            assert mask.tolist() == list(theirs["assistant_masks"]) and mask.any()
        prompt = encode_chat(
            marked, encoder.tokenizer, conversation[:-1], add_generation_prompt=True
        )
        expected = hf.apply_chat_template(
            conversation[:-1], chat_template=template, add_generation_prompt=True, tokenize=True,
            return_dict=True,
        )  # fmt: skip
        assert (
            prompt.ids.tolist() == list(expected["input_ids"]) and not prompt.assistant_mask.any()
        )


def test_the_template_is_found_where_transformers_saves_it_and_template_path_wins(tmp_path, hf):
    directory = str(tmp_path / "tok")
    write_tokenizer(directory)
    write_tokenizer(str(tmp_path / "tok2"))  # the same, with tokenizer_config.json's template
    conversation = CONVERSATIONS[1]

    def ids(encoder) -> list[int]:
        return encode_chat(encoder.template, encoder.tokenizer, conversation).ids.tolist()

    def transformers_ids(**kwargs) -> list[int]:
        tokenizer = hf_tokenizer(directory)
        return list(
            tokenizer.apply_chat_template(conversation, tokenize=True, **kwargs)["input_ids"]
        )

    assert ids(load_encoder(directory)) == transformers_ids()  # tokenizer_config.json's
    with open(os.path.join(directory, "chat_template.jinja"), "w") as f:
        f.write(
            CHATML
        )  # beside the tokenizer: wins over tokenizer_config.json's, as in transformers
    assert find_chat_template(directory)[1].endswith("chat_template.jinja")
    chatml = ids(load_encoder(directory))
    assert chatml == transformers_ids() != ids(load_encoder(str(tmp_path / "tok2")))
    named = tmp_path / "mine.jinja"
    named.write_text("{{- 'Custom: ' }}" + _unmarked(CHATML))
    encoder = load_encoder(os.path.join(directory, "tokenizer.json"), str(named))
    assert encoder.template.origin == str(named)
    assert ids(encoder) == transformers_ids(chat_template=named.read_text())
    os.remove(os.path.join(directory, "chat_template.jinja"))
    config_path = os.path.join(directory, "tokenizer_config.json")
    config = json.load(open(config_path))
    config["chat_template"] = [
        {"name": "tool_use", "template": "x"},
        {"name": "default", "template": CHATML},
    ]
    json.dump(config, open(config_path, "w"))
    assert ids(load_encoder(directory)) == transformers_ids()


def _runs(window: dict) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """A window's sequences, ``(segment, tokens, loss_mask)``, checking the layout: segments
    1, 2, ... in order from the first token, then padding (pad id, segment 0, mask 0)."""
    segments = window["segments"]
    real = int((segments > 0).sum())
    assert (segments[real:] == 0).all() and (window["tokens"][real:] == PAD_ID).all()
    assert not window["loss_mask"][real:].any()
    starts = np.flatnonzero(np.diff(segments[:real], prepend=0))
    assert segments[starts].tolist() == list(range(1, len(starts) + 1))
    ends = [*starts[1:], real]
    return [
        (int(segments[s]), window["tokens"][s:e], window["loss_mask"][s:e])
        for s, e in zip(starts, ends)
    ]


def _windows(name: str, data_dir: str) -> list[dict]:
    """Every window of both splits (test last)."""
    splits = ("train", "test")
    return [w for split in splits for w in load_data_source(name, split, data_dir=data_dir)]


def _spec(kind: str, files: str, tokenizer: str, **options) -> str:
    return ",".join(
        [f"{kind}/files={files}", f"tokenizer={tokenizer}"]
        + [f"{k}={v}" for k, v in options.items()]
    )


def _row_of(expected: list, *sequences: np.ndarray) -> int:
    """The one row of ``expected`` whose sequences begin with ``sequences``."""
    rows = [
        i for i, row in enumerate(expected)
        if all(ids[: len(s)].tolist() == s.tolist() for (ids, _), s in zip(row, sequences))
    ]  # fmt: skip
    assert len(rows) == 1
    return rows[0]


CHAT_ROWS = [
    *({"messages": conversation} for conversation in CONVERSATIONS),
    {"prompt": "The sky is", "completion": " blue."},
    {"prompt": "def add(x, y):", "completion": "\n    return x + y\n"},
    {"prompt": [_user("Name a fox.")], "completion": [_assistant("The quick brown fox.")]},
    {
        "prompt": [_user("Count"), _assistant("1, 2"), _user("more")],
        "completion": [_assistant("3")],
    },
]
LONG = {"messages": [_user("Tell me everything."), _assistant("Numbers: 1, 2, 3, 4, 5. " * 12)]}


@pytest.mark.parametrize("pack", [True, False])
def test_built_conversations_are_trls_each_whole_once_in_laid_out_windows(
    tmp_path, tokenizer_dir, hf, pack
):
    write_jsonl(str(tmp_path / "data/a.jsonl"), CHAT_ROWS)
    write_jsonl(str(tmp_path / "data/more/b.jsonl"), [LONG])
    block_size, data_dir = 80, str(tmp_path / "tfds")
    name = _spec("chat", f"{tmp_path}/data/**/*.jsonl", tokenizer_dir, block_size=80, pack=pack)
    expected = [(sequence,) for sequence in trl_sft([*CHAT_ROWS, LONG], hf)]
    assert len(expected[-1][0][0]) > block_size + 1  # LONG is truncated: it keeps its start
    windows, seen = _windows(name, data_dir), []
    for window in windows:
        assert all(len(w) == block_size + 1 for w in window.values())
        runs = _runs(window)
        assert pack or len(runs) == 1
        for _, tokens, mask in runs:
            seen.append(_row_of(expected, tokens))
            ((ids, expected_mask),) = expected[seen[-1]]
            assert len(tokens) == min(len(ids), block_size + 1)
            assert mask.tolist() == expected_mask[: len(tokens)].tolist()
    assert sorted(seen) == list(range(len(expected)))  # each once, LONG's start included
    metadata = tfds.builder(name, data_dir=data_dir).info.metadata
    fingerprint = load_tokenizer(tokenizer_dir).fingerprint
    assert metadata["tokenizer"] == recorded_tokenizer(name) == fingerprint
    train, test = metadata["splits"]["train"], metadata["splits"]["test"]
    assert train["rows"] + test["rows"] == len(expected) and test["rows"] >= 1
    assert (train["truncated"] + test["truncated"], train["dropped"] + test["dropped"]) == (1, 0)
    assert train["windows"] + test["windows"] == len(windows) and (not pack or len(windows) < 8)
    trained = sum(int(w["loss_mask"].sum()) for w in windows)
    assert train["trained"] + test["trained"] == trained
    assert train["tokens"] + test["tokens"] == sum(int((w["segments"] > 0).sum()) for w in windows)
    line = chat.describe(metadata)
    assert line.startswith(f"chat data: {train['rows']:,} conversation")
    assert f"{train['tokens']:,} tokens, {train['trained']:,} trained (assistant)" in line


PREFERENCE_ROWS = [
    {"prompt": "The sky is", "chosen": " blue.", "rejected": " green."},
    {"chosen": "The sun is in the sky.", "rejected": "The sun is in the sea."},  # implicit prompt
    {"prompt": [_user("Capital of France?")], "chosen": [_assistant("Paris.")],
     "rejected": [_assistant("Rome.")]},
    {"chosen": [_user("2+2?"), _assistant("4")],
     "rejected": [_user("2+2?"), _assistant("5, surely")]},  # implicit prompt
    {"prompt": [_user("Count.")], "chosen": [_assistant("1, 2, 3, 4, 5, 6, 7, 8, 9, 10. " * 4)],
     "rejected": [_assistant("no")]},  # cut to fit
    {"prompt": "A user asks a question. " * 12, "chosen": " yes", "rejected": " no"},  # dropped
]  # fmt: skip


def test_built_pairs_are_trls_chosen_then_rejected_in_2p_plus_1_and_2p_plus_2(
    tmp_path, tokenizer_dir, hf
):
    write_jsonl(str(tmp_path / "prefs.jsonl"), PREFERENCE_ROWS)
    block_size, data_dir = 95, str(tmp_path / "tfds")
    name = _spec("preferences", f"{tmp_path}/prefs.jsonl", tokenizer_dir, block_size=block_size)
    expected, seen = trl_dpo(PREFERENCE_ROWS, hf), []
    for window in _windows(name, data_dir):
        runs = _runs(window)
        assert len(runs) % 2 == 0
        for (segment, chosen, chosen_mask), (_, rejected, rejected_mask) in zip(
            runs[::2], runs[1::2]
        ):
            assert segment % 2 == 1  # pair p: 2p + 1 chosen, 2p + 2 rejected
            seen.append(_row_of(expected, chosen, rejected))
            (c, c_mask), (r, r_mask) = expected[seen[-1]]
            assert chosen_mask.tolist() == c_mask[: len(chosen)].tolist()
            assert rejected_mask.tolist() == r_mask[: len(rejected)].tolist()
            if (len(chosen), len(rejected)) != (len(c), len(r)):  # cut: the prompt kept in both
                prompt = int(np.argmax(c_mask))
                assert seen[-1] == 4 and len(chosen) + len(rejected) <= block_size + 1
                assert min(len(chosen), len(rejected)) > prompt
    assert sorted(seen) == [0, 1, 2, 3, 4]  # row 5's prompt twice does not fit: dropped
    stats = tfds.builder(name, data_dir=data_dir).info.metadata["splits"].values()
    assert [sum(s[k] for s in stats) for k in ("rows", "truncated", "dropped")] == [6, 1, 1]


def test_rows_read_in_pieces_keep_their_line_numbers(tmp_path, tokenizer_dir, monkeypatch):
    rows = [{"prompt": f"Question {i}?", "completion": f" Answer {i}."} for i in range(12)]
    lines = [json.dumps(row) for row in rows]
    lines[3:3] = ["", "   "]  # blank lines count, and hold no row
    (tmp_path / "a.jsonl").write_text("\n".join(lines) + "\n")
    name = _spec("chat", f"{tmp_path}/a.jsonl", tokenizer_dir, block_size=32)
    whole = _windows(name, str(tmp_path / "whole"))
    monkeypatch.setattr(chat, "_TASK_BYTES", 50)  # a piece of about a line each
    assert len(chat._chunks(file_documents(f"{tmp_path}/a.jsonl"))) > 10
    pieces = _windows(name, str(tmp_path / "pieces"))
    assert [{k: v.tolist() for k, v in w.items()} for w in whole] == [
        {k: v.tolist() for k, v in w.items()} for w in pieces
    ]
    lines[9] = '{"prompt": "no completion"}'
    (tmp_path / "a.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(DatasetError, match=r"a\.jsonl:10: a chat row needs"):
        _windows(name, str(tmp_path / "bad"))


@pytest.mark.slow  # two fresh (spawned) processes import tfds; the pieces test is its sibling
def test_several_processes_tokenize_what_one_does(tmp_path, tokenizer_dir, monkeypatch):
    write_jsonl(str(tmp_path / "a.jsonl"), [*CHAT_ROWS, LONG] * 3)
    name = _spec("chat", f"{tmp_path}/a.jsonl", tokenizer_dir, block_size=64)
    monkeypatch.setattr(chat, "_TASK_BYTES", 400)
    one = _windows(name + ",workers=0", str(tmp_path / "one"))
    two = _windows(name + ",workers=2", str(tmp_path / "two"))
    assert [w["tokens"].tolist() for w in one] == [w["tokens"].tolist() for w in two]
    assert [w["loss_mask"].tolist() for w in one] == [w["loss_mask"].tolist() for w in two]


def test_the_prepared_copy_is_named_by_everything_it_is_made_of(tmp_path, tokenizer_dir):
    data = write_jsonl(str(tmp_path / "a.jsonl"), CHAT_ROWS[:2])
    other_tokenizer = str(tmp_path / "other")
    write_tokenizer(other_tokenizer, texts=["something else entirely"] * 3)
    (tmp_path / "t.jinja").write_text(CHATML)

    def config_name(tokenizer: str = tokenizer_dir, **options) -> str:
        spec = _spec("chat", data, tokenizer, **options)
        return tfds.builder(spec, data_dir=str(tmp_path / "tfds")).builder_config.name

    base = config_name()
    assert config_name() == base == config_name(f"{tokenizer_dir}/tokenizer.json")
    changed = {
        config_name(block_size=512), config_name(pack=False), config_name(other_tokenizer),
        config_name(template=tmp_path / "t.jinja"),
    }  # fmt: skip
    write_jsonl(data, CHAT_ROWS[1:3])
    changed.add(config_name())
    assert len(changed) == 5 and base not in changed
    assert not (tmp_path / "tfds").exists()


RAISES = "{{ raise_exception('no system role') }}"
BAD_INPUTS = [
    ("chat", [{"messages": [_user("hi"), _user("anyone?")]}], {},
     ("a.jsonl:1: the conversation has no assistant turn",)),
    ("chat", [{"messages": [_user("hi"), {"role": "assistant"}]}], {},
     ("a.jsonl:1: each message of 'messages' needs a 'role' and a 'content'",)),
    ("chat", [{"messages": CONVERSATIONS[0]}, "not an object"], {},
     ("a.jsonl:2: each line must be a JSON object",)),
    ("chat", [{"text": "plain"}], {},
     ("a.jsonl:1: a chat row needs 'messages', or 'prompt' and 'completion'",)),
    ("chat", [{"messages": CONVERSATIONS[0]}], {"template": RAISES},
     ("a.jsonl:1: ", "does not render this conversation: no system role")),
    ("chat", [{"messages": CONVERSATIONS[0]}], {"template": "{% for %}"},
     ("is not a valid jinja template",)),
    ("chat", [{"messages": CONVERSATIONS[0]}], {"no_template": True},
     ("a.jsonl:1: tokenizer", "has no chat template", "template=PATH")),
    ("chat", [], {"files": "nothing/*.jsonl"}, ("no file matches",)),
    ("chat", [{"messages": CONVERSATIONS[0]}], {"tokenizer": "bytes"},
     ("need a Hugging Face tokenizer.json",)),
    ("preferences", [{"prompt": "a", "chosen": "b"}], {},
     ("a.jsonl:1: a preference row needs 'chosen' and 'rejected'",)),
    ("preferences", [{"prompt": "a", "chosen": "b", "rejected": [_assistant("c")]}], {},
     ("a.jsonl:1: 'prompt', 'chosen' and 'rejected' must be all strings",)),
]  # fmt: skip


@pytest.mark.parametrize(
    "kind, rows, options, expected", BAD_INPUTS, ids=[e[3][-1] for e in BAD_INPUTS]
)
def test_each_mistake_is_one_dataset_error_line_and_nothing_is_written(
    tmp_path, tokenizer_dir, kind, rows, options, expected
):
    lines = "".join(json.dumps(row) + "\n" for row in rows)
    (tmp_path / "a.jsonl").write_text(lines)
    tokenizer = options.get("tokenizer", tokenizer_dir)
    if options.get("no_template"):
        tokenizer = str(tmp_path / "plain")
        write_tokenizer(tokenizer, chat_template=None)
    spec = f"{kind}/files={tmp_path}/{options.get('files', 'a.jsonl')},tokenizer={tokenizer}"
    if "template" in options:
        (tmp_path / "t.jinja").write_text(options["template"])
        spec += f",template={tmp_path}/t.jinja"
    data_dir = tmp_path / "tfds"
    with pytest.raises(DatasetError) as error:
        load_data_source(spec, "train", data_dir=str(data_dir))
    message = str(error.value)
    assert "\n" not in message and all(part in message for part in expected), message
    assert not message.startswith("Failed to construct")
    assert not data_dir.exists() or not any(files for _, _, files in os.walk(data_dir))
