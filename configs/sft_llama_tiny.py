"""Supervised fine-tuning of a pretrained Llama on conversations, the loss on the
assistant's tokens only: docs/pretrained.md's second step, on a laptop's CPU.

Starts from the tiny random Llama that ``examples/post_training/tiny_llama.py`` writes
to ``runs/tiny-llama`` (a Hugging Face checkpoint: config.json, model.safetensors,
tokenizer.json and a chat template in tokenizer_config.json; ``init_from='hf:DIR'``
reads it and its config.json decides the model's shape) and trains every weight on
``examples/post_training/conversations.jsonl`` (600 chats with an arithmetic tutor, HF's
``messages`` layout), rendered by the checkpoint's own chat template, tokenized once and
packed whole into windows of 256 tokens (``chat/`` data: experiments/datasets/chat.py),
with ``objective='sft'``: cross-entropy on the assistant turns alone (transformers'
assistant mask), every other token of the window attending but never a target. Adam at
3e-3, a global batch of 8 windows, 60 steps.

    python examples/post_training/tiny_llama.py runs/tiny-llama
    python -m replicator train --config configs/sft_llama_tiny.py --workdir runs/sft_tiny

For your own checkpoint: ``--config.init_from=hf:DIR --config.tokenizer=DIR/tokenizer.json
--config.dataset='chat/files=/data/chats/*.jsonl,tokenizer=DIR,block_size=2048'
--config.model.max_len=2048``; ``--config.model.lora_rank=16`` trains LoRA adapters
instead of every weight.

Expected: test loss 2.91 (perplexity 18.4, 3.11 bits per byte) after 60 steps with
seed 0, about 30 s on a 2-core CPU; the start line counts 577 conversations in 158
windows, 6,643 assistant tokens trained. Smoke mode for tests: ``--config
configs/sft_llama_tiny.py:smoke`` (4 steps).
"""

import ml_collections

from replicator.trainer.config import base_config

MODEL_DIR = "runs/tiny-llama"  # examples/post_training/tiny_llama.py writes it
DATA = "examples/post_training"


def get_config(mode: str = "") -> ml_collections.ConfigDict:
    c = base_config(mode)
    c.experiment = "experiments.lm"
    c.init_from = f"hf:{MODEL_DIR}"  # config.json sets the model's shape keys
    c.tokenizer = f"{MODEL_DIR}/tokenizer.json"
    c.dataset = f"chat/files={DATA}/conversations.jsonl,tokenizer={MODEL_DIR},block_size=256"
    c.objective = "sft"
    c.model = dict(max_len=256, attention="auto", scan_layers=True, dropout_rate=0.0)
    c.batch_size = 8
    c.eval_batch_size = 16
    c.num_train_steps = 60
    c.learning_rate = 3e-3
    c.lr_schedule = "cosine"
    c.warmup_steps = 5
    c.optimizer = "adam"
    c.seed = 0
    c.mesh = dict(data=1, fsdp=-1, tensor=1)
    c.log_every_steps = 10
    c.eval_every_steps = 30
    c.checkpoint_every_steps = 30
    c.best_metric = "loss"
    c.best_mode = "min"
    if mode == "smoke":
        c.num_train_steps = 4
        c.warmup_steps = 1
        c.log_every_steps = c.eval_every_steps = c.checkpoint_every_steps = 2
    return c
