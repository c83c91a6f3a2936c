"""docs/pretrained.md's path by its commands: a Hugging Face Llama with a chat template,
SFT with LoRA on conversations, export (PEFT and merged), DPO with LoRA from the
merged export, sample; each checked against the library that defines it.

Invariants: the trained tokens are the assistant tokens transformers' mask marks
(``apply_chat_template(..., return_assistant_tokens_mask=True)``); the PEFT export,
loaded by ``peft.PeftModel.from_pretrained`` onto its base, generates greedily what
``sample`` does and has the merged export's logits; sigmoid DPO starts at log 2 and its
logged rewards and margins are TRL's of the logged log-probabilities; the reward
accuracy rises on a separable preference set; each bad input is one line, exit
status 2, nothing written.
"""

import json
import math
import os

import numpy as np
import pytest

from tests.helpers import trl_reference
from tests.helpers.cli import ROOT, assert_refused, run_cli, snapshot
from tests.helpers.tiny_hf import write_tiny_llama

DATA = os.path.join(ROOT, "examples", "post_training")
PROMPT = [0, 17, 42, 99, 7]  # ids: bos and four tokens


def read_records(workdir: str) -> list[dict]:
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def train(config: str, workdir: str, model: str, data_dir: str, dataset: str, *more: str):
    """``train --config configs/<config>`` from ``model`` (an ``hf:`` directory) on one of
    the example files, as the docs run it (the paths in the test's folders)."""
    kind, file = dataset.split("/")
    return run_cli(
        "train", "--config", f"configs/{config}", "--workdir", workdir,
        f"--config.init_from=hf:{model}", f"--config.tokenizer={model}/tokenizer.json",
        f"--config.dataset={kind}/files={DATA}/{file},tokenizer={model},block_size=256",
        f"--config.data_dir={data_dir}", *more,
    )  # fmt: skip


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return write_tiny_llama(str(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="module")
def sft(base, tmp_path_factory):
    """SFT with rank-8 LoRA, 4 steps, and both exports of it."""
    root = tmp_path_factory.mktemp("sft")
    workdir, data_dir = str(root / "run"), str(root / "tfds")
    done = train("sft_llama_tiny.py:smoke", workdir, base, data_dir, "chat/conversations.jsonl",
                 "--config.model.lora_rank=8")  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    for format in ("peft", "hf"):
        done = run_cli("export", "--workdir", workdir, "--format", format,
                       "--out", str(root / format))  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
    return workdir, data_dir, str(root / "peft"), str(root / "hf"), base


def _assistant_tokens(base: str) -> int:
    """The assistant tokens of every example conversation, as transformers' mask marks them."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(base)
    total = 0
    with open(os.path.join(DATA, "conversations.jsonl")) as f:
        for line in f:
            out = tokenizer.apply_chat_template(
                json.loads(line)["messages"], tokenize=True, return_dict=True,
                return_assistant_tokens_mask=True,
            )  # fmt: skip
            total += int(np.sum(out["assistant_masks"]))
    return total


def test_sft_trains_the_assistant_tokens_transformers_marks(sft):
    workdir, data_dir, _, _, base = sft
    (metadata_path,) = [
        os.path.join(where, "metadata.json")
        for where, _, names in os.walk(data_dir) if "metadata.json" in names
    ]  # fmt: skip
    with open(metadata_path) as f:
        splits = json.load(f)["splits"]
    assert splits["train"]["trained"] + splits["test"]["trained"] == _assistant_tokens(base)
    assert splits["train"]["dropped"] == splits["test"]["dropped"] == 0
    records = read_records(workdir)
    evals = [r for r in records if r.get("split") == "test"]
    assert evals and all(r["trained_tokens"] == splits["test"]["trained"] for r in evals)
    trains = [r for r in records if "split" not in r]
    assert trains and all(0 < r["trained_tokens"] for r in trains)
    with open(os.path.join(workdir, "log.txt")) as f:  # the start line: the data as prepared
        log = f.read()
    assert f"{splits['train']['trained']:,} trained (assistant)" in log


def test_the_peft_export_generates_what_sample_does_and_has_the_merged_logits(sft):
    import peft
    import torch
    import transformers

    workdir, _, adapters, merged, base = sft
    with open(os.path.join(adapters, "adapter_config.json")) as f:
        assert json.load(f)["base_model_name_or_path"] == os.path.abspath(base)
    prompt = ",".join(map(str, PROMPT))
    done = run_cli("sample", "--workdir", workdir, "--prompt_ids", prompt, "--temperature", "0",
                   "--max_new_tokens", "12", "--stop_ids", "", "--json")  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    ours = json.loads(done.stdout.splitlines()[-1])["ids"]
    model = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(base), adapters
    ).eval()
    plain = transformers.AutoModelForCausalLM.from_pretrained(merged).eval()
    prompt = torch.tensor([PROMPT])
    with torch.no_grad():
        theirs = model.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=5,
                                eos_token_id=None)[0, len(PROMPT):].tolist()  # fmt: skip
        ids = torch.tensor([PROMPT + ours])
        np.testing.assert_allclose(
            model(ids).logits.numpy(), plain(ids).logits.numpy(), rtol=1e-4, atol=1e-4
        )
    assert ours == theirs
    adapted = {n for n, _ in model.named_parameters() if "lora_B" in n}
    assert any(torch.count_nonzero(p) for n, p in model.named_parameters() if n in adapted)


@pytest.fixture(scope="module")
def dpo(sft, tmp_path_factory):
    """DPO with LoRA from the merged SFT export, logged every step."""
    root = tmp_path_factory.mktemp("dpo")
    workdir = str(root / "run")
    done = train("dpo_llama_tiny.py", workdir, sft[3], str(root / "tfds"),
                 "preferences/preferences.jsonl", "--config.num_train_steps=12",
                 "--config.log_every_steps=1", "--config.eval_every_steps=12",
                 "--config.checkpoint_every_steps=12")  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return [r for r in read_records(workdir) if "split" not in r]


def test_dpo_starts_at_log_two_and_logs_trls_rewards(dpo):
    first = dpo[0]
    assert first["step"] == 1
    np.testing.assert_allclose(first["loss"], math.log(2), rtol=1e-6)
    assert first["rewards/accuracies"] == 0.0  # policy = reference: no reward apart
    import torch

    for record in dpo:  # TRL's rewards of the logged (batch-mean) log-probabilities
        policy = torch.tensor([[record["logps/chosen"], 0.0], [record["logps/rejected"], 0.0]])
        mask = torch.tensor([[0, 1, 0], [0, 1, 0]])  # (TRL's shift: one token, the first)
        _, logged = trl_reference.dpo(
            "sigmoid", policy.requires_grad_(), mask, torch.tensor([record["logps/ref_chosen"]]),
            torch.tensor([record["logps/ref_rejected"]]), beta=0.1,
        )  # fmt: skip
        for name in ("rewards/chosen", "rewards/rejected", "rewards/margins"):
            np.testing.assert_allclose(record[name], logged[name], rtol=1e-4, atol=1e-6)


def test_dpos_reward_accuracy_rises_on_separable_pairs(dpo):
    late = [r["rewards/accuracies"] for r in dpo[-4:]]
    assert np.mean(late) > 0.75, [r["rewards/accuracies"] for r in dpo]
    assert np.mean([r["loss"] for r in dpo[-4:]]) < math.log(2) - 0.05


# ---------------------------------------------------------------- bad input: one line, exit 2


def _jsonl(path, rows) -> str:
    with open(path, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    return str(path)


@pytest.mark.slow  # ~8 s; tests/test_chat_data.py checks the line and the empty data_dir
def test_a_conversation_without_an_assistant_turn_is_one_line(base, tmp_path):
    rows = [{"messages": [{"role": "user", "content": "Hi"}]}]
    file = _jsonl(tmp_path / "bad.jsonl", rows)
    workdir = str(tmp_path / "run")
    done = run_cli(
        "train", "--config", "configs/sft_llama_tiny.py:smoke", "--workdir", workdir,
        f"--config.init_from=hf:{base}", f"--config.tokenizer={base}/tokenizer.json",
        f"--config.dataset=chat/files={file},tokenizer={base},block_size=256",
        f"--config.data_dir={tmp_path / 'tfds'}", devices=1,
    )  # fmt: skip
    assert_refused(done, "")
    assert "bad.jsonl:1: the conversation has no assistant turn" in done.stderr
    assert not os.path.exists(workdir)


def test_a_lora_target_regex_that_matches_nothing_is_one_line(base, tmp_path):
    workdir = str(tmp_path / "run")
    done = train("dpo_llama_tiny.py:smoke", workdir, base, str(tmp_path / "tfds"),
                 "preferences/preferences.jsonl",
                 "--config.model.lora_targets=embedding")  # fmt: skip
    assert_refused(done, "")
    assert "config.model.lora_targets='embedding' matches no projection kernel" in done.stderr
    assert not os.path.exists(workdir)


def test_a_peft_export_of_a_run_without_adapters_is_one_line(sft, tmp_path):
    """A full fine-tune's workdir (its config: no adapters) refused before anything is read."""
    import shutil

    workdir = str(tmp_path / "full")
    shutil.copytree(sft[0], workdir)
    path = os.path.join(workdir, "config.json")
    with open(path) as f:
        config = json.load(f)
    config["model"]["lora_rank"] = 0
    with open(path, "w") as f:
        json.dump(config, f)
    before, out = snapshot(workdir), str(tmp_path / "out")
    done = run_cli("export", "--workdir", workdir, "--format", "peft", "--out", out, devices=1)
    assert_refused(done, f"the run in {workdir} has no adapters to export as PEFT's")
    assert snapshot(workdir) == before and not os.path.exists(out)
