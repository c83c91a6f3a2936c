"""Qwen3-30B-A3B's shape: a fine-grained mixture of experts (128 experts, top 8), dropless.

Qwen's Qwen3-30B-A3B (``Qwen3MoeForCausalLM``): a vocabulary of 151,936, 48 layers,
2048 wide, 32 query heads of 128 (``head_dim`` free of the width) over 4 key/value
heads, RMSNorm (epsilon 1e-6), rotary positions of base 1,000,000, no biases,
untied embeddings, each head's queries and keys RMS-normalised (``qk_norm``); every
block's MLP a mixture of 128 SwiGLU experts of 768, each token routed to its top 8
with the gates renormalised over them (its ``norm_topk_prob=True``:
``expert_routing="mixtral"``; ``"switch"`` is ``norm_topk_prob=False``): 30.5B
parameters, 3.3B active per token. Dropless
(``expert_capacity_factor=None``, `replicator.parallel.dropless`): every token's 8
experts computed exactly once, none dropped, no FLOP on padding. bf16 compute
from float32 parameters and AdamW moments over every chip (``fsdp=-1``, MaxText's
default layout), the 48 blocks one scanned block under remat ``full``, splash
attention on TPU, the logits 512 positions at a time. MaxText's ``qwen3-30b-a3b``
defaults for the batch: 12 windows of 2,048 tokens per chip, 768 on a v5p-128.

Compile it for the pod first (no TPU needed; ``docs/benchmarks.md``, "Mixture of
experts on a pod", has it beside MaxText's own compile):

    python -m replicator compile --config configs/qwen3_30b_a3b.py --topology v5p-128 --python 3.12
    python -m replicator compile --config configs/qwen3_30b_a3b.py --topology v5p-128 --fit

The train step needs 19.7 GB per chip of a v5p's 102.8 with the pods' compiler
(``--python 3.12``: jax 0.12.0.1, libtpu 0.0.52; 70 s to compile on a quiet 2-core
host); its roofline is 1.60 s a step, bound by compute: 61.1% MFU at the
roofline, ``6 N T / (step x 64 chips x 459 TFLOP/s)`` with N = 3.04B parameters in a
token's matrix products (its eight experts') and T = 1,572,864 tokens. MaxText 0.2.5's
``qwen3-30b-a3b`` at the same defaults: 27.5 GB per chip, 1.71 s bound by HBM, 57.3%.

then train on the pod (``docs/pods.md``): every worker runs

    python -m replicator train --config configs/qwen3_30b_a3b.py --workdir gs://B/qwen3_moe

Data: the interpreter's standard library in windows of 2,048 bytes
(``python_stdlib/all_2048``), a stand-in: start from the released weights and
tokenizer for real work (docs/pretrained.md).

Expected: not measured (no TPU was available when it was written); by the roofline the
1,000 steps take at least 27 minutes on a v5p-128.
Smoke mode for tests: ``--config configs/qwen3_30b_a3b.py:smoke`` (a few steps of a
tiny dropless MoE, 8 experts top 4).
"""

import ml_collections

from replicator.trainer.config import config_beside


def get_config(mode: str = "") -> ml_collections.ConfigDict:
    # Mixtral's recipe (data, batch, optimizer, mesh, precision, remat, records), this shape.
    c = config_beside(__file__, "mixtral_8x7b.py", mode)
    c.model.update(norm_eps=1e-6, qk_norm=True)
    c.model.expert_routing = "mixtral"  # renormalised over the 8: norm_topk_prob=True
    if mode == "smoke":
        c.model.update(head_dim=16, mlp_dim=16, num_experts=8, experts_per_token=4)
        return c
    c.model.update(
        vocab_size=151_936, num_layers=48, num_kv_heads=4, embed_dim=2048,
        mlp_dim=768,  # each expert's
        loss_chunk=512, num_experts=128, experts_per_token=8,
    )  # fmt: skip
    return c
