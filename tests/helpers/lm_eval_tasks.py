"""Local lm-eval-harness tasks: YAMLs over JSONL files written here, nothing downloaded.

`write_tasks(directory)` writes three tasks, one per kind of request lm_eval makes:

* ``tiny_choice`` (multiple_choice: ``acc``, ``acc_norm``): questions with three or four
  answers of different lengths, so that the length-normalised accuracy can differ;
* ``tiny_answer`` (generate_until: ``exact_match``): short questions, generation stopped
  at a newline or after a few tokens;
* ``tiny_documents`` (loglikelihood_rolling: ``word_perplexity``, ``byte_perplexity``,
  ``bits_per_byte``): held-out documents, one longer than a small model's context, so
  that lm_eval's rolling windows are more than one.

`CHOICE_PROMPT` and the answer task's questions are the prompts the tasks make.
The YAMLs name their JSONL files by absolute path (``dataset_path: json``), so they
load from any working directory, offline.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

CHOICE = "tiny_choice"
ANSWER = "tiny_answer"
DOCUMENTS = "tiny_documents"
TASKS = (CHOICE, ANSWER, DOCUMENTS)
CHOICE_PROMPT = "Question: {question}\nAnswer:"  # what tiny_choice's doc_to_text makes
ANSWER_STOPS = ("\n", ".")  # tiny_answer's until

_CHOICE_ROWS = [  # choices follow the prompt as they are (target_delimiter: "")
    ("What is the capital of France?", [" Paris", " Berlin", " a large city in Spain"], 0),
    ("Which number comes after 4?", [" 3", " 5", " 6", " ten"], 1),
    ("What does the fox jump over?", [" the moon", " a fence", " the lazy dog"], 2),
    ("Which keyword defines a function in Python?", [" def", " class", " import"], 0),
    ("What does print show?", [" nothing at all", " its arguments", " an error"], 1),
    ("How many legs has a dog?", [" two", " four", " six"], 1),
]
_ANSWER_ROWS = [
    ("2 + 2 =", "4"),
    ("The capital of France is", "Paris"),
    ("def add(x, y): return", "x + y"),
    ("The quick brown fox", "jumps"),
    ("Numbers: 1, 2,", "3"),
]
_DOCUMENTS = [
    "The quick brown fox jumps over the lazy dog.",
    "def add(x, y):\n    return x + y\n\nprint(add(1, 2))\n",
    " ".join(["What is the capital of France? Paris is the capital of France."] * 6),
]

_CHOICE_YAML = """\
task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
target_delimiter: ""
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
  - metric: acc_norm
"""
_ANSWER_YAML = """\
task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n", "."]
  max_gen_toks: {max_gen_toks}
  do_sample: false
metric_list:
  - metric: exact_match
"""
_DOCUMENTS_YAML = """\
task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
"""


def write_tasks(
    directory: str, *, max_gen_toks: int = 6, more_choices: Sequence[tuple] = (),
    more_answers: Sequence[tuple[str, str]] = (),
) -> str:  # fmt: skip
    """The three tasks' YAMLs and JSONL files in ``directory`` (lm_eval's
    ``include_path``); returns ``directory``.

    ``more_choices`` (``(question, choices, answer index)``) and ``more_answers``
    (``(question, answer)``) are rows added to the first two tasks: a test's rows whose
    answer is the model's own greedy continuation, so that ``is_greedy`` and
    ``exact_match`` are sometimes true."""
    os.makedirs(directory, exist_ok=True)
    rows = {
        CHOICE: [{"question": q, "choices": list(c), "answer": a}
                 for q, c, a in [*_CHOICE_ROWS, *more_choices]],
        ANSWER: [{"question": q, "answer": a} for q, a in [*_ANSWER_ROWS, *more_answers]],
        DOCUMENTS: [{"text": text} for text in _DOCUMENTS],
    }  # fmt: skip
    templates = {CHOICE: _CHOICE_YAML, ANSWER: _ANSWER_YAML, DOCUMENTS: _DOCUMENTS_YAML}
    for name, template in templates.items():
        data = os.path.join(directory, f"{name}.jsonl")
        with open(data, "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows[name])
        text = template.format(name=name, data=json.dumps(data), max_gen_toks=max_gen_toks)
        with open(os.path.join(directory, f"{name}.yaml"), "w") as f:
            f.write(text)
    return directory
