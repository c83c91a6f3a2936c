"""A tiny random Llama with its tokenizer and chat template, made offline on a laptop.

docs/pretrained.md starts here: the checkpoint directory the Hub would serve, made with
transformers and tokenizers instead of downloaded. `write_tokenizer` trains a byte-level
BPE tokenizer on a little text and writes it with a ``tokenizer_config.json``: its
special tokens and a Llama 3 style chat template whose assistant turns are marked
``{% generation %}`` (so that transformers' ``apply_chat_template(...,
return_assistant_tokens_mask=True)`` marks them too); `write_tiny_llama` saves a random
``LlamaForCausalLM`` of that vocabulary beside it (2 layers, 32 wide, float32):

    .venv/bin/python examples/post_training/tiny_llama.py runs/tiny-llama

(the tokenizer trained on this folder's conversations and preferences). transformers
and torch come with the test extra: ``.venv/bin/pip install -e '.[test]'``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

SPECIALS = (
    "<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
    "<|eot_id|>", "<|pad|>",
)  # fmt: skip
CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{% generation %}{{- message['content'] | trim + '<|eot_id|>' }}{% endgeneration %}"
    "{%- else %}{{- message['content'] | trim + '<|eot_id|>' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}"
)
TEXTS = (
    "def add(x, y):\n    return x + y\n",
    "The quick brown fox jumps over the lazy dog.",
    "What is the capital of France? Paris is the capital of France.",
    "Numbers: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10.",
    "import os\nprint(os.getcwd())\n",
    "A user asks a question and the assistant answers it politely.",
)


def write_tokenizer(
    directory: str, *, vocab_size: int = 320, texts: Sequence[str] = TEXTS,
    chat_template: str | None = CHAT_TEMPLATE,
) -> str:  # fmt: skip
    """A byte-level BPE ``tokenizer.json`` + ``tokenizer_config.json`` in ``directory``;
    returns the tokenizer.json's path. ``chat_template`` None writes none."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    bpe = tokenizers.Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )  # fmt: skip
    bpe.train_from_iterator(list(texts) * 4, trainer)
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "tokenizer.json")
    bpe.save(path)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "pad_token": "<|pad|>",
        "model_max_length": 4096, "clean_up_tokenization_spaces": False,
    }  # fmt: skip
    if chat_template is not None:
        config["chat_template"] = chat_template
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return path


def write_tiny_llama(directory: str, *, seed: int = 0, tie: bool = False, **config) -> str:
    """`write_tokenizer` and a random ``LlamaForCausalLM`` of its vocabulary (float32,
    safetensors) in ``directory``; ``config`` overrides ``LlamaConfig``'s fields.
    Returns ``directory``."""
    import torch
    import transformers

    tokenizer_keys = {k: config.pop(k) for k in ("texts", "chat_template") if k in config}
    write_tokenizer(directory, **tokenizer_keys)
    vocab = transformers.PreTrainedTokenizerFast(
        tokenizer_file=os.path.join(directory, "tokenizer.json")
    ).vocab_size
    torch.manual_seed(seed)
    fields = dict(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rope_theta=10000.0, tie_word_embeddings=tie, bos_token_id=0, eos_token_id=4,
        pad_token_id=5,
    )  # fmt: skip
    fields.update(config)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**fields))
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def _example_texts() -> list[str]:
    """The texts of this folder's JSONL files (every message's content), for the tokenizer."""
    import glob
    import json

    texts = []
    for path in sorted(glob.glob(os.path.join(os.path.dirname(__file__), "*.jsonl"))):
        with open(path) as f:
            for line in f:
                row = json.loads(line)
                for value in row.values():
                    texts += [m["content"] for m in value] if isinstance(value, list) else [value]
    return texts


if __name__ == "__main__":
    import sys

    out = sys.argv[1] if len(sys.argv) > 1 else "runs/tiny-llama"
    print(write_tiny_llama(out, texts=list(TEXTS) + _example_texts()))
