"""GPT-2 small's architecture, byte-level, on one GPU or TPU host.

Trains the 12-layer, 768-wide, 12-head decoder of GPT-2 small (learned
positions, tied embeddings, context 1024; 124M parameters with GPT-2's
50,257-token vocabulary, 86M with bytes) in bf16 from float32 parameters,
with AdamW at 6e-4 (betas 0.9, 0.95; weight decay 0.1; gradients clipped at
norm 1; 100 warmup steps, cosine decay to 10%), a global batch
of 16 windows (16,384 tokens), with parameters and optimizer state sharded
over every local device (FSDP, ``fsdp=-1``; data parallelism instead:
``--config.mesh.data=-1 --config.mesh.fsdp=1``).
Attention runs through cuDNN's fused kernel on GPUs. Data: every ``.py`` file
of the interpreter's standard library (``python_stdlib/all_1024``: 29,025
train / 1,762 test windows of 1,024 bytes on CPython 3.11.7, 31.5 MB, built
offline in about 5 s on first use); 2,000 steps are about 1.1 epochs.

Expected: not measured end to end yet (no accelerator was available when it
was written). Issue 16 measured this shape at 35 ms per step of 16x1024 on one
H100 with a 50,304-token vocabulary, so the 2,000 steps should take about
1-2 minutes there; the eval loss should fall far below the ~3.2 nats/byte of a
byte-frequency model.

    python -m replicator train --config configs/lm_gpt2_124m.py --workdir runs/lm_gpt2_124m

Your own corpus: ``--config.dataset='text_files/block_size=1024,files=/data/corpus/**/*.txt'``
(text files as bytes, or ``.npy`` token ids with ``--config.model.vocab_size``
set to your tokenizer's, padded to a multiple of 128); a tfds text dataset
prepared in array_record format: ``--config.dataset='text_tfds/source=lm1b,block_size=1024'``.
Smoke mode for tests:
``--config configs/lm_gpt2_124m.py:smoke`` (a few steps of a tiny model in bf16).
"""

import ml_collections

from replicator.trainer.config import base_config


def get_config(mode: str = "") -> ml_collections.ConfigDict:
    c = base_config(mode)
    c.experiment = "experiments.lm"
    c.model = dict(
        vocab_size=256,  # bytes
        num_layers=12,
        num_heads=12,
        embed_dim=768,
        mlp_dim=3072,
        max_len=1024,  # the dataset's block size: windows of max_len + 1 tokens
        positions="learned",  # or "rotary"
        tie_embeddings=True,
        dropout_rate=0.0,
        attention="auto",  # splash on TPU, cuDNN on GPUs in bf16/fp16, XLA elsewhere
        scan_layers=True,  # one scanned block over stacked parameters (False: block_<i>)
        loss_chunk=0,  # e.g. 128: logits 128 positions at a time (large vocabularies); 0: all
    )
    c.dataset = "python_stdlib/all_1024"
    c.batch_size = 16  # global, in windows of 1024 tokens
    c.eval_batch_size = 32
    c.num_train_steps = 2000
    c.learning_rate = 6e-4
    c.optimizer = "adamw"
    c.optimizer_args = dict(b1=0.9, b2=0.95)
    c.weight_decay = 0.1  # decoupled, on the matrices only (not biases, norms)
    c.lr_schedule = "cosine"
    c.warmup_steps = 100  # linear warmup, then cosine decay to 10% at num_train_steps
    c.lr_end_fraction = 0.1
    c.grad_clip_norm = 1.0
    c.seed = 0
    c.mesh = dict(data=1, fsdp=-1, tensor=1)  # every axis, so each can be overridden
    c.precision = "bf16"
    c.log_every_steps = 50
    c.eval_every_steps = 500
    c.checkpoint_every_steps = 500
    c.best_metric = "loss"  # eval loss in nats per token
    c.best_mode = "min"

    if mode == "smoke":
        c.model.update(num_layers=1, num_heads=2, embed_dim=32, mlp_dim=128, max_len=128)
        c.dataset = "python_stdlib/modules_128"
        c.batch_size = 16
        c.eval_batch_size = 64
        c.num_train_steps = 4
        c.warmup_steps = 2
        c.log_every_steps = 2
        c.eval_every_steps = 2
        c.checkpoint_every_steps = 2
    return c
