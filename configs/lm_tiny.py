"""A tiny byte-level language model on the Python standard library's sources, on CPU.

Trains a 2-layer, 128-wide GPT-style decoder (learned positions, tied
embeddings, 0.45M parameters) on windows of 128 bytes from the 168 top-level
modules of the standard library that ships with the interpreter
(``python_stdlib/modules_128``: 36,123 train / 584 test windows on CPython
3.11.7, built offline in about 1 s on first use), with Adam at 1.5e-3 and a
global batch of 32 windows (4,096 tokens), on every local device with its
parameters and Adam state sharded over them (FSDP, ``fsdp=-1``; ZeRO inside
the per-replica step: the same bytes between devices as data parallelism,
1/N of the state on each). Data parallelism instead:
``--config.mesh.data=-1 --config.mesh.fsdp=1``.

Expected: the first train loss is about ln 256 = 5.5 nats per byte (3.5 at the
first record, step 10); eval loss 2.54 (perplexity 12.7) after 100 steps, 2.32
after 200 and 2.14 (perplexity 8.46) after 300 on the 584 test windows, with
seed 0 (``tests/test_configs.py`` checks the first of these). Runtime:
about 40 s on a 2-core CPU with 8 fake devices (0.1 s per step), holding
0.71 MB of state per device (5.35 MB with data parallelism).

    python -m replicator train --config configs/lm_tiny.py --workdir runs/lm_tiny

Your own text instead: ``--config.dataset='text_files/block_size=128,files=/data/*.txt'``
(see ``experiments/datasets/text.py``). Smoke mode for tests:
``--config configs/lm_tiny.py:smoke`` (a few steps of a smaller model).
"""

import ml_collections

from replicator.trainer.config import base_config


def get_config(mode: str = "") -> ml_collections.ConfigDict:
    c = base_config(mode)
    c.experiment = "experiments.lm"
    c.model = dict(
        vocab_size=256,  # bytes
        num_layers=2,
        num_heads=4,
        embed_dim=128,
        mlp_dim=512,
        max_len=128,  # the dataset's block size: windows of max_len + 1 tokens
        positions="learned",  # or "rotary"
        tie_embeddings=True,
        dropout_rate=0.0,
        attention="auto",  # splash on TPU, cuDNN on GPUs in bf16/fp16, XLA elsewhere
        scan_layers=True,  # one scanned block over stacked parameters (False: block_<i>)
        loss_chunk=0,  # e.g. 128: logits 128 positions at a time (large vocabularies); 0: all
    )
    c.dataset = "python_stdlib/modules_128"
    c.batch_size = 32  # global, in windows of 128 tokens
    c.eval_batch_size = 64
    c.num_train_steps = 300
    c.learning_rate = 1.5e-3
    c.optimizer = "adam"
    c.seed = 0
    c.mesh = dict(data=1, fsdp=-1, tensor=1)  # every axis, so each can be overridden
    c.log_every_steps = 10
    c.eval_every_steps = 100
    c.checkpoint_every_steps = 100
    c.best_metric = "loss"  # eval loss in nats per token
    c.best_mode = "min"

    if mode == "smoke":
        c.model.update(num_layers=1, num_heads=2, embed_dim=32, mlp_dim=128)
        c.batch_size = 16
        c.num_train_steps = 4
        c.log_every_steps = 2
        c.eval_every_steps = 2
        c.checkpoint_every_steps = 2
    return c
