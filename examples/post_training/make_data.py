"""Writes the small conversation and preference files docs/pretrained.md trains on.

``conversations.jsonl``: 600 chats with an arithmetic tutor (HF's chat layout: a
``messages`` list of ``{"role", "content"}``), one in five of two turns.
``preferences.jsonl``: 600 pairs on the same kind of prompt (``prompt``, ``chosen``,
``rejected`` as message lists): the chosen answer right and polite, the rejected one
wrong and curt, so that a preference loss can learn to tell them apart.
``tasks/``: two lm-eval-harness tasks over local JSONL (``eval --tasks
arith_choice,arith_answer --include_path examples/post_training/tasks``, run from the
repository's root): ``arith_choice`` (multiple choice: the right sum or a near miss,
``acc``) and ``arith_answer`` (generate_until: the sum's digits, ``exact_match``).
Deterministic:

    python examples/post_training/make_data.py examples/post_training
"""

from __future__ import annotations

import json
import os
import random
import sys

SYSTEM = "You are a patient arithmetic tutor."


def _question(rng: random.Random) -> tuple[str, int]:
    a, b = rng.randint(1, 99), rng.randint(1, 99)
    if rng.random() < 0.5:
        return f"What is {a} + {b}?", a + b
    return f"What is {max(a, b)} - {min(a, b)}?", max(a, b) - min(a, b)


def conversation(rng: random.Random) -> dict:
    messages = [{"role": "system", "content": SYSTEM}]
    for _ in range(2 if rng.random() < 0.2 else 1):
        question, answer = _question(rng)
        messages += [
            {"role": "user", "content": question},
            {"role": "assistant", "content": f"{question[8:-1]} = {answer}."},
        ]
    return {"messages": messages}


def preference(rng: random.Random) -> dict:
    question, answer = _question(rng)
    wrong = answer + rng.choice([-3, -2, -1, 1, 2, 3])
    return {
        "prompt": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        "chosen": [{"role": "assistant", "content": f"{question[8:-1]} = {answer}. Well done!"}],
        "rejected": [{"role": "assistant", "content": f"{wrong}. Next."}],
    }


CHOICE_YAML = """\
task: arith_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: examples/post_training/tasks/arith_choice.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{question}}\\nAnswer:"
doc_to_choice: "{{choices}}"
doc_to_target: "{{answer}}"
metric_list:
  - metric: acc
"""
ANSWER_YAML = """\
task: arith_answer
dataset_path: json
dataset_kwargs:
  data_files:
    test: examples/post_training/tasks/arith_answer.jsonl
test_split: test
output_type: generate_until
doc_to_text: "{{question}} ="
doc_to_target: "{{answer}}"
generation_kwargs:
  until: ["\\n", "."]
  max_gen_toks: 6
  do_sample: false
filter_list:
  - name: strip
    filter:
      - function: regex
        regex_pattern: "(\\\\d+)"
      - function: take_first
metric_list:
  - metric: exact_match
"""


def choice_row(rng: random.Random) -> dict:
    question, answer = _question(rng)
    wrong = answer + rng.choice([-2, -1, 1, 2])
    choices = [str(answer), str(wrong)] if rng.random() < 0.5 else [str(wrong), str(answer)]
    return {"question": question, "choices": choices, "answer": choices.index(str(answer))}


def answer_row(rng: random.Random) -> dict:
    question, answer = _question(rng)
    return {"question": question[8:-1], "answer": str(answer)}


def main(directory: str, rows: int = 600, task_rows: int = 40) -> None:
    os.makedirs(os.path.join(directory, "tasks"), exist_ok=True)
    files = (
        ("conversations", conversation, rows), ("preferences", preference, rows),
        ("tasks/arith_choice", choice_row, task_rows),
        ("tasks/arith_answer", answer_row, task_rows),
    )  # fmt: skip
    for name, make, count in files:
        rng = random.Random(name)
        with open(os.path.join(directory, f"{name}.jsonl"), "w") as f:
            for _ in range(count):
                f.write(json.dumps(make(rng)) + "\n")
    for name, text in (("arith_choice", CHOICE_YAML), ("arith_answer", ANSWER_YAML)):
        with open(os.path.join(directory, "tasks", f"{name}.yaml"), "w") as f:
            f.write(text)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__)))
