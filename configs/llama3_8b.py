"""Llama 3 8B, exactly: the pod example for a pretrained model's shape.

Meta's Llama 3 8B (``LlamaForCausalLM``): a vocabulary of 128,256, 32 layers, 4096
wide, 32 query heads of 128 and 8 key/value heads (grouped-query attention), a
SwiGLU MLP of 14,336, RMSNorm (epsilon 1e-5), rotary positions of base 500,000, no
biases, untied input and output embeddings, context 8,192: 8.03B parameters. bf16
compute from float32 parameters and AdamW moments, sharded over every chip
(``fsdp=-1``), the 32 blocks one scanned block that keeps what its backward pass
needs but its norms and SwiGLU products (``remat_policy="minimal_with_context"``:
no matmul recomputed, and no attention kernel), Pallas splash attention
on TPU, the logits made 2,048 positions at a time (``loss_chunk``: the ``[batch,
8192, 128256]`` logits never exist at once). A global batch of 64 windows of 8,192
tokens (0.5M tokens a step: one window per chip of a v5p-128).

Compile it for the pod first (any machine with the ``tpu`` extra; about 4 minutes
for the train step on a busy 2-core CPU host):

    python -m replicator compile --config configs/llama3_8b.py --topology v5p-128

The train step needs 26.5 GiB of a v5p chip's 95.74 with the pods' compiler
(``--python 3.12``: jax 0.12.0.1, libtpu 0.0.52; parameters 480 MiB, AdamW state
959 MiB), 28.1 GiB with Python 3.11's (jax 0.10.2, libtpu 0.0.42.1), compiled from a
CPU host. Its
roofline is 1.01 s a step, bound by compute (4.6e14 FLOPs per chip, splash
attention's counted from its shapes): 79.9% MFU at the roofline, ``6 N T / (step x
64 chips x 459 TFLOP/s)`` with N = 7.50B parameters in matrix products (all but the
input embedding) and T = 524,288 tokens; MaxText's llama3-8b at its defaults reaches
76.4% by the same count (``docs/benchmarks.md``, "TPU programs"). The remat
policy: ``compile --fit`` (each policy compiled; nothing ran) found no remat at all
fastest, and ``minimal_with_context``, added after, is as fast in a third of the
memory, the tie the search now gives to memory:

    python -m replicator compile --config configs/llama3_8b.py --topology v5p-128 --fit

    remat_policy          HBM/chip   roofline   MFU at roofline
    None                  85.2 GiB   1.01 s     79.9%
    minimal_with_context  28.1 GiB   1.01 s     79.9%   (shipped; compiled alone)
    minimal               26.8 GiB   1.05 s     76.8%
    minimal_offloaded     10.8 GiB   1.05 s     (+19 GiB a step each way over PCIe)
    save_dot_except_mlp   12.6 GiB   1.18 s     68.1%
    save_qkv_proj         11.3 GiB   1.20 s     67.0%
    full                   8.5 GiB   1.23 s     65.4%

At MaxText's llama3-8b defaults (12 windows of 2,048 per chip, ``--config.batch_size=768
--config.model.max_len=2048 --config.dataset=python_stdlib/all_2048
--config.remat_policy=full``): 26.5 GiB (MaxText 21.0; 12.6 with
--config.model.loss_chunk=512) on the pods' compiler,
32.7 GiB on Python 3.11's, 3.15 s, 76.4% (``docs/benchmarks.md``,
"TPU programs", has MaxText's own compile beside it). Then on the pod
(``docs/pods.md``), every worker runs:

    python -m replicator train --config configs/llama3_8b.py --workdir gs://B/llama3_8b

Data: every ``.py`` file of the interpreter's standard library in windows of 8,192
bytes (``python_stdlib/all_8192``, built offline on first use): a stand-in that
uses 256 of the 128,256 token ids. For real work start from Meta's weights and
tokenizer: ``--config.init_from=hf:/ckpt/Meta-Llama-3-8B
--config.tokenizer=/ckpt/Meta-Llama-3-8B/tokenizer.json`` with a dataset tokenized
by it (``text_files/block_size=8192,files=...,tokenizer=...``). Llama 3.1 8B is the
same shape with ``rope_scaling=dict(factor=8.0, low_freq_factor=1.0,
high_freq_factor=4.0, original_max_position_embeddings=8192)`` in ``model``.

Expected: not measured (no TPU was available when it was written); by the roofline
the 1,000 steps take at least 17 minutes on a v5p-128. ``compile`` reads
``init_from``'s ``config.json`` alone, never its weights nor ``config.tokenizer`` (a
checkpoint on the pod's disk alone leaves the shape to ``model``, as written here);
a dataset named with ``tokenizer=FILE`` still reads FILE, whose fingerprint names it.
Smoke mode for tests: ``--config configs/llama3_8b.py:smoke`` (a few steps of a tiny
Llama, bf16, FSDP).
"""

import ml_collections

from replicator.trainer.config import base_config


def get_config(mode: str = "") -> ml_collections.ConfigDict:
    c = base_config(mode)
    c.experiment = "experiments.lm"
    c.model = dict(
        vocab_size=128_256,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        embed_dim=4096,
        mlp_dim=14_336,
        max_len=8192,
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
        loss_chunk=2048,  # logits 2,048 positions at a time
    )
    c.dataset = "python_stdlib/all_8192"
    c.batch_size = 64  # global, in windows of 8192 tokens
    c.eval_batch_size = 64
    c.num_train_steps = 1000
    c.learning_rate = 3e-4
    c.optimizer = "adamw"
    c.optimizer_args = dict(b1=0.9, b2=0.95)
    c.weight_decay = 0.1
    c.lr_schedule = "cosine"
    c.warmup_steps = 100
    c.lr_end_fraction = 0.1
    c.grad_clip_norm = 1.0
    c.seed = 0
    c.mesh = dict(data=1, fsdp=-1, tensor=1)
    c.step_path = "compile"
    c.precision = "bf16"
    c.remat_policy = "minimal_with_context"  # as fast as None on a v5p-128 (above)
    c.log_every_steps = 10
    c.eval_every_steps = 500
    c.checkpoint_every_steps = 250
    c.best_metric = "loss"
    c.best_mode = "min"

    if mode == "smoke":
        c.model.update(
            vocab_size=256, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
            embed_dim=32, mlp_dim=64, max_len=128, loss_chunk=64,
        )  # fmt: skip
        c.dataset = "python_stdlib/modules_128"
        c.batch_size = 16
        c.eval_batch_size = 64
        c.num_train_steps = 4
        c.warmup_steps = 2
        c.log_every_steps = 2
        c.eval_every_steps = 2
        c.checkpoint_every_steps = 2
    return c
