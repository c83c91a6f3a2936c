"""Mixtral 8x7B's shape: a sparse mixture-of-experts LM on a TPU pod, dropless.

Mistral AI's Mixtral 8x7B (``MixtralForCausalLM``): a vocabulary of 32,000, 32
layers, 4096 wide, 32 query heads of 128 over 8 key/value heads, RMSNorm (epsilon
1e-5), rotary positions of base 1,000,000, no biases, untied embeddings; every
block's MLP a mixture of 8 SwiGLU experts of 14,336, each token routed to its top
2 (gates renormalised over the two: ``expert_routing="mixtral"``): 46.7B
parameters, 12.9B of them active per token. Dropless (``expert_capacity_factor=None``,
`replicator.parallel.dropless`): every token's two experts computed exactly once,
nothing dropped, no FLOP on padding. bf16 compute from float32 parameters and
AdamW moments, sharded over every chip (``fsdp=-1``, MaxText's default layout:
no expert parallelism, each expert's weights split over every chip), the 32 blocks
one scanned block under remat ``full``; splash attention on TPU; the logits made
1,024 positions at a time. MaxText's ``mixtral-8x7b`` defaults for the batch: 12
windows of 2,048 tokens per chip, 768 on a v5p-128 (1.5M tokens a step).

Compile it for the pod first (no TPU needed; ``docs/benchmarks.md``, "Mixture of
experts on a pod", has the numbers beside MaxText's own compile):

    python -m replicator compile --config configs/mixtral_8x7b.py --topology v5p-128 --python 3.12
    python -m replicator compile --config configs/mixtral_8x7b.py --topology v5p-128 --fit

The train step needs 29.2 GB per chip of a v5p's 102.8 with the pods' compiler
(``--python 3.12``: jax 0.12.0.1, libtpu 0.0.52), MaxText 0.2.5's ``mixtral-8x7b`` at
the same defaults 30.9 GB; its roofline is 5.66 s a step, bound by compute (MaxText's
5.64 s): 72.4% MFU at the roofline, ``6 N T / (step x 64 chips x 459 TFLOP/s)`` with N
= 12.75B parameters in a token's matrix products (its two experts') and T = 1,572,864
tokens.

then train on the pod (``docs/pods.md``): every worker runs

    python -m replicator train --config configs/mixtral_8x7b.py --workdir gs://B/mixtral

For real work start from the released weights: ``--config.init_from=hf:/ckpt/Mixtral-8x7B-v0.1
--config.tokenizer=/ckpt/Mixtral-8x7B-v0.1/tokenizer.json`` (docs/pretrained.md), with
a dataset tokenized by it. Data here: the interpreter's standard library in windows
of 2,048 bytes (``python_stdlib/all_2048``), a stand-in using 256 of the 32,000 ids.

Expected: not measured (no TPU was available when it was written); by the roofline the
1,000 steps take at least 94 minutes on a v5p-128.
Smoke mode for tests: ``--config configs/mixtral_8x7b.py:smoke`` (a few steps of a
tiny dropless MoE, 4 experts top 2).
"""

import ml_collections

from replicator.trainer.config import base_config


def get_config(mode: str = "") -> ml_collections.ConfigDict:
    c = base_config(mode)
    c.experiment = "experiments.lm"
    c.model = dict(
        vocab_size=32_000,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        embed_dim=4096,
        mlp_dim=14_336,  # each expert's
        max_len=2048,
        norm="rmsnorm",
        norm_eps=1e-5,
        mlp_activation="swiglu",
        positions="rotary",
        rope_theta=1_000_000.0,
        tie_embeddings=False,
        use_bias=False,
        dropout_rate=0.0,
        attention="auto",  # splash on TPU, cuDNN on GPUs in bf16/fp16, XLA elsewhere
        scan_layers=True,
        loss_chunk=1024,
        num_experts=8,
        experts_per_token=2,
        expert_capacity_factor=None,  # dropless
        expert_routing="mixtral",
        moe_every=1,
    )
    c.dataset = "python_stdlib/all_2048"
    c.batch_size = 768  # global: 12 windows of 2,048 per chip on a v5p-128, MaxText's
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
    c.remat_policy = "full"
    c.log_every_steps = 10
    c.eval_every_steps = 500
    c.checkpoint_every_steps = 250
    c.best_metric = "loss"
    c.best_mode = "min"

    if mode == "smoke":
        c.model.update(
            vocab_size=256, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
            embed_dim=32, mlp_dim=32, max_len=128, loss_chunk=64, num_experts=4,
        )  # fmt: skip
        c.dataset = "python_stdlib/modules_128"
        # XLA:CPU (jaxlib 0.10.2) aborts compiling the MoE layer's bf16 all-reduces on
        # several fake devices (capacity or dropless alike): the smoke runs in float32.
        c.precision = "fp32"
        c.batch_size = 16
        c.eval_batch_size = 64
        c.num_train_steps = 4
        c.warmup_steps = 2
        c.log_every_steps = 2
        c.eval_every_steps = 2
        c.checkpoint_every_steps = 2
    return c
