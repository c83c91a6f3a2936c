"""TRL's own dataset preparation, run on rows of chat and preference data: the reference
`experiments.datasets.chat` is checked against.

`trl.SFTTrainer._prepare_dataset` and `trl.DPOTrainer._prepare_dataset` turn rows into
token ids and the tokens the loss covers (SFT's ``labels``, DPO's ``prompt_ids`` /
``chosen_ids`` / ``rejected_ids``). They are methods that read a few attributes of their
trainer; here they run as they are on a stand-in for those, with transformers'
tokenizer (``AutoTokenizer.from_pretrained``), so every id and mask is TRL's.
"""

from __future__ import annotations

import json
import os
import types
from collections.abc import Sequence

import numpy as np


def hf_tokenizer(directory: str):
    """transformers' tokenizer of a checkpoint directory."""
    import transformers

    return transformers.AutoTokenizer.from_pretrained(directory)


def write_jsonl(path: str, rows: Sequence[dict]) -> str:
    """``rows`` as a JSONL file at ``path``; returns ``path``."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return path


def trl_sft(rows: Sequence[dict], tokenizer) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each row's ``(input_ids, loss mask)`` as TRL's SFTTrainer prepares it with
    ``assistant_only_loss=True`` and ``completion_only_loss`` (its default for prompts)."""
    trainer = types.SimpleNamespace(
        _tokenizer=tokenizer, chat_template=None, completion_only_loss=True
    )
    args = types.SimpleNamespace(
        dataset_num_proc=None, dataset_text_field="text", assistant_only_loss=True,
        max_length=None, shuffle_dataset=False, truncation_mode="keep_start", seed=0,
    )  # fmt: skip
    from trl import SFTTrainer

    def prepare(group):
        prepared = SFTTrainer._prepare_dataset(trainer, group, tokenizer, args, False, None, "t")
        return [(row["input_ids"], [label != -100 for label in row["labels"]]) for row in prepared]

    return [(np.array(i, np.int32), np.array(m, np.uint8)) for i, m in _by_kind(rows, prepare)]


def trl_dpo(rows: Sequence[dict], tokenizer) -> list[tuple[tuple[np.ndarray, np.ndarray], ...]]:
    """Each row's chosen and rejected ``(ids, loss mask)`` as TRL's DPOTrainer prepares and
    collates them: ``prompt_ids + chosen_ids``, the mask on ``chosen_ids``."""
    from trl import DPOTrainer

    trainer = types.SimpleNamespace(_tokenizer=tokenizer)
    args = types.SimpleNamespace(
        dataset_num_proc=None, max_length=None, truncation_mode="keep_start"
    )

    def prepare(group):
        prepared = DPOTrainer._prepare_dataset(trainer, group, tokenizer, args, "t")
        return [
            tuple(
                (
                    np.array(row["prompt_ids"] + row[key], np.int32),
                    np.array([0] * len(row["prompt_ids"]) + [1] * len(row[key]), np.uint8),
                )
                for key in ("chosen_ids", "rejected_ids")
            )
            for row in prepared
        ]

    return _by_kind(rows, prepare)


def _by_kind(rows: Sequence[dict], prepare) -> list:
    """``prepare`` on runs of rows with the same keys and kinds (TRL reads a dataset's
    format from its first row), in order."""
    import datasets

    datasets.disable_progress_bars()
    results, run = [], []

    def flush():
        if run:
            results.extend(prepare(datasets.Dataset.from_list(list(run))))
            run.clear()

    for row in rows:
        kind = sorted((k, isinstance(v, str)) for k, v in row.items())
        if run and kind != sorted((k, isinstance(v, str)) for k, v in run[0].items()):
            flush()
        run.append(row)
    flush()
    return results
