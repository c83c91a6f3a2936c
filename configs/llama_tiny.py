"""A tiny Llama-family language model on the Python standard library's sources, on CPU.

Trains a 2-layer, 64-wide decoder of the Llama 3 shape (RMSNorm, grouped-query
attention with 4 query heads of 16 and 2 key/value heads, a SwiGLU MLP of 176,
rotary positions of base 500,000, no biases, untied input and output embeddings:
0.13M parameters) on windows of 128 bytes from the 168 top-level modules of the
standard library that ships with the interpreter (``python_stdlib/modules_128``,
built offline in about 1 s on first use), with Adam at 3e-3 and a global batch of
32 windows, on every local device with its parameters and Adam state sharded over
them (``fsdp=-1``). The same model keys describe Llama 3 8B (``configs/llama3_8b.py``)
and the checkpoints ``init_from='hf:DIR'`` reads.

Expected: the first train loss is about ln 256 = 5.5 nats per byte (3.8 at the
first record, step 10); eval loss 2.38 (perplexity 10.8) after 100 steps and 1.82
(perplexity 6.2) after 300 on the 584 test windows, with seed 0 (lm_tiny's GPT-2
block, 3.6 times the parameters: 2.14). Runtime: 9 minutes on one device of a
2-core CPU shared with other jobs (1.4 s a step; 46 s compiling), holding 1.5 MB of
state.

    python -m replicator train --config configs/llama_tiny.py --workdir runs/llama_tiny

Smoke mode for tests: ``--config configs/llama_tiny.py:smoke`` (a few steps of a
1-layer model).
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
        num_kv_heads=2,  # grouped-query attention: each key/value head serves 2 query heads
        head_dim=16,
        embed_dim=64,
        mlp_dim=176,  # about 8/3 of the width, as Llama's SwiGLU
        max_len=128,  # the dataset's block size: windows of max_len + 1 tokens
        norm="rmsnorm",
        norm_eps=1e-5,
        mlp_activation="swiglu",
        positions="rotary",
        rope_theta=500_000.0,
        tie_embeddings=False,
        use_bias=False,
        dropout_rate=0.0,
        attention="auto",  # splash on TPU, cuDNN on GPUs in bf16/fp16, XLA elsewhere
        scan_layers=True,
        loss_chunk=0,
    )
    c.dataset = "python_stdlib/modules_128"
    c.batch_size = 32  # global, in windows of 128 tokens
    c.eval_batch_size = 64
    c.num_train_steps = 300
    c.learning_rate = 3e-3
    c.optimizer = "adam"
    c.seed = 0
    c.mesh = dict(data=1, fsdp=-1, tensor=1)  # every axis, so each can be overridden
    c.log_every_steps = 10
    c.eval_every_steps = 100
    c.checkpoint_every_steps = 100
    c.best_metric = "loss"  # eval loss in nats per token
    c.best_mode = "min"

    if mode == "smoke":
        c.model.update(num_layers=1, embed_dim=32, head_dim=8, mlp_dim=64)
        c.batch_size = 16
        c.num_train_steps = 4
        c.log_every_steps = 2
        c.eval_every_steps = 2
        c.checkpoint_every_steps = 2
    return c
